"""How a layer hands its rows to the attention kernels.

The kernels (:mod:`kvreg.plugin`) read a storage's view. Around them the
layer does three things, kept here:

* the rotated basis: rows of a quantized side of ``q8``, ``q8k``, ``q8v``
  and ``q4`` are stored Walsh-Hadamard rotated, so the query is rotated in
  and the output rotated out (``⟨Hq, Hk⟩ = ⟨q, k⟩``, ``H Σ p Hv = Σ p v``;
  ``H`` is its own inverse): :func:`rotated_attend`;
* the prefill chunk of a storage the chunk kernel does not read natively
  gets the key range it reads widened to float32 once per call, the chunk's
  own rows taken as the extend handed them over (:func:`chunk_rows`);
* a decode step's arguments are checked and resolved once and memoized
  (:class:`DecodeArgs`): inside a model each validation call is paid with
  the caches cold.
"""

from __future__ import annotations

import numpy as np

from . import _validate as V
from .errors import ShapeError, StateError
from .lifecycle import Lifecycle
from .modes import KvMode
from .plugin import Backend
from .storage import DenseStorage, Storage


def rotated_attend(backend, kernel, q: np.ndarray, st: Storage, *args, **kwargs) -> np.ndarray:
    """``kernel(q, st.view(), ...)`` in the basis the rows are in."""
    rotate = backend.rotate_rows
    out = kernel(rotate(q) if st.rot_k else q, st.view(), *args, **kwargs)
    return rotate(out) if st.rot_v else out


