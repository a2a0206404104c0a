"""The conformance suite's pytest plugin (entry point ``pytest11``): its options.

Registered for every pytest session where kvreg-conformance is installed, it only adds
``--kvreg-backend``, ``--kvreg-device`` and ``--kvreg-profile``; everything else lives in the
suite's own ``conftest.py`` and runs only when the suite is collected
(``pytest --pyargs kvreg_conformance --kvreg-backend NAME``). An option must
exist before the command line is parsed, which a conftest inside an
installed package cannot guarantee.
"""


def pytest_addoption(parser):
    g = parser.getgroup("kvreg", "kvreg conformance")
    g.addoption("--kvreg-backend", default=None,
                help="backend under test (default: KVREG_BACKEND or 'reference')")
    g.addoption("--kvreg-device", default=None,
                help="device spec of the backend (default: KVREG_DEVICE or the backend's default)")
    g.addoption("--kvreg-profile", default=None, choices=PROFILES,
                help="how thorough a run is: quick (the suite's quick cases, few examples), default, or "
                     "full (every case, many examples; kvreg's own tests: the full tier). "
                     "Default: KVREG_PROFILE or 'default'")


#: How thorough a run is (``--kvreg-profile`` / ``KVREG_PROFILE``).
PROFILES = ("quick", "default", "full")


def profile(config) -> str:
    """The run's profile: ``--kvreg-profile``, else ``KVREG_PROFILE``, else ``default``."""
    import os

    import pytest

    chosen = config.getoption("--kvreg-profile", None) or os.environ.get("KVREG_PROFILE", "").strip() or "default"
    if chosen not in PROFILES:
        raise pytest.UsageError(f"KVREG_PROFILE={chosen!r}: expected one of {', '.join(PROFILES)}")
    return chosen
