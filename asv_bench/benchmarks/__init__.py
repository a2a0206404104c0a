"""kvreg's asv suite (one module per area; shared pieces in ``common``).

asv runs benchmarks with a clean environment (PYTHONPATH dropped). Under
``asv run --python=same`` in a checkout where kvreg (or kvreg-conformance,
whose fill helpers build the layers) is not installed, the suite falls back
to the working tree it lives in, so that what is measured is this checkout,
never an unrelated installed copy."""

import importlib.util
import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
for _package, _folder in (("kvreg", _ROOT), ("kvreg_conformance", os.path.join(_ROOT, "conformance"))):
    if importlib.util.find_spec(_package) is None:
        sys.path.insert(0, _folder)
