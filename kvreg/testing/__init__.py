"""Test helpers shared by kvreg's tests, the conformance suite and the reports:
seeded data generators and slow float64 oracles."""


def startable_backends(names=None) -> list:
    """pytest parameters of the registered backends ``names`` (None: all of
    them), each that cannot start on this machine (``kvreg.get_backend``
    raises BackendError: no device, or a device whose compiler cannot build
    for it) marked skip with its reason, so the test reports why."""
    import pytest

    from kvreg import registry
    from kvreg.errors import BackendError

    have = registry.backends()
    out = []
    for n in sorted(have) if names is None else [n for n in names if n in have]:
        try:
            registry.get_backend(n)
            marks = ()
        except BackendError as exc:
            marks = pytest.mark.skip(reason=f"backend {n!r} cannot start here: {exc}")
        out.append(pytest.param(n, marks=marks))
    return out
