"""The bounded ring (``kvreg.bounded``) resident on the device.

A :class:`RingMirror` holds one layer's ring as ``cl/bounded.cl`` lays it
out: sink rows, then every slot twice (the "doubled ring"), keys already
rotated at the position their slot holds. A decode step changes one slot per
head (``BoundedState.insert`` writes slot ``(seen - 1) % window`` in place),
so a step uploads that slot only; the attend itself rotates nothing but the
query.

What the mirror knows about the host ring is the array objects it was given
(weak references: the ring arrays are allocated once per layer and written
in place), the ``seen`` of its last sync, the rope, and a copy of the slot it
wrote last. It uploads one slot when ``seen`` advanced by exactly one since
the last sync AND that last-written slot still holds what it wrote;
anything else (rollback, restore, load, clear, several inserts without an
attend, a new rope) is a full re-upload. The slot check is what catches a
``restore`` of a sibling speculation branch whose ``seen`` happens to be one
ahead: its newest row differs from the one the mirror holds. A change that
keeps both ``seen + 1`` and that row bit for bit but rewrites older slots is
not seen; nothing in kvreg does that (see docs/opencl.md).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
from kvreg.bounded import BoundedRope

from . import config, programs
from .device import DeviceState
from .kernels import _launch_lock, launch_partial, scratch


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


class RingMirror:
    """Device copy of one bounded ring; call :meth:`sync` before a launch."""

    def __init__(self, dev: DeviceState):
        self.dev = dev
        self.kbuf = self.vbuf = None
        self.kvh = self.window = self.hd = self.sink = 0
        self.cap = 0  # rows per head on the device: sink + 2 * window
        self.seen = None
        self.rope_key = None
        self._refs = None  # weakrefs to the host ring_k, ring_v
        self._last_k = self._last_v = None  # host copy of the slot written last
        self._sink_k = self._sink_v = None  # host copy of the sinks on the device
        self.bytes_uploaded = 0  # ring K+V and sink row bytes (cos/sin tables not counted)
        self.slot_uploads = 0  # single-slot decode updates
        self.rows_uploaded = 0  # head-slots
        self.full_reuploads = 0
        self.sink_uploads = 0
        self.syncs = 0

    # -- uploads -------------------------------------------------------------
    def _store(self, ring_k, ring_v, positions: np.ndarray, rope: BoundedRope):
        """Rotate and store the slots holding ``positions`` (one ring_store launch)."""
        sc = scratch(self.dev)
        slots = (positions % self.window).astype(np.int32)
        n = len(slots)
        if n == 1:
            raw_k = np.ascontiguousarray(ring_k[:, int(slots[0]), :])
            raw_v = np.ascontiguousarray(ring_v[:, int(slots[0]), :])
        else:
            raw_k = np.ascontiguousarray(ring_k[:, slots, :])
            raw_v = np.ascontiguousarray(ring_v[:, slots, :])
        # Direct evaluation for every slot (not the reference's angle-addition
        # table, ~1 ulp away): a slot's rotated key is then the same bits
        # whether it arrived in a one-slot update or a full re-upload.
        cs, sn = rope.cos_sin(positions, self.hd)
        half = cs.shape[1]
        d = sc.dummy
        bufs = (sc.put("ring_k", raw_k), sc.put("ring_v", raw_v),
                sc.put("ring_cos", cs) if half else d, sc.put("ring_sin", sn) if half else d,
                sc.put("ring_slots", slots))
        programs.kernel(programs.bounded_program(self.dev), "ring_store")(
            self.dev.queue, (self.hd, n, self.kvh), None, *bufs,
            np.int32(n), np.int32(self.hd), np.int32(half), np.int32(self.sink),
            np.int32(self.window), np.int32(self.cap), self.kbuf, self.vbuf)
        # an in-order queue: the staging buffers are reused only after this
        self.bytes_uploaded += raw_k.nbytes + raw_v.nbytes
        self.rows_uploaded += n * self.kvh

    def _store_sinks(self, sk: np.ndarray, sv: np.ndarray):
        cl = self.dev.cl
        rb = self.hd * 4
        if self.sink:
            for buf, host in ((self.kbuf, sk), (self.vbuf, sv)):
                cl.enqueue_copy(
                    self.dev.queue, buf, np.ascontiguousarray(host),
                    buffer_origin=(0, 0, 0), host_origin=(0, 0, 0),
                    region=(self.sink * rb, self.kvh, 1),
                    buffer_pitches=(self.cap * rb, self.cap * rb * self.kvh),
                    host_pitches=(self.sink * rb, self.sink * rb * self.kvh),
                )
                self.bytes_uploaded += host.nbytes
        self._sink_k, self._sink_v = sk.copy(), sv.copy()
        self.sink_uploads += 1

    # -- the one entry point ---------------------------------------------------
    def sync(self, ring_k: np.ndarray, ring_v: np.ndarray, seen: int, sink_k: np.ndarray,
             sink_v: np.ndarray, rope: BoundedRope) -> None:
        """Make the device hold ``ring_k``/``ring_v`` at ``seen`` and the sinks
        (arguments as :func:`kvreg.bounded.check_bounded_attend_args` returns them)."""
        kvh, window, hd = ring_k.shape
        sink = sink_k.shape[1]
        rkey = (float(rope.theta), rope.dims(hd))
        self.syncs += 1
        same = (
            self._refs is not None
            and self._refs[0]() is ring_k and self._refs[1]() is ring_v
            and (kvh, window, hd, sink) == (self.kvh, self.window, self.hd, self.sink)
            and rkey == self.rope_key
        )
        if not same:
            cl = self.dev.cl
            self.kvh, self.window, self.hd, self.sink = kvh, window, hd, sink
            self.cap = sink + 2 * window
            nbytes = max(4, kvh * self.cap * hd * 4)
            self.kbuf = cl.Buffer(self.dev.context, cl.mem_flags.READ_WRITE, nbytes)
            self.vbuf = cl.Buffer(self.dev.context, cl.mem_flags.READ_WRITE, nbytes)
            self._refs = (weakref.ref(ring_k), weakref.ref(ring_v))
            self.rope_key = rkey
            self._sink_k = None
            self.seen = None
        if self._sink_k is None or not (_same_bits(sink_k, self._sink_k)
                                        and _same_bits(sink_v, self._sink_v)):
            self._store_sinks(sink_k, sink_v)
        last = (self.seen - 1) % window if self.seen else None
        step = (
            self.seen is not None and seen == self.seen + 1 and window > 1 and last is not None
            and _same_bits(ring_k[:, last], self._last_k) and _same_bits(ring_v[:, last], self._last_v)
        )
        if step:
            self._store(ring_k, ring_v, np.array([seen - 1], np.int64), rope)
            self.slot_uploads += 1
        else:
            n = min(seen, window)
            self._store(ring_k, ring_v, np.arange(seen - n, seen, dtype=np.int64), rope)
            self.full_reuploads += 1
        s = (seen - 1) % window
        self._last_k, self._last_v = ring_k[:, s].copy(), ring_v[:, s].copy()
        self.seen = seen

    def counters(self) -> dict[str, int]:
        return {
            "bytes_uploaded": self.bytes_uploaded,
            "rows_uploaded": self.rows_uploaded,
            "slot_uploads": self.slot_uploads,
            "full_reuploads": self.full_reuploads,
            "sink_uploads": self.sink_uploads,
            "syncs": self.syncs,
        }


class RingMirrors:
    """The mirrors of one backend, one per host ring (keyed by the ``ring_k``
    object, dropped when that array is garbage collected)."""

    def __init__(self, dev: DeviceState):
        self.dev = dev
        self._by_id: dict[int, RingMirror] = {}
        self._lock = threading.Lock()

    def get(self, ring_k: np.ndarray) -> RingMirror:
        key = id(ring_k)
        with self._lock:
            m = self._by_id.get(key)
            if m is None or m._refs is None or m._refs[0]() is not ring_k:
                m = self._by_id[key] = RingMirror(self.dev)
                weakref.finalize(ring_k, self._by_id.pop, key, None)
        return m


def bounded_attend(mirror: RingMirror, q32: np.ndarray, seen: int, group_windows, rope: BoundedRope,
                   scale: float) -> np.ndarray:
    """Attend ``q32 [nh, hd]`` (raw, validated) over a synced ring mirror."""
    with _launch_lock:
        return _bounded_attend(mirror, q32, seen, group_windows, rope, scale)


def _bounded_attend(mirror, q32, seen, group_windows, rope, scale):
    dev = mirror.dev
    cl = dev.cl
    kvh, window, hd, sink = mirror.kvh, mirror.window, mirror.hd, mirror.sink
    nq = q32.shape[0]
    hpk = nq // kvh
    # the query's rotation is the reference's own (one row per head)
    qr = rope.apply(q32[:, None, :], start=seen - 1)[:, 0, :]
    q2 = np.ascontiguousarray(np.broadcast_to(qr, (2, nq, hd)))
    n = np.minimum(np.minimum(seen, window), np.asarray(group_windows, dtype=np.int64))
    start = (seen - n) % window
    nlim = np.empty((2, kvh), np.int32)
    firsts = np.empty((2, kvh), np.int32)
    nlim[0], firsts[0] = sink, 0  # token 0: the sinks (nothing when sink == 0)
    firsts[1] = sink + start
    nlim[1] = sink + start + n
    br = int(config.BLOCK_ROWS)
    hc = max(1, min(int(config.HEADS_PER_WG), hpk))
    smax = int(max(sink, int(n.max())))
    nblk = max(1, -(-smax // br))
    sc = scratch(dev)
    prg = programs.attend_program(dev)
    q_buf = sc.put("bq", q2)
    nl_buf = sc.put("bnlim", nlim)
    fi_buf = sc.put("bfirsts", firsts)
    pm = sc.get("pm", 2 * nq * nblk * 4)
    ps = sc.get("ps", 2 * nq * nblk * 4)
    pacc = sc.get("pacc", 2 * nq * nblk * hd * 4)
    launch_partial(dev, prg, (False, False), q_buf, {"k": mirror.kbuf, "v": mirror.vbuf},
                   sc.dummy, sc.dummy, nl_buf, fi_buf, g0=0, ng=kvh, cap=mirror.cap, hd=hd,
                   hpk=hpk, hc=hc, br=br, nblk=nblk, T=2, scale=scale, softcap=0.0,
                   pm=pm, ps=ps, pacc=pacc, scores=sc.dummy, sstride=1, want_scores=False)
    out_buf = sc.get("out", nq * hd * 4)
    programs.kernel(programs.bounded_program(dev), "bounded_merge")(
        dev.queue, (hd, nq), None, pm, ps, pacc, nl_buf, fi_buf, np.int32(kvh), np.int32(hpk),
        np.int32(hd), np.int32(br), np.int32(nblk), out_buf)
    out = np.empty((nq, hd), np.float32)
    cl.enqueue_copy(dev.queue, out, out_buf)
    return out
