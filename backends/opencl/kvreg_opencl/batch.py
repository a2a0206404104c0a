"""Batched decode on the device: one layer of ``B`` sequences in one launch.

Design. The attend kernels (``cl/attend.cl``) read a layer's rows from one
set of buffers laid out ``[nkv, cap, ...]``; OpenCL 1.2 has no arrays of
buffers, so ``B`` sequences' rows, each in its own layer mirror
(:class:`~kvreg_opencl.mirror.DeviceMirror`, its own capacity), cannot be
handed to one launch as they are. A :class:`BatchBuffers` holds the batch's
rows assembled in slots, ``[slots * nkv, cap, ...]`` (slot ``s``'s head
``h`` is storage head ``s * nkv + h``), and the kernels take ``tg = nkv``
and ``tslot``: token ``t`` of the launch is sequence ``t`` and reads the
heads of slot ``tslot[t]``. Nothing else of the arithmetic changes (the
same ``partial_*``, ``merge``, ``probs`` programs, blocks anchored at
``first``, the same work-group size and heads per work-group), so row ``b``
is the bits of ``attend_layer`` on sequence ``b``.

The slots are filled with device-side copies from the layer mirrors,
incrementally: each mirror is synced first (uploading only what changed on
the host, as ``attend_layer`` does), then each sequence's slot (found again
by its storage, whatever its place in this batch) copies, per head, only
the rows ``[floor, lens)`` it lacks, the floor found as a mirror's is
(``KvView.unchanged_rows`` of the version the slot copied, the same owner
and the same mirror); a windowed q8 side's int8 rows go over ``[min(floor,
b8 copied), b8)``, and the small arrays (fields, exact rows, the float16
windows and their bounds) are copied whole whenever the slot's version
moved. A decode step then moves one row per head and sequence on the
device, and a sequence joining or leaving the batch costs the others
nothing. The costs: the batch's rows are held twice on the device (mirrors
and slots, every slot at the longest sequence's capacity); a step takes a
few copy enqueues per sequence (host-side, ~10 µs each under PoCL) besides
the attention's launches (partial, merge, and with importance probs and
importance_batch: each one enqueue for the whole batch); a longer
sequence or a bigger batch than the slots hold reallocates them (doubling)
and copies every sequence again.

Every non-q4 mode is batched (F32, F16, BF16, Q8, Q8K, Q8V and the 2f
modes); q4 takes the reference's loop (as its attend_layer does). A batch
whose mirrors disagree on layout (the exact-row or window capacity) takes
the per-sequence loop too.
"""

from __future__ import annotations

import weakref

import numpy as np

from . import config, programs
from .kernels import _launch_lock, launch_partial, one_item, partial_states, score_stride, scratch, visible
from .mirror import ROW_ARRAYS, owner_ref, owns


class _Slot:
    __slots__ = ("mirror", "owner", "version", "lens", "b8")

    def __init__(self):
        self.mirror = None  # weakref to the layer mirror copied from
        self.owner = None   # weakref to the storage owner
        self.version = None
        self.lens = None
        self.b8 = None

    def holds(self, kv, m) -> bool:
        """Whether this slot last copied ``kv``'s storage from mirror ``m``."""
        return self.mirror is not None and self.mirror() is m and owns(self.owner, kv.owner)


