"""The bounded ring (``kvreg.bounded``) resident on the device.

A :class:`RingMirror` holds one layer's ring as ``cl/bounded.cl`` lays it
out: sink rows, then every slot twice (the "doubled ring"), keys already
rotated at the position their slot holds. A decode step changes one slot per
head (``BoundedState.insert`` writes slot ``(seen - 1) % window`` in place),
so a step uploads that slot only; the attend itself rotates nothing but the
query.

What the mirror knows about the host ring is the :class:`kvreg.plugin.RingView`
version of its last sync and which ring that is (its ``owner``, held weakly:
a view of another ring, or one without an owner, is a full re-upload), the
``seen`` then, the rope and the sinks. A view
whose ``reset_version`` is not newer than that version has only had inserts
since, so the slots of positions ``[seen then, seen)`` are uploaded (one slot
for a decode step); anything else (rollback, restore, load, clear, more
inserts than the window, a new rope) is a full re-upload. Every mutation of
a ring moves its version, so no change goes unseen.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from kvreg.bounded import BoundedRope

from . import config, programs
from .device import DeviceState
from .kernels import _launch_lock, launch_partial, scratch
from .mirror import owner_ref, owns


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
        self.version = None
        self._owner = None  # weakref to the ring ``version`` is of
        self.rope_key = None
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
    def sync(self, ring) -> None:
        """Make the device hold the ring and sinks of ``ring`` (a :class:`kvreg.plugin.RingView`)."""
        ring_k, ring_v, seen, sink_k, sink_v, rope = ring.k, ring.v, ring.seen, ring.sink_k, ring.sink_v, ring.rope
        kvh, window, hd = ring_k.shape
        sink = sink_k.shape[1]
        rkey = (float(rope.theta), rope.dims(hd))
        self.syncs += 1
        same = self.kbuf is not None and (kvh, window, hd, sink) == (self.kvh, self.window, self.hd, self.sink) \
            and rkey == self.rope_key
        if not same:
            cl = self.dev.cl
            self.kvh, self.window, self.hd, self.sink = kvh, window, hd, sink
            self.cap = sink + 2 * window
            nbytes = max(4, kvh * self.cap * hd * 4)
            self.kbuf = cl.Buffer(self.dev.context, cl.mem_flags.READ_WRITE, nbytes)
            self.vbuf = cl.Buffer(self.dev.context, cl.mem_flags.READ_WRITE, nbytes)
            self.rope_key = rkey
            self._sink_k = None
            self.version = self.seen = None
        if self._sink_k is None or not (_same_bits(sink_k, self._sink_k)
                                        and _same_bits(sink_v, self._sink_v)):
            self._store_sinks(sink_k, sink_v)
        if not owns(self._owner, ring.owner):
            # another ring's (or an ownerless) view: its versions say nothing about these slots
            self.version = self.seen = None
            self._owner = owner_ref(ring.owner)
        if self.version == ring.version:
            return
        inserts_only = self.version is not None and self.version >= ring.reset_version and seen >= self.seen
        if inserts_only and seen - self.seen < window:
            if seen > self.seen:
                self._store(ring_k, ring_v, np.arange(self.seen, seen, dtype=np.int64), rope)
                self.slot_uploads += 1
        else:
            n = min(seen, window)
            self._store(ring_k, ring_v, np.arange(seen - n, seen, dtype=np.int64), rope)
            self.full_reuploads += 1
        self.seen, self.version = seen, ring.version

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
    """The mirrors of one backend, one per host ring (keyed by the view's
    ``owner``, dropped when the ring is garbage collected; a view without an
    owner gets a mirror of its own)."""

    def __init__(self, dev: DeviceState):
        self.dev = dev
        self._by_owner: weakref.WeakKeyDictionary[object, RingMirror] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, owner) -> RingMirror:
        if owner is None:
            return RingMirror(self.dev)
        with self._lock:
            m = self._by_owner.get(owner)
            if m is None:
                m = self._by_owner[owner] = RingMirror(self.dev)
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
    hc = programs.heads_per_wg(hpk)
    smax = int(max(sink, int(n.max())))
    nblk = max(1, -(-smax // br))
    sc = scratch(dev)
    prg = programs.attend_program(dev, hpk)
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
