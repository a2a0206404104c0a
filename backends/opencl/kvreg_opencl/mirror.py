"""Device mirrors: a layer's rows kept on the device between calls.

A mirror copies the storage arrays of docs/kernels.md (``k``/``kq``/``ks``,
``v``/``vq``/``vs`` as ``[nkv, cap, ...]``, the fields ``kcol``/``vcol``) into
device buffers of its own capacity, byte for byte in their storage dtype (f16
and bf16 ``k``/``v`` blocks stay 2 bytes an element on the device: the
kernels widen them as they read), and remembers what it holds:

* ``version`` -- the :class:`kvreg.plugin.KvView`'s version, which moves on
  every mutation of the storage: the same version means nothing to do.
* ``owner`` -- which storage that version is of (held weakly): a view of
  another storage, or one without an owner, is a full upload (its
  ``unchanged_rows`` says nothing about rows another storage left here).
* ``KvView.unchanged_rows(version mirrored)`` -- per head, how many leading
  rows are still the bits mirrored then (truncations lower it, appends do
  not), or None when every row may have changed (the q8 freeze, a trim, an
  eviction, clear, an import, or a truncation log that no longer reaches
  back): rows from that floor up are uploaded, None is a full upload.

So a decode step uploads only the appended row of each head, which the
counters (``bytes_uploaded``, ``rows_uploaded``, ``partial_uploads``,
``full_reuploads``) let a test prove.

q8 exact rows (``exact_cap``, ``xk``/``xv [nkv, exact_cap, hd]``, ``xlen``):
a few rows per head, so they are re-uploaded whole (both sides and ``xlen``)
whenever they may have changed: a full upload, a changed ``xlen`` (an append
inside the exact range, a truncation, a trim), or a truncation since the last
sync whose floor reaches below ``xlen`` (truncate + re-append rewrites exact
rows in place, same ``xlen``). A decode step past the exact
range uploads none of them (``exact_uploads``/``exact_bytes_uploaded`` count
them apart from the row counters).

q8 float16 windows (``window``, ``thk``/``thv [nkv, window, hd]`` float16,
``b8 [nkv]``; q8, q8k, q8v): each head's newest rows of a quantized side live
in the window, not in the int8 blocks, and the window is rewritten in place
on every append (a row leaving it is quantized into its int8 slot then). So:

* the window arrays and ``b8`` (a few KiB) are uploaded whole, as stored
  (binary16, 2 bytes an element), whenever they may have changed: any change
  of version since the last sync
  (``window_uploads``/``window_bytes_uploaded``);
* the int8 blocks of a windowed side (``kq``/``ks``, ``vq``/``vs``) are
  uploaded over ``[min(valid, b8 last synced), b8)``: the rows that left the
  window since (their slots were written after the rows were counted), never
  the unwritten slots of the window rows; an unquantized side's block goes by
  the rows as before. A decode step past the window uploads one int8 row per
  head (the one that left) and the window.
"""

from __future__ import annotations

import weakref

import numpy as np

from kvreg.errors import ShapeError

from . import config
from .device import DeviceState

ROW_ARRAYS = ("k", "kq", "ks", "v", "vq", "vs")


def owner_ref(owner):
    """A weak reference to a view's owner (None: no owner, or not weakly referable)."""
    try:
        return None if owner is None else weakref.ref(owner)
    except TypeError:
        return None


def owns(ref, owner) -> bool:
    """Whether ``ref`` (from :func:`owner_ref`) is a live reference to ``owner``."""
    return ref is not None and owner is not None and ref() is owner


def _present(kv, name):
    a = kv.array(name)
    return None if a is None else np.asarray(a)


