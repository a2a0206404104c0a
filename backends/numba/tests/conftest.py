import sys
from pathlib import Path

import pytest

# Run from a checkout without installing kvreg-numba (or kvreg).
_HERE = Path(__file__).resolve().parent
for p in (_HERE.parent, _HERE.parents[2]):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


@pytest.fixture
def small_blocks(monkeypatch):
    """Shrink the tunables so a few dozen rows take the multi-block paths."""
    from kvreg_numba import config

    for name, value in config.SMALL.items():
        monkeypatch.setattr(config, name, value)
    return config
