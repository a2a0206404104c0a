"""Every tunable of the Numba backend, in one place.

Block sizes are read by the Python wrappers at call time and passed to the
kernels as arguments, so a test can shrink them (``monkeypatch.setattr``) to
run the multi-block paths on tiny inputs without recompiling anything.
The compile-time flags (``FASTMATH``, ``CACHE``, ``F16_FPEXT``) are read
once, when the kernel modules are first imported.
"""

from __future__ import annotations

import contextlib
import os

#: Rows per decode block. Each block's K rows are read once for every head
#: of the group; blocks are the unit of parallel work and of the fixed-order
#: partial-softmax merge. 16k rows, 32/8 heads, hd 128 measured 0.54 / 0.61 /
#: 0.65 / 0.68 of the stream bandwidth at 128 / 256 / 512 / 1024 rows, and
#: 0.69 / 0.73 / 0.76 at 512 / 2048 / 4096 in a later interleaved sweep
#: (fewer merges and per-task setups). 2048 still gives 16 tasks at 4k rows
#: over 8 KV groups, enough for a 16-core host.
DECODE_BLOCK = 2048

#: Bytes ahead of the row being read that the decode passes prefetch
#: (``llvm.prefetch``, every 64-byte line of the row; 0 = none), by the host
#: CPU LLVM names (``kvreg bench kernels`` measures them against the
#: machine's stream read; the distances below won there). Zen 4's hardware
#: prefetcher follows a row stream alone, and the hints only take its fill
#: buffers; the other Zen cores gain from hints well ahead; an Intel Xeon
#: with AVX-512 and AMX peaked near 2 KiB, with its last-level cache holding
#: 4k rows whatever the distance.
#:
#: So none on Zen 4, 8 KiB on the other Zen cores (``znver*``; measured on
#: Zen 5), 2 KiB elsewhere. The hd-256 passes, whose rows no hardware
#: prefetcher follows, hint on every CPU (``sweeps.HINT_ROWS``). A hint: no
#: value depends on it. Compiled in: a
#: change needs a fresh compile (``KVREG_NUMBA_CACHE=0`` or a new
#: ``NUMBA_CACHE_DIR``; numba's cache is kept per CPU model).
def _prefetch_bytes() -> int:
    try:
        from llvmlite import binding

        cpu = binding.get_host_cpu_name()
    except Exception:  # no llvmlite: the kernels cannot load either
        cpu = ""
    if cpu == "znver4":
        return 0
    return 8192 if cpu.startswith("znver") else 2048


PREFETCH_BYTES = _prefetch_bytes()

#: Batched-decode tasks handed to a thread at a time (dynamic scheduling;
#: 0 = numba's static split into one chunk per thread).
TASK_CHUNK = 4

#: Reads a decode helper thread makes of the newest call's number before it
#: sleeps (kvreg_numba.pool._Helpers): ~100 µs on a 2026 x86 core, long
#: enough to catch a model's next layer, short enough not to hold a core
#: the host's own threads want for long.
HELPER_SPIN = 200_000

#: Panel rows (query rows x the group's heads) of one tile of the
#: register-tiled prefill kernel (kvreg_numba.chunk), per 64 channels of
#: hd: its scores (``rows x keys x 4`` bytes) stay in cache between the
#: score, softmax and value passes, and each packed K block serves
#: ``rows / 6`` register tiles. One core of a Xeon (AVX-512), 4k chunk from
#: row 0, ms at 12 / 24 / 48 / 96 rows: 9/3 heads hd 64 176-183 / 171-176 /
#: 164-179 / 160-175; 4/1 heads hd 256 (per 64 channels: 3 / 6 / 12 / 24)
#: 344-359 / 294-300 / 266-273 / 250-261. The bits do not depend on it.
CHUNK_TILE_ROWS = 24