class BatchBuffers:
    """The assembled rows of a batch (one set per device): ``nslots`` slots
    of ``nkv`` heads, a slot per sequence, found again by the sequence's
    storage (its owner) at the next call whatever its place in the batch,
    so sequences that join or leave a batch cost the others nothing."""

    def __init__(self, dev):
        self.dev = dev
        self.key = None  # (nkv, hd, row shapes, xcap, wcap)
        self.cap = 0
        self.buffers: dict[str, object] = {}
        self.slots: list[_Slot] = []
        self._where: dict[int, int] = {}  # id(owner) -> slot
        self.rows_copied = 0  # head-rows copied device to device (tests)
        self.full_copies = 0

    def _alloc(self, key, nslots, nkv, hd, shapes, xcap, wcap, cap):
        cl = self.dev.cl
        ctx = self.dev.context
        heads = nslots * nkv
        bufs = {}
        for name, (rshape, dt) in shapes.items():
            rb = int(np.prod(rshape, dtype=np.int64)) * dt.itemsize
            bufs[name] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max(1, heads * cap * rb))
        for name in ("kcol", "vcol"):
            bufs[name] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max(4, heads * hd * 4))
        if xcap:
            for name in ("xk", "xv"):
                bufs[name] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max(4, heads * xcap * hd * 4))
            bufs["xlen"] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max(4, heads * 4))
        if wcap:
            for name in ("thk", "thv"):
                bufs[name] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max(2, heads * wcap * hd * 2))
            bufs["b8"] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max(4, heads * 4))
        self.buffers = bufs
        self.key = key
        self.cap = cap
        self.slots = [_Slot() for _ in range(nslots)]
        self._where = {}

    def _copy_rows(self, m, s, name, lo, hi, nkv):
        """Rows ``[lo[h], hi[h])`` of every head of mirror ``m``'s ``name``
        into slot ``s``; consecutive heads with one range in one copy."""
        cl = self.dev.cl
        rshape, dt = m.row_shapes[name]
        rb = int(np.prod(rshape, dtype=np.int64)) * dt.itemsize
        heads = len(self.slots) * nkv
        h = 0
        while h < nkv:
            if hi[h] <= lo[h]:
                h += 1
                continue
            e = h + 1
            while e < nkv and lo[e] == lo[h] and hi[e] == hi[h]:
                e += 1
            a, b = int(lo[h]), int(hi[h])
            cl.enqueue_copy(self.dev.queue, self.buffers[name], m.buffers[name],
                            src_origin=(a * rb, h, 0), dst_origin=(a * rb, s * nkv + h, 0),
                            region=((b - a) * rb, e - h, 1),
                            src_pitches=(m.cap * rb, m.cap * rb * nkv),
                            dst_pitches=(self.cap * rb, self.cap * rb * heads))
            self.rows_copied += (b - a) * (e - h)
            h = e

    def _copy_whole(self, src, name, s, nbytes):
        if src is None or nbytes == 0:
            return
        self.dev.cl.enqueue_copy(self.dev.queue, self.buffers[name], src, byte_count=nbytes,
                                 src_offset=0, dst_offset=s * nbytes)

    def _assign(self, kvs, mirrors, live) -> list[int]:
        """A slot per live sequence: the one that holds its storage when
        there is one (and no other sequence of this call took it), else a
        free one, preferring slots whose storage is gone. -1: none left."""
        out = [-1] * len(kvs)
        taken = set()
        for b, (kv, m, ok) in enumerate(zip(kvs, mirrors, live)):
            if not ok or kv.owner is None:
                continue
            s = self._where.get(id(kv.owner))
            if s is not None and s not in taken and self.slots[s].holds(kv, m):
                out[b] = s
                taken.add(s)
        free = [s for s in range(len(self.slots)) if s not in taken]
        free.sort(key=lambda s: self.slots[s].owner is not None and self.slots[s].owner() is not None)
        free.reverse()  # pop() takes the slots whose storage is gone first
        for b, ok in enumerate(live):
            if ok and out[b] < 0:
                if not free:
                    return None
                s = free.pop()
                out[b] = s
                old = self.slots[s]
                o = None if old.owner is None else old.owner()
                if o is not None and self._where.get(id(o)) == s:
                    del self._where[id(o)]
                self.slots[s] = _Slot()
        return out

    def fill(self, kvs, mirrors, live):
        """Make the batch hold every live sequence's rows: the slot of each
        sequence (0 for one with no rows), or None when the mirrors disagree
        on layout (the caller loops instead)."""
        ms = [m for m, ok in zip(mirrors, live) if ok]
        m0 = ms[0]
        nkv, hd = m0.nkv, m0.hd
        shapes = m0.row_shapes
        xcap, wcap = m0.xcap, m0.wcap
        for m in ms[1:]:
            if m.row_shapes != shapes or m.nkv != nkv or m.hd != hd or m.xcap != xcap or m.wcap != wcap \
                    or (m.kcol is None) != (m0.kcol is None) or (m.vcol is None) != (m0.vcol is None):
                return None
        need = max(int(np.asarray(kv.lens).max(initial=0)) for kv, ok in zip(kvs, live) if ok)
        key = (nkv, hd, tuple(sorted((k, v[0], v[1].str) for k, v in shapes.items())), xcap, wcap)
        slots = None
        if key == self.key and need <= self.cap:
            slots = self._assign(kvs, mirrors, live)
        if slots is None:  # (re)allocate: room for the batch (a power of two of slots), every slot fresh
            nslots = max(len(self.slots) if key == self.key else 1, 1 << max(0, len(kvs) - 1).bit_length())
            while nslots < len(kvs):
                nslots *= 2
            cap = max(config.MIRROR_MIN_ROWS, 1 << max(0, need - 1).bit_length(),
                      self.cap if key == self.key else 0)
            self._alloc(key, nslots, nkv, hd, shapes, xcap, wcap, cap)
            slots = self._assign(kvs, mirrors, live)
        for b, (kv, m, ok) in enumerate(zip(kvs, mirrors, live)):
            if not ok:
                slots[b] = 0
                continue
            s = slots[b]
            slot = self.slots[s]
            same = slot.holds(kv, m)
            if same and slot.version == kv.version:
                continue
            lens = np.asarray(kv.lens, dtype=np.int64)
            b8 = m.b8 if m.window_names else lens
            floor = kv.unchanged_rows(slot.version) if same else None
            if floor is None:
                valid = np.zeros(nkv, np.int64)
                wvalid = valid
                self.full_copies += 1
            else:
                valid = np.minimum(slot.lens, floor)
                wvalid = np.minimum(valid, slot.b8)
            for name in shapes:
                if name in m.window_names:
                    self._copy_rows(m, s, name, wvalid, b8, nkv)
                else:
                    self._copy_rows(m, s, name, valid, lens, nkv)
            self._copy_whole(m.kcol, "kcol", s, nkv * hd * 4)
            self._copy_whole(m.vcol, "vcol", s, nkv * hd * 4)
            if xcap:
                self._copy_whole(m.xk, "xk", s, nkv * xcap * hd * 4)
                self._copy_whole(m.xv, "xv", s, nkv * xcap * hd * 4)
                self._copy_whole(m.xlen_buf, "xlen", s, nkv * 4)
            if wcap:
                self._copy_whole(m.thk, "thk", s, nkv * wcap * hd * 2)
                self._copy_whole(m.thv, "thv", s, nkv * wcap * hd * 2)
                self._copy_whole(m.b8_buf, "b8", s, nkv * 4)
            slot.mirror = weakref.ref(m)  # a dropped layer's mirror is not kept alive here
            if not same:
                slot.owner = owner_ref(kv.owner)
                if slot.owner is not None:
                    self._where[id(kv.owner)] = s
            slot.version = kv.version
            slot.lens = lens.copy()
            slot.b8 = np.array(b8, dtype=np.int64)
        return slots


