"""Tunables of the OpenCL backend, in one place.

Tests shrink these (``monkeypatch.setattr(config, "BLOCK_ROWS", 8)``) so the
multi-block and multi-chunk paths run on tiny inputs. Each is read at launch
time, never cached at import.

Bit-for-bit invariants (grouped == per-head, window == masked, trimmed ==
untrimmed, upto == sequential) hold for ANY values here as long as they stay
fixed between the calls being compared: the block grid depends on these and
on the visible span only, never on the head count or the row offset.
"""

from __future__ import annotations

import contextlib

#: Work-items per work-group of the attend kernels (dim 0); None = by device
#: kind (below). PoCL runs a work-group as a loop on one core, so a CPU wants
#: few work-items; a GPU wants at least a warp/wavefront.
LOCAL_SIZE: int | None = None
LOCAL_SIZE_CPU = 1
LOCAL_SIZE_GPU = 64

#: Rows of one KV head per work-group ("flash-decoding" block). The scores of
#: a block live in local memory: HEADS_PER_WG * BLOCK_ROWS * 4 bytes.
BLOCK_ROWS = 512

#: Q heads of one KV group that share a work-group (and one read of the K
#: block). A group with more heads is split into chunks of this size. A
#: build-time constant of the attend program (private accumulator arrays).
HEADS_PER_WG = 8

#: Prefill (`attend_chunk`): query tokens per launch, bounding the scratch
#: buffers (partials, and scores when importance is requested).
CHUNK_TOKENS = 64

#: Device row capacity of a fresh mirror; grows by doubling on the device.
MIRROR_MIN_ROWS = 256

#: Whether the attention program spells its vector loads, stores and
#: conversions as dereferences and clang builtins (cl/common.h,
#: KVREG_INLINE_VEC) instead of vloadn / convert_floatn: None = on CPU
#: devices (PoCL, where the builtins can be calls LLVM will not inline), the
#: OpenCL builtins elsewhere. Same bits either way.
INLINE_VEC: bool | None = None

#: Bytes ahead of the row being read that the attend kernels' score and
#: value passes prefetch (cl/common.h, KVREG_PREFETCH): None = by device
#: kind, 0 = no hints. Only for devices with one flat address space (PoCL's
#: CPU device: the hint takes a generic pointer). On a Xeon with one PoCL
#: thread, 1-4 KiB ahead decoded faster than no hints, alike (``kvreg bench
#: kernels``). A hint: no value depends on it.
PREFETCH_BYTES: int | None = None
PREFETCH_BYTES_CPU = 2048

#: Build options of the attention program. The attention kernels are
#: tolerance class, but no fast-math here either: exp/tanh of large scores
#: and -inf handling must stay IEEE.
ATTEND_OPTIONS: tuple[str, ...] = ()

#: On a CPU device, quantize_rows of fewer rows than this runs on the host
#: (NumPy, the same bits): a launch and a read-back on PoCL cost ~5x NumPy's
#: quantize of a decode append's rows.
HOST_QUANT_ROWS = 256

#: Where the per-row host work runs: a q8 decode append (the new row
#: rotated and checked, the window's oldest row quantized, the window
#: moved), a q8 attend's query and output rotations, and the small
#: quantizes above. "numba" = the kvreg-numba backend's compiled kernels
#: when that backend is installed (``pip install kvreg-opencl[numba]``),
#: NumPy's when not; "numpy" = NumPy's always. The same bits either way
#: (exact class). A q8 decode append on PoCL (Zen 4, one 8x128 row of K
#: and V): 11x a NumPy copy of the row in numba, 77x in NumPy
#: (docs/opencl.md). Read when the backend is created.
HOST_KERNELS = "numba"

#: Build options of the quantize program (exact class: IEEE division).
QUANT_OPTIONS: tuple[str, ...] = ("-cl-fp32-correctly-rounded-divide-sqrt",)

#: Whether ``nystrom_step`` runs on the device: None = when the device has
#: fp64 (the step cancels in float64; no float32 version exists), False =
#: always the NumPy reference. On PoCL's CPU device the kernel is correct but
#: slower than NumPy per call (launch + per-call upload of the state; see
#: docs/opencl.md), so a CPU-only deployment may want False. Read when the
#: backend is created.
NYSTROM_ON_DEVICE: bool | None = None

#: Small values (``OpenCLBackend.small_tunables``, the conformance suite and
#: the tests): a few dozen rows then take the multi-block, multi-chunk and
#: mirror-growth paths.
SMALL = {"BLOCK_ROWS": 8, "LOCAL_SIZE": 4, "HEADS_PER_WG": 2, "CHUNK_TOKENS": 3, "MIRROR_MIN_ROWS": 4}


@contextlib.contextmanager
def small():
    """Inside the block the tunables of :data:`SMALL` take its values."""
    saved = {name: globals()[name] for name in SMALL}
    globals().update(SMALL)
    try:
        yield
    finally:
        globals().update(saved)