def widened_rows(st: Storage, backend, lo: int, n: int, upto: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Float32 ``[nkv, n-lo, hd]`` K and V blocks of the rows ``[lo, n)``,
    rows ``[lo, upto)`` filled (dequantized, widened, un-rotated; ``upto``
    None = ``n``), the rest left to the caller."""
    upto = n if upto is None else upto
    src = st.view()
    shape = (st.num_kv_heads, n - lo, st.head_dim)
    k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
    for h in range(st.num_kv_heads):
        for out, side, rotated in ((k, "k", src.rot_k), (v, "v", src.rot_v)):
            rows = src.attended_rows(side, h, lo, upto)
            out[h, :upto - lo] = backend.rotate_rows(rows) if rotated else rows
    return k, v


class Fresh:
    """The rows of the last extend under a float16 window, float32
    head-major, with the storage state they belong to: the chunk that
    follows reads them instead of their stored form (vLLM's prefill, too,
    attends the fresh K/V and quantizes them for the cache): under a float16
    window the newest rows are near-exact, and a prefill chunk's rows are
    all the newest."""

    __slots__ = ("version", "rows", "k", "v")

    def __init__(self, st: Storage, k: np.ndarray, v: np.ndarray):
        self.version, self.rows = st.version, int(st.lens[0])
        self.k = np.ascontiguousarray(k.transpose(1, 0, 2))
        self.v = np.ascontiguousarray(v.transpose(1, 0, 2))

    @staticmethod
    def of(st: Storage, k: np.ndarray, v: np.ndarray, heads: np.ndarray) -> Fresh | None:
        """The chunk's rows when worth keeping: windowed modes, more than one
        row, every head alive and level (a copy, dropped at the next append)."""
        if st.window and k.shape[0] > 1 and heads.size == st.num_kv_heads and (st.lens == st.lens[0]).all():
            return Fresh(st, k, v)
        return None


def chunk_rows(st: Storage, backend, fresh: Fresh | None, lo: int, n: int) -> Storage:
    """A float32 storage of the rows ``[lo, n)`` a chunk kernel reads, the
    newest as ``fresh`` holds them (when it is this storage's state) and the
    older ones widened."""
    if fresh is None or (fresh.version, fresh.rows) != (st.version, n):
        k, v = widened_rows(st, backend, lo, n, n)
        return DenseStorage.of_rows(k, v)
    a = max(lo, n - fresh.k.shape[1])
    off = a - (n - fresh.k.shape[1])   # row a in the fresh block
    if a == lo:
        k, v = np.ascontiguousarray(fresh.k[:, off:]), np.ascontiguousarray(fresh.v[:, off:])
    else:
        k, v = widened_rows(st, backend, lo, n, a)
        k[:, a - lo:] = fresh.k[:, off:]
        v[:, a - lo:] = fresh.v[:, off:]
    return DenseStorage.of_rows(k, v)


def attend_group(layer, q_group, kv_head: int, *, scale: float, first: int = 0, softcap: float = 0.0,
                 sinks=None, upto: int | None = None, imp_acc: np.ndarray | None = None) -> np.ndarray:
    """All Q heads of one KV group in one pass (``[nheads, hd]`` or flat).

    Scores rows ``[first, stored)`` only (``stored = min(head_len, upto)``);
    ``softcap > 0`` applies ``c·tanh(s/c)``; ``sinks`` (one logit per head
    of this group) join the max and the denominator; ``imp_acc`` (float32,
    writable) accumulates ``Σ_h probs``. Returns ``[nheads, hd]``
    (:meth:`LayerKvCache.attend_group <kvreg.LayerKvCache.attend_group>`:
    checked, then the kernel)."""
    st = layer.storage
    kv_head = V.index("kv_head", kv_head, layer.num_kv_heads)
    q = V.heads("q_group", q_group, layer.head_dim)
    stored = int(st.lens[kv_head])
    if upto is not None:
        # Past the stored rows `upto` means them all: clamped here, so no
        # kernel sees a count its integer type cannot hold.
        upto = min(V.nonneg_int("upto", upto), stored)
    n = stored if upto is None else upto
    first = V.nonneg_int("first", first)
    if n and first >= n:
        raise ShapeError(f"first={first} must be < the {n} visible rows of kv_head {kv_head}")
    sinks = V.sinks(sinks, q.shape[0])
    imp = V.imp_acc(imp_acc)
    return rotated_attend(layer.backend, layer.backend.attend_group, q, st, kv_head, scale=V.scale(scale),
                          first=first, upto=upto, softcap=V.softcap(softcap), sinks=sinks, imp=imp)


def attend_chunk(layer, q_all, b: int, s0: int, heads_per_kv: int, *, scale: float | None = None,
                 window: int | None = None, importance: bool = True) -> np.ndarray:
    """Causal attention of a prefill chunk already appended: ``q_all [b,
    num_heads, hd]``, the layer holding ``s0 + b`` rows; row ``i`` sees
    rows ``[s0+i+1-window, s0+i+1)``. Importance gets the masked column
    sums (``importance=False``: not computed). Tolerance class against
    the per-row path. Returns ``[b, num_heads, hd]``
    (:meth:`LayerKvCache.attend_chunk <kvreg.LayerKvCache.attend_chunk>`).

    The chunk kernel runs on the storage's own view where it reads it
    (F32; q8 without a window on a backend with ``native_q8_chunk``), else
    on the rows it reads widened (:func:`chunk_rows`; the kernel's masks are
    relative to its first row, so it sees the same rows)."""
    st, backend = layer.storage, layer.backend
    b, s0, hpk = V.positive_int("b", b), V.nonneg_int("s0", s0), V.positive_int("heads_per_kv", heads_per_kv)
    n = s0 + b
    if not (st.lens == n).all():
        raise ShapeError(f"attend_chunk needs every KV head to hold s0+b={n} rows; heads hold {st.lens.tolist()}")
    q = V.array("q_all", q_all, (b, layer.num_kv_heads * hpk, layer.head_dim))
    if window is not None:
        # A window past every row reads them all: clamped (as attend_layer).
        window = min(V.positive_int("window", window), n)
    sc = layer.default_scale if scale is None else V.scale(scale)
    imp = st.imp if V.flag("importance", importance) else None
    if st.mode is KvMode.F32 or (st.mode.quantized and not st.window and backend.native_q8_chunk):
        out = backend.attend_chunk(q, st.view(), s0=s0, b=b, hpk=hpk, scale=sc, window=window, imp=imp)
    else:
        lo = min(max(0, s0 + 1 - window), n) if window else 0
        rows = chunk_rows(st, backend, layer._fresh, lo, n)
        out = backend.attend_chunk(q, rows.view(), s0=s0 - lo, b=b, hpk=hpk, scale=sc, window=window,
                                   imp=None if imp is None else imp[lo:])
    layer.seal.record(q)
    return out


def append_attend(layer, k, v, q_all, *, scale: float | None = None, window: int | None = None,
                  softcap: float = 0.0, sinks="layer", importance: bool = True,
                  out: np.ndarray | None = None) -> np.ndarray:
    """A decode step: :meth:`~kvreg.LayerKvCache.append` then
    :meth:`~kvreg.LayerKvCache.attend_layer`, the same answer and state bit
    for bit, everything checked before the row is stored; one launch where
    the backend has a fused kernel (:func:`fused_step`). ``out``: a float32
    ``[num_heads, hd]`` buffer the answer is written to."""
    kwargs = dict(scale=scale, window=window, softcap=softcap, sinks=sinks, importance=importance)
    nkv, hd = layer.num_kv_heads, layer.head_dim
    q = V.heads("q_all", q_all, hd)
    k = V.rows("k", k, nkv, hd)
    v = V.rows("v", v, nkv, hd)
    args = layer._decode_args(q.shape[0], **kwargs)
    if out is not None:
        V.out_block("out", out, q.shape)
    got = fused_step(layer, k, v, q, args, out)
    if got is not None:
        return got
    layer._append(k, v, None)
    # asked again: the append may have grown the capacity a window is
    # clamped to, or sealed the layer
    got = layer._attend_layer(q, layer._decode_args(q.shape[0], **kwargs))
    if out is None:
        return got
    out[...] = got
    return out


def fused_step(layer, k: np.ndarray, v: np.ndarray, q: np.ndarray, args: dict, out) -> np.ndarray | None:
    """A plain layer's decode step through the backend's fused kernel
    (:meth:`~kvreg.plugin.Backend.append_attend_layer`): the answer, or None
    having stored nothing (no such kernel, or the storage's state is not
    one it takes), for the layer to append and attend in two calls."""
    if layer.lifecycle is not Lifecycle.PLAIN or layer.pos_len >= V.MAX_POSITION or \
            type(layer.backend).append_attend_layer is Backend.append_attend_layer:
        return None
    got = layer.storage.append_row_attend_by(k, v, layer.backend, q=q, scale=args["scale"], window=args["window"],
                                             softcap=args["softcap"], sinks=args["sinks"],
                                             importance=args["imp"] is not None, out=out)
    if got is not None:
        layer._row_stored()
    return got


class DecodeArgs:
    """``attend_layer``'s arguments checked and resolved for the kernel
    (``scale``, ``window``, ``softcap``, ``sinks``, ``imp``), refusing what a
    sealed layer cannot take. A decode step asks the same as the last one
    (inside a model each validation call is paid with the caches cold: ~19
    µs for these, ~2 for the lookup): answered from a memo of the last plain
    answer, keyed on everything it reads (the sinks by identity)."""

    __slots__ = ("_memo",)

    def __init__(self):
        self._memo: tuple | None = None

    def __deepcopy__(self, memo) -> DecodeArgs:
        return DecodeArgs()

    def resolve(self, layer, nh: int, scale, window, softcap, sinks, importance) -> dict:
        st, life = layer.storage, layer.lifecycle
        # plain: Python scalars and flags (an array would make the key's
        # comparison ambiguous before the validation could name it)
        plain = (importance is False or importance is True) and (sinks is None or type(sinks) is str) \
            and (scale is None or type(scale) is float) and (window is None or type(window) is int) \
            and type(softcap) is float
        if plain:
            key = (nh, scale, window, softcap, sinks, importance, st.cap, life)
            memo = self._memo
            if memo is not None and memo[1] is layer.sinks and memo[0] == key:
                # importance: the rows' current view (it grows with them)
                return dict(memo[2], imp=st.imp) if importance else memo[2]
        if nh % layer.num_kv_heads:
            raise ShapeError(f"q_all has {nh} heads, not a multiple of num_kv_heads={layer.num_kv_heads}")
        if window is not None:
            # A window past every stored row reads them all, as None does:
            # clamped so no kernel sees a count its integer type cannot hold
            # (to the capacity, which bounds every head's rows: no reduction
            # over the counts on every decode call).
            window = min(V.positive_int("window", window), max(st.cap, 1))
        sinks = V.sinks(layer.sinks if isinstance(sinks, str) and sinks == "layer" else sinks, nh)
        scale = layer.default_scale if scale is None else V.scale(scale)
        imp = st.imp if V.flag("importance", importance) else None
        softcap = V.softcap(softcap)
        if life is Lifecycle.SEALED and (window is not None or sinks is not None or softcap):
            raise StateError("attend_layer on a sealed layer reads its sinks, window and far field: "
                             "window, learned sinks and softcap do not apply (importance has no rows)")
        args = dict(scale=scale, window=window, softcap=softcap, sinks=sinks, imp=None)
        if plain:
            self._memo = (key, layer.sinks, args)
        return dict(args, imp=imp) if imp is not None else args
