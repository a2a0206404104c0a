"""Row storage: one layer's rows, head-major, one class per family of KV
modes behind the :class:`Storage` interface (its contract: :mod:`.base`).

* :class:`DenseStorage`: ``f32``, ``f16``, ``bf16``;
* :class:`Int8Storage`: ``q8``, ``q8k``, ``q8v`` and the seed's ``q8_2f``,
  ``q8k_2f``, ``q8v_2f`` (int8 codes, a float16 window, exact sink rows,
  the seed's frozen field);
* :class:`TieredStorage`: ``q4`` (rows aging through float16, int8, int4);
* :class:`KiviStorage`: ``q2`` (a float16 window, then 2-bit blocks: K per
  channel, V per row).

:func:`make_storage` builds the one a mode wants.
"""

from __future__ import annotations

from ..modes import KvMode
from .base import FLOOR_LOG, Storage, next_generation
from .dense import DenseStorage
from .int8 import Int8Storage
from .kivi import KiviStorage
from .tiered import TieredStorage

__all__ = ["FLOOR_LOG", "DenseStorage", "Int8Storage", "KiviStorage", "Storage", "TieredStorage", "make_storage",
           "next_generation"]


def make_storage(num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int = 0) -> Storage:
    """An empty storage of ``mode``'s family; ``exact_rows``: the rows of
    each head a q8 storage also keeps in float32 (q4 and q2 keep their own count)."""
    if mode is KvMode.Q2:
        return KiviStorage(num_kv_heads, head_dim, mode, exact_rows)
    family = TieredStorage if mode.tiered else Int8Storage if mode.quantized else DenseStorage
    return family(num_kv_heads, head_dim, mode, exact_rows)