_batches: dict[int, BatchBuffers] = {}


def batch_buffers(dev) -> BatchBuffers:
    b = _batches.get(dev.device.int_ptr)
    if b is None or b.dev is not dev:
        b = _batches[dev.device.int_ptr] = BatchBuffers(dev)
    return b


def attend_batch(backend, q, kvs, *, scale, window=None, softcap=0.0, sinks=None, imps=None):
    """``attend_layer`` of every sequence in one launch of each attention
    program (see the module docstring); None when the batch cannot be
    assembled (the caller loops)."""
    with _launch_lock:
        return _attend_batch(backend, q, kvs, scale=scale, window=window, softcap=softcap, sinks=sinks,
                             imps=imps)


def _attend_batch(backend, q, kvs, *, scale, window, softcap, sinks, imps):
    B, nq, hd = q.shape
    live = [not backend._empty(kv) for kv in kvs]
    out = np.zeros((B, nq, hd), np.float32)
    if not any(live):
        return out
    mirrors = [backend.mirror(kv) if ok else None for kv, ok in zip(kvs, live)]
    dev = backend._dev
    bb = batch_buffers(dev)
    slots = bb.fill(kvs, mirrors, live)
    if slots is None:
        return None
    m0 = next(m for m in mirrors if m is not None)
    nkv = m0.nkv
    hpk = nq // nkv
    nlim = np.zeros((B, nkv), np.int64)
    firsts = np.zeros((B, nkv), np.int64)
    for b, (kv, ok) in enumerate(zip(kvs, live)):
        if ok:
            lens = np.asarray(kv.lens, dtype=np.int64)
            first = np.maximum(0, lens - int(window)) if window else 0
            nlim[b], firsts[b] = visible(lens, first, None)
    nlim = nlim.astype(np.int32)
    firsts = firsts.astype(np.int32)
    spans = np.where(nlim > 0, nlim - firsts, 0)
    smax = int(spans.max(initial=0))
    if smax == 0:
        return out
    prg = programs.attend_program(dev, hpk)
    sc = scratch(dev)
    queue = dev.queue
    cl = dev.cl
    bufs = bb.buffers
    br, hc, nblk, pm, ps, pacc = partial_states(sc, B, nq, hd, hpk, smax)
    q_buf = sc.put("q", np.ascontiguousarray(q, dtype=np.float32))
    ts_buf = sc.put("tslot", np.asarray(slots, dtype=np.int32))
    nl_buf = sc.put("nlim", nlim)
    fi_buf = sc.put("firsts", firsts)
    want_imp = imps is not None and any(i is not None for i in imps)
    sstride = score_stride(dev, smax)
    sc_buf = sc.get("scores", B * nq * sstride * 4) if want_imp else sc.dummy
    row_bufs = {n: bufs[n] for n in ROW_ARRAYS if n in bufs}
    exact = (bufs["xk"] if m0.xk is not None else None, bufs["xv"] if m0.xv is not None else None,
             bufs["xlen"], m0.xcap) if m0.xcap else None
    win = (bufs["thk"] if m0.thk is not None else None, bufs["thv"] if m0.thv is not None else None,
           bufs["b8"], m0.wcap) if m0.wcap else None
    d = sc.dummy
    kcol = bufs["kcol"] if m0.kcol is not None else d
    vcol = bufs["vcol"] if m0.vcol is not None else d
    launch_partial(dev, prg, (m0.k_quant, m0.v_quant), q_buf, row_bufs, kcol, vcol, nl_buf, fi_buf,
                   g0=0, ng=nkv, cap=bb.cap, hd=hd, hpk=hpk, hc=hc, br=br, nblk=nblk, T=B, scale=scale,
                   softcap=softcap, pm=pm, ps=ps, pacc=pacc, scores=sc_buf, sstride=sstride,
                   want_scores=want_imp, exact=exact, kv_dtype=m0.kv_dtype, window=win, tg=nkv, tslot=ts_buf)
    has_sinks = sinks is not None
    sk_buf = sc.put("sinks", np.ascontiguousarray(sinks, dtype=np.float32).reshape(B * nq)) if has_sinks else d
    out_buf = sc.get("out", B * nq * hd * 4)
    mz = sc.get("mz", B * nq * 2 * 4)
    programs.kernel(prg, "merge")(
        queue, (1 if one_item(dev) else hd, nq, B), None,
        pm, ps, pacc, nl_buf, fi_buf, sk_buf, np.int32(has_sinks), np.int32(nq),
        vcol, np.int32(m0.v_quant), np.int32(0), np.int32(nkv), np.int32(hd),
        np.int32(hpk), np.int32(br), np.int32(nblk), np.int32(nkv), ts_buf, out_buf, mz,
    )
    if want_imp:
        programs.kernel(prg, "probs")(queue, (1 if one_item(dev) else sstride, nq, B), None,
                                      sc_buf, mz, nl_buf, fi_buf,
                                      np.int32(nkv), np.int32(hpk), np.int32(sstride))
        his = np.zeros(B, np.int32)
        for b, imp in enumerate(imps):
            if imp is not None and live[b]:
                his[b] = min(len(imp), int(nlim[b].max(initial=0)))
        istride = max(1, int(his.max(initial=0)))
        if int(his.max(initial=0)) > 0:
            host = np.zeros((B, istride), np.float32)
            for b, imp in enumerate(imps):
                if his[b]:
                    host[b, :his[b]] = imp[:his[b]]
            ib = sc.put("imp", host)
            lb = sc.put("imp_len", his)
            programs.kernel(prg, "importance_batch")(queue, (istride, B), None, ib, lb, np.int32(istride),
                                                     sc_buf, nl_buf, fi_buf, np.int32(nkv), np.int32(hpk),
                                                     np.int32(sstride))
            cl.enqueue_copy(queue, host, ib)
            for b, imp in enumerate(imps):
                if his[b]:
                    imp[:his[b]] = host[b, :his[b]]
    cl.enqueue_copy(queue, out, out_buf)
    return out
