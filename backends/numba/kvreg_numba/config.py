"""Every tunable of the Numba backend, in one place.

Block sizes are read by the Python wrappers at call time and passed to the
kernels as arguments, so a test can shrink them (``monkeypatch.setattr``) to
run the multi-block paths on tiny inputs without recompiling anything.
The compile-time flags (``FASTMATH``, ``CACHE``) are read once, when
:mod:`kvreg_numba.kernels` is first imported.
"""

from __future__ import annotations

import os

#: Rows per decode block. Each block's K rows are read once for every head
#: of the group and its scores stay in L1; blocks are the unit of parallel
#: work and of the fixed-order partial-softmax merge. 256 rows x 128 ch x 4 B
#: = 128 KiB of K and of V per block.
DECODE_BLOCK = 256

#: Query rows per tile of the prefill chunk kernel (per head; the group's
#: heads are stacked, so a tile is ``hpk * CHUNK_Q_TILE`` GEMM rows).
CHUNK_Q_TILE = 64

#: Rows per block of the importance pass (a unit of parallel work).
IMP_BLOCK = 4096

#: Below this many (rows x heads) a chunk attend runs its groups serially;
#: above, groups and query tiles are spread over the threads.
CHUNK_PARALLEL_MIN = 1 << 16

#: LLVM fast-math flags of the attention kernels. ``reassoc`` lets LLVM
#: vectorize the dot products and sums; ``contract`` allows FMA. No flag that
#: changes inf/NaN semantics (``nnan``/``ninf``): a -inf score must still give
#: a probability of exactly 0. Quantization never uses fast-math (exact class).
FASTMATH = frozenset({"reassoc", "contract", "nsz", "arcp", "afn"})

#: Cache compiled kernels on disk (``__pycache__`` beside kernels.py), so a
#: second process starts warm. ``KVREG_NUMBA_CACHE=0`` turns it off.
CACHE = os.environ.get("KVREG_NUMBA_CACHE", "1") != "0"

#: Bytes streamed by :func:`kvreg_numba.bandwidth.stream_read_bandwidth`.
BANDWIDTH_BYTES = 512 << 20
