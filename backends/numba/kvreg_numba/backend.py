"""``NumbaBackend``: kvreg's kernels compiled for the CPU with Numba.

Native kernels: ``attend_group``, ``attend_layer`` (one parallel kernel for
every KV group: the decode fast path; f16/bf16 blocks read as stored, 2
bytes an element, widened in registers; q8's float16 window rows read the
same way, from ``thk``/``thv`` as stored), ``attend_batch`` (the same layer
of B sequences in one parallel launch: every sequence's block tasks in one
task list, each the layer call's arithmetic on its own arrays, passed as
addresses; q4 loops over the reference), ``attend_chunk`` (BLAS GEMMs with a
fused Numba masked softmax), ``quantize_rows`` and ``gather_rows`` (exact
class), ``bounded_attend`` (one parallel kernel, :mod:`kvreg_numba.ring`) and
the Nyström ``nystrom_prefill``/``nystrom_absorb``/``nystrom_step`` (serial
float64 kernels that release the GIL, :mod:`kvreg_numba.nystrom`, so an O(1)
seal runs its KV groups on threads: ``parallel_seal``).

Importing this module does not import numba (the registry imports it to
register the class); the kernels load when the backend is instantiated.
"""

from __future__ import annotations

import weakref

import numpy as np

from kvreg.errors import BackendError
from kvreg.modes import KV_K_GROUP, Q8_ABS_MAX, KvMode
from kvreg.plugin import check_batch
from kvreg.reference import ReferenceBackend
from kvreg.registry import cpu_device

from .args import KV_COUNT_AT, frozen_counts, kv_args, kv_elem_bytes  # NumPy only: no numba at import


def _load_kernels() -> None:
    try:
        from . import batch, chunk, dispatch, nystrom, ring, window  # noqa: F401  (compiled on first use)
        from .sweeps import K_GROUP
    except ImportError as exc:  # numba missing or broken: say how to fix it
        raise BackendError(
            f"the numba backend cannot start: {exc}. Install it with `pip install kvreg-numba` "
            "(which pulls numba), or pick another backend with KVREG_BACKEND=reference."
        ) from exc
    if K_GROUP != KV_K_GROUP:
        raise BackendError(f"kvreg-numba was built for {K_GROUP}-channel K groups, kvreg uses {KV_K_GROUP}")


#: The arrays of a view the decode kernels take, by the name ``kv_args`` gives them.
_STORAGE_ARGS = ("k", "kq", "ks", "kcol", "kcol_set", "v", "vq", "vs", "vcol", "vcol_set", "xk", "xv", "xlen",
                 "thk", "thv", "b8")


def _storage_args(kv) -> dict:
    """The storage arrays of a layer (a view or a decode slot), as the
    kernels take them (None = absent): a side's float rows, or its int8
    rows with their field; the exact rows; q8's float16 windows (passed as
    stored, viewed as int16)."""
    return {name: kv.array(name) for name in _STORAGE_ARGS}


#: Stand-ins for the arrays a side of :meth:`NumbaBackend.store_window_row`
#: does not have (one type per argument, so one compile).
_NO_WINDOW = np.zeros((0, 0, 0), np.int16)
_NO_Q = np.zeros((0, 0, 0), np.int8)
_NO_S = np.zeros((0, 0, 0), np.float32)
_NO_VS = np.zeros((0, 0), np.float32)
_NO_F = _NO_S
#: Q8_ABS_MAX as the float32 the comparison with a float32 row uses.
_Q8_BOUND = np.float32(Q8_ABS_MAX)