#: Most query rows per tile of the BLAS prefill path (per head; the
#: group's heads are stacked, so a tile is ``hpk * rows`` GEMM rows against
#: the keys any row of the tile can see). Thin tiles waste less of the
#: causal triangle and keep a tile's scores in cache. Measured on one core
#: (Zen 5, OpenBLAS on one thread), ms at 64 / 128 / 256 / 512 rows: a 4k
#: chunk from row 0 at 9/3 heads, hd 64: 219-244 / 237-256 / 273-278 /
#: 297 (SDPA 245-280); 4/1 heads, hd 256: 373 / 363 / 379 / 401 (SDPA 446),
#: with a 512 window 95 / 101 / 121 / 165; a 512-row chunk after 8k rows:
#: 188 / 175 / - / 183 (9/3, hd 64), 865 / 859 / - / 893 (32/8, hd 128).
#: (An older measurement on another machine, b=512 after 8k rows, favoured
#: 512.) The bits depend on the tile, not on any thread count.
CHUNK_Q_TILE = 64

#: Longest reduction handed to one BLAS call of the prefill chunk (hd for
#: the scores, keys for the values): longer ones are sliced and the slices'
#: products added in order, so the bits do not depend on BLAS's thread count
#: (OpenBLAS 0.3.31 gave the same bits on 1 and 2 threads up to 384, not at
#: 512 or 1000).
GEMM_K_BLOCK = 256

#: Cap on one tile's score matrix (``hpk * rows * keys * 4`` bytes): the
#: tile shrinks (evenly) so long contexts do not allocate gigabytes.
CHUNK_TILE_BYTES = 64 << 20

#: Ring rows per task of the bounded (``swa_sink_v1``) attend kernel: the
#: unit of parallel work and of the block-order softmax merge, as in decode.
BOUNDED_BLOCK = 256

#: Far rows per step of the Nyström prefill kernel: each step converts this
#: many K and V rows to float64 (K as rows, V transposed) and runs two small
#: GEMMs against them; 128 rows keep both panels and the logit block in L2.
NYSTROM_PREFILL_ROWS = 128

#: LLVM fast-math flags of the kernels: none. Any fast-math flag lets LLVM
#: pick a different evaluation order or fuse a multiply-add depending on
#: what it sees (inlining, a callee loaded from the on-disk cache rather
#: than compiled fresh): a cold process and a warm one then disagreed in the
#: last bits (up to 2.4e-7, enough to flip a greedy token). Without them
#: every result is the source's IEEE arithmetic, so the bits are the same
#: cold or warm, on 1 or N threads, on any vector width. The speed comes
#: from explicit code instead: fixed-order lane reductions
#: (:func:`kvreg_numba.intrinsics.lane_dot` / ``lane_sum``) and elementwise
#: loops the vectorizer takes without reassociation.
FASTMATH = frozenset()

#: Cache compiled kernels on disk (``__pycache__`` beside the modules), so a
#: second process starts warm. ``KVREG_NUMBA_CACHE=0`` turns it off.
CACHE = os.environ.get("KVREG_NUMBA_CACHE", "1") != "0"

#: Bytes streamed by :func:`kvreg_numba.bandwidth.stream_read_bandwidth`.
BANDWIDTH_BYTES = 512 << 20

#: How the kernels widen binary16 (f16 storage) rows: ``"auto"`` uses LLVM's
#: ``fpext half -> float`` where numba targets a CPU with F16C (x86's
#: conversion instructions), else an exact integer decode
#: (:func:`kvreg_numba.intrinsics.ir_widen`); ``"0"`` forces the integer
#: decode (the tests run it too). Read once, when the kernels are imported.
#: ``KVREG_NUMBA_F16_FPEXT``.
F16_FPEXT = os.environ.get("KVREG_NUMBA_F16_FPEXT", "auto").strip().lower()

#: Small values of the block sizes (``NumbaBackend.small_tunables``, the
#: conformance suite and the tests): a few dozen rows then take every
#: multi-block path (several decode blocks, prefill tiles, ring blocks).
SMALL = {"DECODE_BLOCK": 4, "CHUNK_Q_TILE": 3, "CHUNK_TILE_BYTES": 1 << 20, "BOUNDED_BLOCK": 5,
         "NYSTROM_PREFILL_ROWS": 7}


@contextlib.contextmanager
def small():
    """Inside the block the tunables of :data:`SMALL` take its values (read
    at call time, so nothing recompiles)."""
    saved = {name: globals()[name] for name in SMALL}
    globals().update(SMALL)
    try:
        yield
    finally:
        globals().update(saved)
