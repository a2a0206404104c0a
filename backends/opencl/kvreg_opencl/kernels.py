"""Host drivers of the OpenCL kernels: argument preparation and launches.

These are plain functions over a synced :class:`~kvreg_opencl.mirror.DeviceMirror`
so they can be tested before (and independently of) the core's backend ABC;
:mod:`kvreg_opencl.backend` adapts them to ``kvreg.backend``.
"""

from __future__ import annotations

import threading

import numpy as np

from kvreg.errors import BackendError, ShapeError

from . import config, programs
from .device import DeviceState
from .mirror import DeviceMirror

_VARIANT = {(False, False): "partial_kf_vf", (True, False): "partial_kq_vf",
            (False, True): "partial_kf_vq", (True, True): "partial_kq_vq"}
#: The partial kernel of 2-byte K and V rows, by their storage dtype
#: (attend.cl: f16 read with vload_half, bf16 bits as ushort).
_HALF_VARIANT = {np.dtype(np.float16): "partial_kh_vh", np.dtype(np.uint16): "partial_kb_vb"}


def partial_variant(quant: tuple[bool, bool], kv_dtype) -> str:
    """The ``partial_*`` kernel of a mirror's layout: ``quant`` = (K is q8,
    V is q8); ``kv_dtype`` the unquantized blocks' dtype (None: none)."""
    if kv_dtype is None or np.dtype(kv_dtype) == np.float32:
        return _VARIANT[quant]
    name = _HALF_VARIANT.get(np.dtype(kv_dtype))
    if name is None or any(quant):
        raise ShapeError(f"kvreg-opencl: no attend kernel for {np.dtype(kv_dtype)} K/V rows with q8 sides {quant}")
    return name


class _Scratch:
    """Per-device scratch buffers, grown on demand and reused across calls."""

    def __init__(self, dev: DeviceState):
        self.dev = dev
        self.bufs: dict[str, tuple[int, object]] = {}
        cl = dev.cl
        self.dummy = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, 64)

    def get(self, name: str, nbytes: int):
        have = self.bufs.get(name)
        if have is not None and have[0] >= nbytes:
            return have[1]
        size = max(64, 1 << max(0, nbytes - 1).bit_length())
        buf = self.dev.cl.Buffer(self.dev.context, self.dev.cl.mem_flags.READ_WRITE, size)
        self.bufs[name] = (size, buf)
        return buf

    def put(self, name: str, arr: np.ndarray):
        """A device buffer holding ``arr`` (a call's small input: query,
        bounds, sinks): a fresh buffer made with COPY_HOST_PTR, because on
        PoCL that is a host memcpy (~1 µs) where an enqueued write is a
        command for its worker thread (~70 µs a command on this machine, a
        decode call had three)."""
        if not arr.nbytes:
            return self.get(name, 0)
        cl = self.dev.cl
        return cl.Buffer(self.dev.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                         hostbuf=np.ascontiguousarray(arr))


_scratch: dict[int, _Scratch] = {}
_launch_lock = threading.RLock()


def scratch(dev: DeviceState) -> _Scratch:
    """The scratch buffers of ``dev``'s context. Keyed on the context (held by
    the scratch's DeviceState, so its handle is not reused while cached): a
    DeviceState opened before a ``reset_device`` keeps working beside the new
    one instead of receiving buffers of another context."""
    with _launch_lock:   # one scratch set per context, whichever thread asks first
        s = _scratch.get(dev.context.int_ptr)
        if s is None or s.dev.context is not dev.context:
            s = _scratch[dev.context.int_ptr] = _Scratch(dev)
        return s


def _wanted_local_size(dev: DeviceState) -> int:
    want = config.LOCAL_SIZE
    if want is None:
        want = config.LOCAL_SIZE_GPU if dev.info.kind == "GPU" else config.LOCAL_SIZE_CPU
    return max(1, int(want))


def _local_size(kernel, dev: DeviceState) -> int:
    wg = kernel.get_work_group_info(dev.cl.kernel_work_group_info.WORK_GROUP_SIZE, dev.device)
    return min(_wanted_local_size(dev), int(wg))


