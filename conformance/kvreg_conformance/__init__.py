"""kvreg's conformance suite: what a backend must pass on a device.

Install it with ``pip install kvreg[conformance]`` (the ``kvreg-conformance``
distribution) and run it with ``python -m pytest --pyargs kvreg_conformance
--kvreg-backend NAME [--kvreg-device SPEC]`` or ``kvreg conformance --backend
NAME``. The suite is run against a backend, never edited for one: known gaps
are data (``kvreg_conformance/xfail/<backend>.txt``, or a list the backend
ships), tolerances live in one table (:mod:`kvreg_conformance.tolerances`).

Beside the cases, the package holds what tests and benchmarks of kvreg and
its backends compare and fill with: the one float64 oracle
(:mod:`kvreg_conformance.oracle`), deterministic inputs
(:mod:`kvreg_conformance.data`), layers filled fast
(:mod:`kvreg_conformance.fill`) and :func:`startable_backends`.
"""

__version__ = "0.1.0"


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