class DeviceMirror:
    """Device copy of one layer storage. Call :meth:`sync` before a launch."""

    def __init__(self, dev: DeviceState):
        self.dev = dev
        self.buffers: dict[str, object] = {}
        self.row_shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.cap = 0
        self.nkv = 0
        self.hd = 0
        self.version = None
        self._owner = None  # weakref to the storage ``version`` is of
        self.lens = np.zeros(0, dtype=np.int64)
        self.kcol = None  # device buffers [nkv, hd], ones where unset
        self.vcol = None
        self.bytes_uploaded = 0
        self.rows_uploaded = 0  # head-rows
        self.full_reuploads = 0
        self.partial_uploads = 0
        self.syncs = 0
        # q8 exact rows: device copies of xk/xv/xlen (None / 0 when off)
        self.xcap = 0
        self.xk = None
        self.xv = None
        self.xlen_buf = None
        self.xlen = np.zeros(0, dtype=np.int64)
        self.exact_uploads = 0
        self.exact_bytes_uploaded = 0
        # q8 float16 windows: device copies of thk/thv/b8 (None / 0 when off)
        self.wcap = 0
        self.thk = None
        self.thv = None
        self.b8_buf = None
        self.b8 = np.zeros(0, dtype=np.int64)  # the bound the int8 rows are synced to
        self.window_names: tuple[str, ...] = ()  # int8 arrays whose tail is the window
        self.window_uploads = 0
        self.window_bytes_uploaded = 0

    # -- helpers -----------------------------------------------------------
    @property
    def k_quant(self) -> bool:
        return "kq" in self.buffers

    @property
    def v_quant(self) -> bool:
        return "vq" in self.buffers

    @property
    def kv_dtype(self) -> np.dtype | None:
        """dtype of the unquantized K/V buffers as mirrored (float32, float16,
        or uint16 = bfloat16 bits: uploaded as stored, 2 bytes an element for
        the half modes); None when both sides are q8."""
        for name in ("k", "v"):
            if name in self.row_shapes:
                return self.row_shapes[name][1]
        return None

    def _layout(self, storage):
        shapes = {}
        for name in ROW_ARRAYS:
            a = _present(storage, name)
            if a is not None:
                shapes[name] = (tuple(a.shape[2:]), a.dtype)
        return shapes

    def _alloc(self, cap: int, keep_rows: np.ndarray | None):
        """(Re)allocate every row buffer at ``cap`` rows per head, copying the
        first ``keep_rows[h]`` rows of each head on the device."""
        cl = self.dev.cl
        new = {}
        for name, (rshape, dt) in self.row_shapes.items():
            rb = int(np.prod(rshape, dtype=np.int64)) * dt.itemsize
            buf = cl.Buffer(self.dev.context, cl.mem_flags.READ_WRITE, max(1, self.nkv * cap * rb))
            old = self.buffers.get(name)
            if old is not None and keep_rows is not None and self.nkv:
                keep = int(keep_rows.max(initial=0))
                if keep > 0:
                    cl.enqueue_copy(
                        self.dev.queue, buf, old,
                        src_origin=(0, 0, 0), dst_origin=(0, 0, 0),
                        region=(keep * rb, self.nkv, 1),
                        src_pitches=(self.cap * rb, self.cap * rb * self.nkv),
                        dst_pitches=(cap * rb, cap * rb * self.nkv),
                    )
            new[name] = buf
        self.buffers = new
        self.cap = cap

    def _upload_fields(self, storage):
        cl = self.dev.cl
        for attr, flag in (("kcol", "kcol_set"), ("vcol", "vcol_set")):
            col = _present(storage, attr)
            if col is None:
                setattr(self, attr, None)
                continue
            isset = np.asarray(storage.array(flag), dtype=bool).reshape(self.nkv, 1)
            host = np.where(isset, col.reshape(self.nkv, self.hd), np.float32(1.0)).astype(np.float32)
            buf = cl.Buffer(self.dev.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
            setattr(self, attr, buf)

    def _upload_rows(self, storage, lo: np.ndarray, hi: np.ndarray, names=None):
        """Copy rows [lo[h], hi[h]) of every head of the row arrays ``names``
        (None: all); consecutive heads with the same range go in one
        rectangular copy."""
        cl = self.dev.cl
        shapes = {n: self.row_shapes[n] for n in (self.row_shapes if names is None else names)}
        if not shapes:
            return 0
        h = 0
        moved = 0
        while h < self.nkv:
            if hi[h] <= lo[h]:
                h += 1
                continue
            e = h + 1
            while e < self.nkv and lo[e] == lo[h] and hi[e] == hi[h]:
                e += 1
            a, b = int(lo[h]), int(hi[h])
            for name, (rshape, dt) in shapes.items():
                host = np.asarray(storage.array(name))
                rb = int(np.prod(rshape, dtype=np.int64)) * dt.itemsize
                if host.flags.c_contiguous:
                    # straight from the storage block: no host-side copy
                    hcap = host.shape[1]
                    src, horig, hp = host, (a * rb, h, 0), (hcap * rb, hcap * rb * host.shape[0])
                else:
                    src = np.ascontiguousarray(host[h:e, a:b])
                    horig, hp = (0, 0, 0), ((b - a) * rb, (b - a) * rb * (e - h))
                cl.enqueue_copy(
                    self.dev.queue, self.buffers[name], src,
                    buffer_origin=(a * rb, h, 0), host_origin=horig,
                    region=((b - a) * rb, e - h, 1),
                    buffer_pitches=(self.cap * rb, self.cap * rb * self.nkv),
                    host_pitches=hp,
                )
                self.bytes_uploaded += (b - a) * rb * (e - h)
            moved += (b - a) * (e - h)
            h = e
        self.rows_uploaded += moved
        return moved

    def exact_args(self):
        """``(xk, xv, xlen, xcap)`` for the attend launch (None when off)."""
        if not self.xcap:
            return None
        return self.xk, self.xv, self.xlen_buf, self.xcap

    def window_args(self):
        """``(thk, thv, b8, wcap)`` for the attend launch (None when off)."""
        if not self.wcap:
            return None
        return self.thk, self.thv, self.b8_buf, self.wcap

    @staticmethod
    def _window_layout(storage, nkv: int, hd: int):
        """``(wcap, thk, thv, b8)`` of the storage's q8 float16 windows; wcap 0
        when off (q4's tiers are not mirrored: the backend hands them to the
        reference kernels)."""
        wcap = 0 if storage.window is None else int(storage.window.size)
        mode = getattr(storage, "mode", None)
        thk, thv = _present(storage, "thk"), _present(storage, "thv")
        if wcap <= 0 or getattr(mode, "tiered", False) or (thk is None and thv is None):
            return 0, None, None, None
        for th in (thk, thv):
            if th is not None and (th.shape != (nkv, wcap, hd) or th.dtype != np.float16):
                raise ShapeError(f"kvreg-opencl: a float16 window is {th.dtype} {th.shape}, "
                                 f"expected float16 {(nkv, wcap, hd)}")
        return wcap, thk, thv, np.asarray(storage.window.b8, dtype=np.int64).reshape(nkv)

    def _upload_window(self, wcap: int, thk, thv, b8) -> None:
        cl = self.dev.cl
        if not wcap:
            self.wcap, self.thk, self.thv, self.b8_buf = 0, None, None, None
            return
        nbytes = self.nkv * wcap * self.hd * 2
        for attr, host in (("thk", thk), ("thv", thv)):
            if host is None:
                setattr(self, attr, None)
                continue
            buf = getattr(self, attr)
            if buf is None or buf.size != max(2, nbytes) or wcap != self.wcap:
                buf = cl.Buffer(self.dev.context, cl.mem_flags.READ_ONLY, max(2, nbytes))
                setattr(self, attr, buf)
            cl.enqueue_copy(self.dev.queue, buf, np.ascontiguousarray(host))  # binary16, as stored
            self.window_bytes_uploaded += nbytes
        b32 = np.ascontiguousarray(b8, dtype=np.int32)
        if self.b8_buf is None or self.b8_buf.size != max(4, b32.nbytes):
            self.b8_buf = cl.Buffer(self.dev.context, cl.mem_flags.READ_ONLY, max(4, b32.nbytes))
        cl.enqueue_copy(self.dev.queue, self.b8_buf, b32)
        self.window_bytes_uploaded += b32.nbytes
        self.wcap = wcap
        self.window_uploads += 1

    @staticmethod
    def _exact_layout(storage, nkv: int, hd: int):
        """``(xcap, xk, xv, xlen)`` of the storage's exact rows; xcap 0 when off."""
        xcap = 0 if storage.exact is None else int(storage.exact.cap)
        xk, xv = _present(storage, "xk"), _present(storage, "xv")
        if xcap <= 0 or (xk is None and xv is None):
            return 0, None, None, None
        for x in (xk, xv):
            if x is not None and x.shape != (nkv, xcap, hd):
                raise ShapeError(f"kvreg-opencl: exact rows are {x.shape}, expected {(nkv, xcap, hd)}")
        xlen = np.minimum(np.asarray(storage.exact.xlen, dtype=np.int64).reshape(nkv), xcap)
        return xcap, xk, xv, xlen

    def _upload_exact(self, xcap: int, xk, xv, xlen) -> None:
        cl = self.dev.cl
        if not xcap:
            self.xcap, self.xk, self.xv, self.xlen_buf = 0, None, None, None
            self.xlen = np.zeros(0, dtype=np.int64)
            return
        nbytes = self.nkv * xcap * self.hd * 4
        realloc = xcap != self.xcap or self.xlen_buf is None or self.xlen.shape[0] != self.nkv
        for attr, host in (("xk", xk), ("xv", xv)):
            if host is None:
                setattr(self, attr, None)
                continue
            host = np.ascontiguousarray(host, dtype=np.float32)
            buf = getattr(self, attr)
            if realloc or buf is None or buf.size != nbytes:
                buf = cl.Buffer(self.dev.context, cl.mem_flags.READ_ONLY, max(4, nbytes))
                setattr(self, attr, buf)
            cl.enqueue_copy(self.dev.queue, buf, host)
            self.exact_bytes_uploaded += nbytes
        xl32 = np.ascontiguousarray(xlen, dtype=np.int32)
        if realloc:
            self.xlen_buf = cl.Buffer(self.dev.context, cl.mem_flags.READ_ONLY, max(4, xl32.nbytes))
        cl.enqueue_copy(self.dev.queue, self.xlen_buf, xl32)
        self.exact_bytes_uploaded += xl32.nbytes
        self.xcap = xcap
        self.xlen = xlen.copy()
        self.exact_uploads += 1

    # -- the one entry point ----------------------------------------------
    def sync(self, kv) -> None:
        """Make the device hold the rows of ``kv`` (a :class:`kvreg.plugin.KvView`)."""
        self.syncs += 1
        mine = owns(self._owner, kv.owner)
        if mine and kv.version == self.version:
            return
        lens = np.asarray(kv.lens, dtype=np.int64)
        layout = self._layout(kv)
        if not layout:
            raise ShapeError("kvreg-opencl: storage has neither f32 nor q8 K/V arrays")
        nkv, hd = kv.num_kv_heads, kv.head_dim
        floor = kv.unchanged_rows(self.version) if mine else None
        full = floor is None or layout != self.row_shapes or nkv != self.nkv or hd != self.hd
        if not full:
            valid = np.minimum(self.lens, floor)
        need = int(lens.max(initial=0))
        xcap, xk, xv, xlen = self._exact_layout(kv, nkv, hd)
        # exact rows: re-upload on any change that may have touched them
        redo_exact = (
            full
            or xcap != self.xcap
            or (xcap and not np.array_equal(xlen, self.xlen))
            or (xk is None) != (self.xk is None)
            or (xv is None) != (self.xv is None)
            or (xcap and bool(np.any(floor < xlen)))
        )
        wcap, thk, thv, b8 = self._window_layout(kv, nkv, hd)
        # the int8 arrays of a windowed side hold rows [0, b8) only
        wnames = tuple(n for n, th in (("kq", thk), ("ks", thk), ("vq", thv), ("vs", thv))
                       if th is not None and n in layout)
        plain = tuple(n for n in layout if n not in wnames)
        b8 = lens if b8 is None else b8
        if full:
            self.row_shapes = layout
            self.nkv, self.hd = nkv, hd
            self.buffers = {}
            cap = max(config.MIRROR_MIN_ROWS, 1 << max(0, need - 1).bit_length())
            self._alloc(cap, None)
            self._upload_fields(kv)
            zero = np.zeros(nkv, dtype=np.int64)
            self._upload_rows(kv, zero, lens, plain)
            self._upload_rows(kv, zero, b8, wnames)
            self.full_reuploads += 1
        else:
            if need > self.cap:
                cap = self.cap
                while cap < need:
                    cap *= 2
                self._alloc(cap, valid)
            moved = self._upload_rows(kv, valid, lens, plain)
            if wnames:
                # rows that left the window since the last sync (and any the
                # valid bound says were rewritten) get their int8 form now
                wvalid = np.minimum(valid, self.b8) if self.b8.shape == valid.shape else np.zeros_like(valid)
                moved += self._upload_rows(kv, wvalid, b8, wnames)
            if moved:
                self.partial_uploads += 1
        if redo_exact:
            self._upload_exact(xcap, xk, xv, xlen)
        # the window (a few KiB) changes at every append: uploaded whole
        self._upload_window(wcap, thk, thv, b8)
        self.window_names = wnames
        self.b8 = np.array(b8, dtype=np.int64)
        self.version = kv.version
        if not mine:
            self._owner = owner_ref(kv.owner)
        self.lens = lens.copy()

    def counters(self) -> dict[str, int]:
        return {
            "bytes_uploaded": self.bytes_uploaded,
            "rows_uploaded": self.rows_uploaded,
            "full_reuploads": self.full_reuploads,
            "partial_uploads": self.partial_uploads,
            "syncs": self.syncs,
            "exact_uploads": self.exact_uploads,
            "exact_bytes_uploaded": self.exact_bytes_uploaded,
            "window_uploads": self.window_uploads,
            "window_bytes_uploaded": self.window_bytes_uploaded,
        }