def _layer_args(kv, owner=None, slot="memo") -> tuple[tuple, int]:
    """The decode kernel's storage arguments for ``kv`` (a :class:`kvreg.KvView`
    or a decode slot): ``(kv_args tuple, bytes of K and V per channel)``. The
    arrays' part is kept on the view's ``owner`` (the identity of the row
    arrays: ``memo``, which the storage clears whenever it replaces an
    array), checked against the K block itself, so a decode
    step makes no numpy call for it; the per-head counts come from ``kv``
    (they change with every version). A fused decode step passes its
    :class:`~kvreg.views.DecodeSlot`, whose arrays it writes, with its rows'
    identity as ``owner`` and ``slot="row_memo"``."""
    anchor = kv.q8.kq if kv.dense.k is None else kv.dense.k
    if owner is None:
        owner = getattr(kv, "owner", None)
    memo = getattr(owner, slot, None)
    if memo is None or memo[0] is not anchor:
        arrays = _storage_args(kv)
        for name in KV_COUNT_AT:   # counts: spliced in per call
            if arrays[name] is not None:
                arrays[name] = kv.lens[:0]
        args = kv_args(**arrays)
        memo = (anchor, args, kv_elem_bytes(args), tuple(n for n in KV_COUNT_AT if arrays[n] is not None))
        if hasattr(owner, slot):
            setattr(owner, slot, memo)
    args, counts = memo[1], memo[3]
    if counts:
        args = list(args)
        for name in counts:
            args[KV_COUNT_AT[name]] = _count(name, kv.lens if name == "lens" else kv.array(name))
        args = tuple(args)
    return args, memo[2]


def _numpy_rotates(rot_k, rot_v, hd) -> bool:
    """Whether a rotated side's rows of ``hd`` channels rotate in NumPy
    (``rotate_rows``: numba's transform takes a power of two), so no
    window kernel can take the step."""
    return bool(rot_k or rot_v) and (hd & (hd - 1)) != 0


def _count(name, a):
    """A per-head count as ``kv_args`` passes it (a view's frozen arrays already are)."""
    dtype = np.bool_ if name.endswith("_set") else np.int64
    return a if a.dtype == dtype and a.flags.c_contiguous else np.ascontiguousarray(a, dtype=dtype)


#: The view fields a batch row holds, per K/V quantization (the arrays
#: :func:`kvreg_numba.batch.batch_arrays` takes, in its order).
def _row_fields(quant_k: bool, quant_v: bool) -> tuple[str, ...]:
    return (("kq", "ks", "kcol") if quant_k else ("k",)) + (("vq", "vs", "vcol") if quant_v else ("v",)) + \
        ("xk", "xv", "thk", "thv")


class _BatchRows:
    """Rows of the batch table (:func:`kvreg_numba.batch.batch_row`: each
    array's address and dims), cached per sequence. A row depends on which
    arrays the view holds, and a storage hands out the same array objects
    until it reallocates them, so a row is found by its first array's
    identity and checked against weak references to every array it was
    built from: a reallocated (or freed and reused) array misses and the
    row is rebuilt. Nothing here keeps an array alive; an entry goes when
    its first array does."""

    def __init__(self, batch):
        self._batch = batch
        self._rows: dict[int, tuple] = {}

    def table(self, kvs, fields):
        batch = self._batch
        out = []
        keep = []  # arrays normalized by a copy stay alive for the call
        rows = self._rows
        for kv in kvs:
            if kv.cap == 0:
                out.append(batch.EMPTY_ROW)
                continue
            arrs = tuple(kv.array(f) for f in fields)
            hit = rows.get(id(arrs[0]))
            if hit is not None:
                for r, a in zip(hit[0], arrs):
                    if r() is not a:
                        break
                else:
                    out.append(hit[1])
                    continue
            out.append(self._build(arrs, fields, keep))
        return np.array(out), keep

    def _build(self, arrs, fields, keep):
        """A row built from the arrays themselves (cached: it points into
        them) or, where normalizing one took a copy, from the copies (kept
        for the call, not cached)."""
        batch = self._batch
        present = {f: a for f, a in zip(fields, arrs) if a is not None}
        norm = batch.batch_arrays(**present)
        row = batch.batch_row(*norm)
        copied = any(batch.batch_row_address(row, f) != a.ctypes.data for f, a in present.items()
                     if a.size and f in batch.BT_SLOTS_OF)
        if copied:
            keep.append(norm)
            return row
        try:
            refs = tuple(_NONE_REF if a is None else weakref.ref(a) for a in arrs)
        except TypeError:  # not weakly referable: no caching
            keep.append(norm)
            return row
        key = id(arrs[0])
        self._rows[key] = (refs, row)  # no strong reference: the entry goes with the array
        weakref.finalize(arrs[0], self._rows.pop, key, None)
        return row


