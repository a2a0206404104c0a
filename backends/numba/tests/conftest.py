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

    monkeypatch.setattr(config, "DECODE_BLOCK", 4)
    monkeypatch.setattr(config, "CHUNK_Q_TILE", 3)
    monkeypatch.setattr(config, "CHUNK_TILE_BYTES", 1 << 20)
    monkeypatch.setattr(config, "BOUNDED_BLOCK", 5)
    monkeypatch.setattr(config, "NYSTROM_PREFILL_ROWS", 7)
    return config
