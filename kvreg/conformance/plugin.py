"""kvreg's pytest plugin (entry point ``pytest11``): the conformance suite's options.

Registered for every pytest session where kvreg is installed, it only adds
``--kvreg-backend`` and ``--kvreg-device``; everything else lives in the
suite's own ``conftest.py`` and runs only when the suite is collected
(``pytest --pyargs kvreg.conformance --kvreg-backend NAME``). An option must
exist before the command line is parsed, which a conftest inside an
installed package cannot guarantee.
"""


def pytest_addoption(parser):
    g = parser.getgroup("kvreg", "kvreg conformance")
    g.addoption("--kvreg-backend", default=None,
                help="backend under test (default: KVREG_BACKEND or 'reference')")
    g.addoption("--kvreg-device", default=None,
                help="device spec of the backend (default: KVREG_DEVICE or the backend's default)")