def _none():
    return None


#: Stands for an absent array in a cached row (``r() is None``).
_NONE_REF = _none


def _counts(kvs, name, dtype):
    """A per-head count of every view, ``[B * nkv]`` (zeros for a view without it)."""
    got = [kv.lens if name == "lens" else kv.array(name) for kv in kvs]
    try:
        return np.concatenate(got).astype(dtype, copy=False)
    except (TypeError, ValueError):
        nkv = kvs[0].num_kv_heads
        return np.concatenate([np.zeros(nkv, dtype) if a is None else np.asarray(a, dtype) for a in got])


class NumbaBackend(ReferenceBackend):
    """Numba CPU kernels; everything else from the NumPy reference."""

    name = "numba"
    priority = 10
    auto = True
    #: The Nyström kernels are serial and nogil: a seal's groups run on threads.
    parallel_seal = True
    #: q4's three-tier rows run the reference's arithmetic.
    native_modes = frozenset(m for m in KvMode if not m.tiered)

    provides = frozenset({"bounded_ring", "nystrom", "fused_decode"})

    def __init__(self, device: str | None = None):
        if device is not None and not cpu_device(device):
            raise BackendError(f"the numba backend runs on the CPU only ('cpu' or 'cpu:0'), not on {device!r}")
        super().__init__("cpu")
        from kvreg.threads import get_num_threads

        get_num_threads()  # a bad KVREG_THREADS is a ConfigError now, not at the first attend
        _load_kernels()
        # numba imported by _load_kernels: its failure is a BackendError there
        from . import batch, chunk, dispatch, quant
        from .window import append_window_attend, window_row_step

        self._decode, self._batch, self._chunk, self._quant = dispatch, batch, chunk, quant
        self._window_row_step = window_row_step
        self._append_window_attend = append_window_attend
        self._windows = {}   # id -> (float16 window, its int16 view): _bits
        self._rows = None  # batch rows, built at the first attend_batch

    def small_tunables(self):
        from . import config

        return config.small()

    def describe(self) -> str:
        import numba

        from kvreg.threads import get_num_threads

        n = min(get_num_threads(), numba.config.NUMBA_NUM_THREADS)
        return f"numba {numba.__version__} on cpu ({n} threads: kvreg.get_num_threads())"

    def attend_group(self, q, kv, g, *, scale, first=0, upto=None, softcap=0.0, sinks=None, imp=None):
        if kv.mode.tiered:  # q4 rows have three forms: the reference kernel reads them
            return super().attend_group(q, kv, g, scale=scale, first=first, upto=upto, softcap=softcap,
                                        sinks=sinks, imp=imp)
        if kv.cap == 0 or int(kv.lens[g]) == 0:
            return np.zeros_like(q)
        return self._decode.attend_group(
            q, g, kv.lens, first=first, upto=upto, scale=scale, softcap=softcap or 0.0,
            sinks=sinks, imp=imp, **_storage_args(kv),
        )

    def attend_layer(self, q, kv, *, scale, window=None, softcap=0.0, sinks=None, imp=None):
        if kv.mode.tiered:
            return super().attend_layer(q, kv, scale=scale, window=window, softcap=softcap, sinks=sinks, imp=imp)
        if kv.cap == 0:
            return np.zeros_like(q)
        args, elem = _layer_args(kv)
        return self._decode.attend_kv(q, frozen_counts(kv.lens), args, elem, window=int(window or 0), scale=scale,
                                      softcap=softcap or 0.0, sinks=sinks, imp=imp)

    def append_attend_layer(self, k, v, q, slot, *, imp, seq, owner, scale, window=None, softcap=0.0, sinks=None,
                            importance=False, out=None):
        """The row stored and the layer attended in one launch: a step
        :meth:`prepare_append_attend` makes, called once."""
        step = self.prepare_append_attend(slot, owner=owner, shape=q.shape, scale=scale, window=window,
                                          softcap=softcap, sinks=sinks, importance=importance, out=out)
        return None if step is None else step(k, v, q, imp, seq)

    def prepare_append_attend(self, slot, *, owner, shape, scale, window=None, softcap=0.0, sinks=None,
                              importance=False, out=None):
        """:func:`kvreg_numba.dispatch.decode_stepper`: the launch's arguments
        gathered once, the rows counted by the step. F32, f16 and bf16 rows
        always (:func:`kvreg_numba.store.store_row`, which rounds a 2-byte
        row as the core does); a q8 window's step
        (:func:`kvreg_numba.window.append_window_attend`: the store, the
        rotations and the attention) where the decode runs on one thread."""
        args, elem = _layer_args(slot, owner, "row_memo")
        window_step = None
        if slot.window is not None:
            if _numpy_rotates(slot.rot_k, slot.rot_v, shape[1]):
                return None
            # window_row_step's arrays are the kernel's: the windows' int16 bits,
            # empty blocks for what a side lacks (thk, thv, kq, ks, vq, vs, kf, vf)
            window_step = (self._append_window_attend,
                           (slot.rot_k, slot.rot_v, args[15], args[16], args[1], args[2], args[6], args[7], args[0],
                            args[5], slot.lens, slot.window.b8),
                           (0 if slot.exact is None else slot.exact.cap, KV_K_GROUP, _Q8_BOUND, bool(importance)))
        return self._decode.decode_stepper(slot.lens, args, elem, tuple(shape), cap=slot.cap, window_step=window_step,
                                           importance=importance, window=int(window or 0), scale=scale,
                                           softcap=softcap or 0.0, sinks=sinks, out=out)

    def attend_batch(self, q, kvs, *, scale, window=None, softcap=0.0, sinks=None, imps=None):
        """One parallel launch for the batch (:func:`kvreg_numba.batch.attend_batch`):
        every sequence's decode tasks in one task list, each running
        :meth:`attend_layer`'s arithmetic on its own arrays (the same block
        kernel, merge and importance pass), so row ``b`` is the layer call's
        bits. q4 layers take the inherited per-sequence loop (their
        attend_layer is the reference's)."""
        q, kvs = check_batch(q, kvs, imps)
        if not kvs:
            return np.zeros(q.shape, np.float32)
        kv0 = kvs[0]
        mode = kv0.mode
        if mode.tiered:
            return super().attend_batch(q, kvs, scale=scale, window=window, softcap=softcap, sinks=sinks,
                                        imps=imps)
        qk, qv = mode.quant_k, mode.quant_v
        if self._rows is None:
            self._rows = _BatchRows(self._batch)
        tab, keep = self._rows.table(kvs, _row_fields(qk, qv))
        win = kv0.window is not None
        exact = kv0.exact is not None
        out = self._batch.attend_batch(
            q, tab, lens=_counts(kvs, "lens", np.int64), kquant=qk, vquant=qv,
            kv_dtype=mode.float_dtype, xlen=_counts(kvs, "xlen", np.int64) if exact else None,
            b8=_counts(kvs, "b8", np.int64) if win else None,
            kcol_set=_counts(kvs, "kcol_set", np.bool_) if qk else None,
            vcol_set=_counts(kvs, "vcol_set", np.bool_) if qv else None,
            imps=imps, window=int(window or 0), scale=scale, softcap=softcap or 0.0, sinks=sinks)
        del keep
        return out

    def attend_chunk(self, q, kv, *, s0, b, hpk, scale, window=None, imp=None):
        k, v = kv.dense
        if k is None or v is None or k.dtype != np.float32 or v.dtype != np.float32:
            # The core hands q8 and f16/bf16 layers over as a dequantized F32
            # view; anything else takes the reference (which widens per slice).
            return super().attend_chunk(q, kv, s0=s0, b=b, hpk=hpk, scale=scale, window=window, imp=imp)
        return self._chunk.attend_chunk(q, k, v, s0=s0, b=b, hpk=hpk, scale=scale, window=window, imp=imp)

    def quantize_rows(self, x, col, *, group):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if col is None:
            c = np.empty((0, x.shape[1]), np.float32)
        else:
            c = np.ascontiguousarray(col, dtype=np.float32)
            if c.ndim == 1:
                c = c.reshape(1, -1)
        return self._quant.quantize_rows(x, c, int(group))

    def store_window_row(self, k, v, *, rot_k, rot_v, thk, thv, kq, ks, vq, vs, kf, vf, lens, b8, imp, seq, exact_cap):
        if _numpy_rotates(rot_k, rot_v, k.shape[1]):
            return False
        if thk is None:
            thk, kq, ks = _NO_WINDOW, _NO_Q, _NO_S
        else:
            thk, kf = self._bits(thk), _NO_F
        if thv is None:
            thv, vq, vs = _NO_WINDOW, _NO_Q, _NO_VS
        else:
            thv, vf = self._bits(thv), _NO_F
        return self._window_row_step(k, v, rot_k, rot_v, thk, thv, kq, ks, vq, vs, kf, vf, lens, b8, imp, seq,
                                     exact_cap, KV_K_GROUP, _Q8_BOUND)

    def _bits(self, window):
        """The int16 view of a float16 window, kept per array (a numpy call
        fewer per side and decode step; windows are a few rows, so the few
        kept after their storage moved on cost nothing)."""
        got = self._windows.get(id(window))
        if got is None or got[0] is not window:
            if len(self._windows) >= 1024:
                self._windows.clear()
            got = self._windows[id(window)] = (window, window.view(np.int16))
        return got[1]

    def freeze_field(self, q, s, *, group):
        return self._quant.freeze_field(np.ascontiguousarray(q), np.ascontiguousarray(s, dtype=np.float32), int(group))

    def rotate_rows(self, x):
        x = np.asarray(x)
        hd = x.shape[-1]
        if x.dtype != np.float32 or hd < 2 or hd & (hd - 1):
            return super().rotate_rows(x)   # not float32 rows of a power of two: NumPy's (and its errors)
        flat = np.ascontiguousarray(x).reshape(-1, hd)
        return self._quant.fwht_rows(flat, np.float32(1.0 / np.sqrt(hd))).reshape(x.shape)

    def gather_rows(self, rows, idx):
        idx = np.ascontiguousarray(idx, dtype=np.int64)
        if rows.ndim == 2 and rows.flags.c_contiguous:
            if rows.dtype == np.float16:  # numba has no float16 on the CPU: move the bits
                return self._quant.gather_rows(rows.view(np.uint16), idx).view(np.float16)
            return self._quant.gather_rows(rows, idx)
        return rows[idx]  # 1-D scales: a plain copy is all there is to it

    def bounded_attend(self, q, ring, *, scale, num_heads):
        from kvreg.bounded import check_bounded_attend_args

        q32, scale = check_bounded_attend_args(q, ring, scale, num_heads)
        from . import ring as _ring

        return _ring.bounded_attend(q32, ring.k, ring.v, ring.seen, ring.sink_k, ring.sink_v, ring.group_windows,
                                    ring.rope, scale)

    def nystrom_prefill(self, probes, k_far, v_far, *, scale):
        from . import nystrom

        return nystrom.nystrom_prefill(probes, k_far, v_far, scale)

    def nystrom_absorb(self, far, k_row, v_row, *, scale):
        from . import nystrom

        return nystrom.nystrom_absorb(far, k_row, v_row, scale)

    def nystrom_step(self, q_group, k_exact, v_exact, far, *, scale):
        from . import nystrom

        return nystrom.nystrom_step(q_group, k_exact, v_exact, far, scale)