def one_item(dev: DeviceState) -> bool:
    """Whether the attend kernels run one work-item a work-group (a CPU's
    default): then ``merge`` and ``probs`` run one work-item a head too (each
    block's weight one ``exp``, not one a channel; eight scores an ``exp``
    call) and ``importance`` eight rows a work-item."""
    return _wanted_local_size(dev) == 1


def score_stride(dev: DeviceState, smax: int) -> int:
    """Columns a (token, head) row of the score buffer spans: the visible
    rows, padded to a multiple of 8 where ``probs`` takes eight a call."""
    n = max(1, int(smax))
    return -(-n // 8) * 8 if one_item(dev) else n



def launch_partial(dev: DeviceState, prg, quant: tuple[bool, bool], q_buf, bufs: dict, kcol, vcol,
                   nl_buf, fi_buf, *, g0: int, ng: int, cap: int, hd: int, hpk: int, hc: int,
                   br: int, nblk: int, T: int, scale: float, softcap: float, pm, ps, pacc,
                   scores, sstride: int, want_scores: bool, exact=None, kv_dtype=None,
                   window=None, tg: int = 0, tslot=None) -> None:
    """One launch of ``partial_*`` (attend.cl) over row buffers ``bufs``
    (``k``/``kq``/``ks``/``v``/``vq``/``vs`` laid out ``[nkv, cap, ...]``):
    writes the block states ``pm``/``ps``/``pacc`` of every token and head.
    ``kv_dtype``: the element type of ``k``/``v`` (float32 when None; float16
    or uint16 = bfloat16 bits pick the 2-byte kernels).
    ``exact``: ``(xk, xv, xlen, xcap)`` device buffers of the q8 exact rows
    (``xk``/``xv`` may be None for an unquantized side), or None.
    ``window``: ``(thk, thv, b8, wcap)`` device buffers of the q8 float16
    windows (binary16 ``[nkv, wcap, hd]``; None for an unquantized side) and
    their bounds (int32 ``[nkv]``), or None. ``tg``: storage heads per
    batch slot: 0 when every token reads the heads ``[g0, g0+ng)`` (a
    decode, a prefill chunk), ``nkv`` when token ``t`` is a sequence of a
    batch whose layers sit one after another in the buffers, in slot
    ``tslot[t]`` (an int32 ``[T]`` buffer; :mod:`kvreg_opencl.batch`)."""
    cl = dev.cl
    d = scratch(dev).dummy
    kern = programs.kernel(prg, partial_variant(quant, kv_dtype))
    L = _local_size(kern, dev)
    lanes = max(1, L // (hd // 8 if hd % 8 == 0 else hd))  # value-pass row lanes (attend.cl)
    local = 4 * hc * (hd + br + 1 + (lanes * hd if lanes > 1 else 0))
    if local > dev.info.local_mem_bytes:
        raise BackendError(
            f"kvreg-opencl: the attend work-group needs {local} bytes of local memory, "
            f"{dev.info.name!r} has {dev.info.local_mem_bytes}; lower config.BLOCK_ROWS, "
            "HEADS_PER_WG or LOCAL_SIZE")
    nchunk = -(-hpk // hc)
    xk, xv, xlen, xcap = exact if exact is not None and exact[3] > 0 else (None, None, None, 0)
    thk, thv, b8, wcap = window if window is not None and window[3] > 0 else (None, None, None, 0)
    kern(
        dev.queue, (nblk * L, ng * nchunk, T), (L, 1, 1),
        q_buf, bufs.get("k", d), bufs.get("kq", d), bufs.get("ks", d), kcol,
        bufs.get("v", d), bufs.get("vq", d), bufs.get("vs", d),
        xk if xk is not None else d, xv if xv is not None else d, xlen if xlen is not None else d,
        np.int32(xcap),
        thk if thk is not None else d, thv if thv is not None else d, b8 if b8 is not None else d,
        np.int32(wcap), nl_buf, fi_buf,
        np.int32(g0), np.int32(ng), np.int32(cap), np.int32(hd),
        np.int32(hpk), np.int32(hc), np.int32(br), np.int32(nblk), np.int32(tg),
        tslot if tslot is not None else d,
        np.float32(scale), np.float32(softcap),
        pm, ps, pacc, scores, np.int32(sstride), np.int32(want_scores),
        cl.LocalMemory(4 * hc * hd), cl.LocalMemory(4 * hc * br), cl.LocalMemory(4 * hc),
        cl.LocalMemory(4 * lanes * hc * hd if lanes > 1 else 4),
    )


def attend_rows(*args, **kwargs):
    """See :func:`_attend_rows`. Serialized per process: the cached kernel
    objects and scratch buffers hold per-launch state."""
    with _launch_lock:
        return _attend_rows(*args, **kwargs)


def partial_states(sc, T: int, nq: int, hd: int, hpk: int, smax: int):
    """The block geometry of one attention launch over at most ``smax``
    visible rows (rows per block, heads per work-group, blocks) and the
    scratch buffers of its per-block partial states (``pm``, ``ps``, ``pacc``
    for ``T`` tokens of ``nq`` heads): shared by the layer and batch calls."""
    br = int(config.BLOCK_ROWS)
    hc = programs.heads_per_wg(hpk)
    nblk = max(1, -(-smax // br))
    pm = sc.get("pm", T * nq * nblk * 4)
    ps = sc.get("ps", T * nq * nblk * 4)
    pacc = sc.get("pacc", T * nq * nblk * hd * 4)
    return br, hc, nblk, pm, ps, pacc


def _attend_rows(
    mirror: DeviceMirror,
    q: np.ndarray,
    *,
    g0: int,
    hpk: int,
    nlim: np.ndarray,
    firsts: np.ndarray,
    scale: float,
    softcap: float = 0.0,
    sinks: np.ndarray | None = None,
    imp: np.ndarray | None = None,
    want_probs: bool = False,
):
    """Attend ``T`` query tokens to KV groups ``[g0, g0 + ng)`` of a synced mirror.

    ``q``: ``[T, ng*hpk, hd]`` float32; ``nlim``/``firsts``: ``[T, ng]`` the
    visible rows ``[firsts, nlim)`` of each group for each token (``firsts``
    already clamped to ``nlim - 1``; ``nlim == 0`` gives zeros). ``sinks``:
    ``[ng*hpk]``. ``imp`` (float32, updated in place): ``imp[p] +=`` the
    probabilities of every token and head, in that order. Returns ``out``
    ``[T, ng*hpk, hd]`` and, with ``want_probs``, ``probs`` ``[T, ng*hpk,
    span_max]`` (row ``p`` of a group at column ``p - firsts``).
    """
    dev = mirror.dev
    cl = dev.cl
    T, nq, hd = q.shape
    ng = nq // hpk
    nlim = np.ascontiguousarray(nlim, dtype=np.int32).reshape(T, ng)
    firsts = np.ascontiguousarray(firsts, dtype=np.int32).reshape(T, ng)
    spans = np.where(nlim > 0, nlim - firsts, 0)
    smax = int(spans.max(initial=0))
    prg = programs.attend_program(dev, hpk)
    sc = scratch(dev)
    queue = dev.queue
    br, hc, nblk, pm, ps, pacc = partial_states(sc, T, nq, hd, hpk, smax)

    q_buf = sc.put("q", np.ascontiguousarray(q, dtype=np.float32))
    nl_buf = sc.put("nlim", nlim)
    fi_buf = sc.put("firsts", firsts)
    want_scores = bool(want_probs or imp is not None) and smax > 0
    sstride = score_stride(dev, smax)
    sc_buf = sc.get("scores", T * nq * sstride * 4) if want_scores else sc.dummy
    d = sc.dummy
    kcol = mirror.kcol if mirror.kcol is not None else d
    vcol = mirror.vcol if mirror.vcol is not None else d

    if smax > 0:
        launch_partial(dev, prg, (mirror.k_quant, mirror.v_quant), q_buf, mirror.buffers, kcol, vcol,
                       nl_buf, fi_buf, g0=g0, ng=ng, cap=mirror.cap, hd=hd, hpk=hpk, hc=hc,
                       br=br, nblk=nblk, T=T, scale=scale, softcap=softcap, pm=pm, ps=ps,
                       pacc=pacc, scores=sc_buf, sstride=sstride, want_scores=want_scores,
                       exact=mirror.exact_args(), kv_dtype=mirror.kv_dtype,
                       window=mirror.window_args())
    has_sinks = sinks is not None
    sk_buf = sc.put("sinks", np.ascontiguousarray(sinks, dtype=np.float32).reshape(nq)) if has_sinks else d
    out_buf = sc.get("out", T * nq * hd * 4)
    mz = sc.get("mz", T * nq * 2 * 4)
    programs.kernel(prg, "merge")(
        queue, (1 if one_item(dev) else hd, nq, T), None,
        pm, ps, pacc, nl_buf, fi_buf, sk_buf, np.int32(has_sinks), np.int32(0),
        vcol, np.int32(mirror.v_quant), np.int32(g0), np.int32(ng), np.int32(hd),
        np.int32(hpk), np.int32(br), np.int32(nblk), np.int32(0), d, out_buf, mz,
    )
    probs = None
    if want_scores:
        one = one_item(dev)
        if want_probs:   # else the importance kernel makes each probability as it adds it
            programs.kernel(prg, "probs")(queue, (1 if one else sstride, nq, T), None, sc_buf, mz, nl_buf,
                                          fi_buf, np.int32(ng), np.int32(hpk), np.int32(sstride))
        if imp is not None:
            hi = min(len(imp), int(nlim.max(initial=0)))
            if hi > 0:
                host = np.ascontiguousarray(imp[:hi], dtype=np.float32)
                ib = sc.put("imp", host)
                width = 8 if one else 1
                programs.kernel(prg, "importance")(queue, (-(-hi // width),), None, ib, np.int32(hi), sc_buf,
                                                   nl_buf, fi_buf, np.int32(T), np.int32(ng), np.int32(hpk),
                                                   np.int32(sstride), np.int32(width), mz,
                                                   np.int32(not want_probs))
                cl.enqueue_copy(queue, host, ib)
                imp[:hi] = host
        if want_probs:
            probs = np.empty((T, nq, sstride), dtype=np.float32)
            cl.enqueue_copy(queue, probs, sc_buf)
            probs = probs[:, :, :smax]
    elif want_probs:
        probs = np.zeros((T, nq, 0), dtype=np.float32)
    out = np.empty((T, nq, hd), dtype=np.float32)
    cl.enqueue_copy(queue, out, out_buf)
    return out, probs


def visible(lens: np.ndarray, first, upto: int | None):
    """(nlim, firsts) of one decode query: ``n = min(lens, upto)``,
    ``first = min(first, n - 1)`` (0 for an empty head)."""
    n = np.asarray(lens, dtype=np.int64)
    if upto is not None:
        n = np.minimum(n, int(upto))
    f = np.broadcast_to(np.asarray(first, dtype=np.int64), n.shape)
    f = np.where(n > 0, np.minimum(f, n - 1), 0)
    return n, f


def attend_layer(mirror: DeviceMirror, q: np.ndarray, *, lens, scale: float, first=0,
                 softcap: float = 0.0, upto: int | None = None, sinks=None, imp=None,
                 want_probs: bool = False, g0: int = 0, ng: int | None = None):
    """Decode attend of ``q [ng*hpk, hd]`` against groups ``[g0, g0+ng)``."""
    q = np.asarray(q, dtype=np.float32)
    if q.ndim != 2 or q.shape[1] != mirror.hd:
        raise ShapeError(f"q must be [heads, {mirror.hd}], got {q.shape}")
    ng = mirror.nkv - g0 if ng is None else ng
    if ng <= 0 or q.shape[0] % ng:
        raise ShapeError(f"{q.shape[0]} query heads do not split over {ng} KV groups")
    hpk = q.shape[0] // ng
    n, f = visible(np.asarray(lens)[g0:g0 + ng], first, upto)
    out, probs = attend_rows(mirror, q[None], g0=g0, hpk=hpk, nlim=n[None], firsts=f[None],
                             scale=scale, softcap=softcap, sinks=sinks, imp=imp,
                             want_probs=want_probs)
    return out[0], (None if probs is None else probs[0])


def attend_chunk(mirror: DeviceMirror, q: np.ndarray, *, lens, s0: int, hpk: int, scale: float,
                 window: int | None = None, imp=None, softcap: float = 0.0, sinks=None):
    """Causal prefill: ``q [b, nh, hd]`` for rows ``[s0, s0+b)`` (already
    stored); token ``i`` sees rows ``[max(0, s0+i+1-window), s0+i+1)``."""
    q = np.asarray(q, dtype=np.float32)
    if q.ndim != 3 or q.shape[2] != mirror.hd or q.shape[1] % hpk:
        raise ShapeError(f"q must be [b, nkv*hpk, {mirror.hd}], got {q.shape}")
    bsz, nh, hd = q.shape
    ng = nh // hpk
    lens = np.asarray(lens, dtype=np.int64)[:ng]
    out = np.empty((bsz, nh, hd), dtype=np.float32)
    step = max(1, int(config.CHUNK_TOKENS))
    for t0 in range(0, bsz, step):
        t1 = min(bsz, t0 + step)
        upto = s0 + np.arange(t0, t1, dtype=np.int64) + 1
        n = np.minimum(lens[None, :], upto[:, None])
        lo = np.zeros_like(upto) if window is None else np.maximum(0, upto - int(window))
        f = np.where(n > 0, np.minimum(lo[:, None], n - 1), 0)
        o, _ = attend_rows(mirror, q[t0:t1], g0=0, hpk=hpk, nlim=n, firsts=f, scale=scale,
                           softcap=softcap, sinks=sinks, imp=imp)
        out[t0:t1] = o
    return out


def quantize_rows(dev: DeviceState, x: np.ndarray, col: np.ndarray | None, group: int):
    """Exact-class q8 quantize of ``x [n, hd]`` (docs/kernels.md)."""
    with _launch_lock:
        return _quantize_rows(dev, x, col, group)


def _quantize_rows(dev: DeviceState, x: np.ndarray, col: np.ndarray | None, group: int):
    cl = dev.cl
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ShapeError(f"x must be [n, hd], got {x.shape}")
    n, hd = x.shape
    if group <= 0:
        raise ShapeError(f"group must be positive, got {group}")
    ngr = -(-hd // group)
    qh = np.empty((n, hd), dtype=np.int8)
    sh = np.empty((n, ngr), dtype=np.float32)
    if n == 0 or hd == 0:
        return qh, sh
    prg = programs.quant_program(dev)
    sc = scratch(dev)
    use_col = col is not None
    if use_col:
        col = np.ascontiguousarray(col, dtype=np.float32)
        if col.shape not in ((hd,), (n, hd)):
            raise ShapeError(f"col must be [{hd}] or [{n}, {hd}], got {col.shape}")
    xb = sc.put("qx", x)
    cb = sc.put("qcol", col) if use_col else sc.dummy
    qb = sc.get("qq", qh.nbytes)
    sb = sc.get("qs", sh.nbytes)
    programs.kernel(prg, "quantize_rows")(dev.queue, (ngr, n), None, xb, cb, np.int32(use_col),
                      np.int32(hd if use_col and col.ndim == 2 else 0), np.int32(n),
                      np.int32(hd), np.int32(group), qb, sb)
    cl.enqueue_copy(dev.queue, qh, qb)
    cl.enqueue_copy(dev.queue, sh, sb)
    return qh, sh
