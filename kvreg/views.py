"""What kernels read: frozen, read-only views of a layer's rows
(:class:`KvView`) and of a bounded layer's ring (:class:`RingView`).

Views are snapshots at one ``version``, which moves on every mutation of
what they describe, so a device mirror keyed on ``version`` alone is never
stale. Counts (lengths, window bounds, flags) are copies taken at that
version; row arrays are read-only views of the owner's (rows a later
mutation rewrites are rows the view's counts no longer vouch for, and a
view is meant for the call it is handed to).
"""

from __future__ import annotations

from collections import namedtuple
from typing import NamedTuple

import numpy as np

from .modes import KV_K_GROUP, Q2_GROUP, Q2_V_GROUP, Q4_INT8_GROUP, Q4_K_GROUP, Q4_V_GROUP
from .quant import dequantize_half_scaled, dequantize_int2, dequantize_rows, from_half, unpack_int2, unpack_int4

_NO_FLOOR = np.iinfo(np.int64).max


def readonly(a: np.ndarray | None) -> np.ndarray | None:
    """A read-only view of ``a`` (None stays None)."""
    if a is None:
        return None
    v = a.view()
    v.flags.writeable = False
    return v


class DenseRows(NamedTuple):
    """Float rows: ``k``/``v [nkv, cap, hd]`` in ``mode.float_dtype``
    (float32, float16, or bfloat16 as uint16 bits); None for a side the mode
    quantizes."""

    k: np.ndarray | None
    v: np.ndarray | None


class Q8Rows(NamedTuple):
    """The int8 side(s) of a q8 mode: ``kq [nkv, cap, hd]`` int8 with ``ks
    [nkv, cap, ngk]`` float32 scales (``KV_K_GROUP`` channels each), ``vq``
    with ``vs [nkv, cap]`` (None for a float side); the seed's 2f field
    ``kcol``/``vcol [nkv, hd]`` applies to head ``h`` where ``kcol_set[h]``
    (``vcol_set[h]``)."""

    kq: np.ndarray | None
    ks: np.ndarray | None
    vq: np.ndarray | None
    vs: np.ndarray | None
    kcol: np.ndarray
    vcol: np.ndarray
    kcol_set: np.ndarray
    vcol_set: np.ndarray
    ngk: int


class ExactRows(NamedTuple):
    """Each head's first rows also held in float32 (q8, q4): ``xk``/``xv
    [nkv, cap, hd]`` in field space (None for a float side); rows ``[0,
    xlen[h])`` of head ``h`` are read there."""

    xk: np.ndarray | None
    xv: np.ndarray | None
    xlen: np.ndarray
    cap: int


class WindowRows(NamedTuple):
    """The float16 window of a quantized side (q8, q8k, q8v, q4): rows
    ``[b8[h], lens[h])`` of head ``h`` are ``thk``/``thv [nkv, size, hd]``
    (oldest first; None for a float side), not the integer blocks."""

    thk: np.ndarray | None
    thv: np.ndarray | None
    b8: np.ndarray
    size: int


class TierRows(NamedTuple):
    """q4's older tiers: int4 ``k4``/``v4 [nkv, cap, ceil(hd/2)]`` with
    float16 ``k4s``/``v4s`` below ``b4[h]``; the int8 tier ``t8k``/``t8v
    [nkv, rows, hd]`` (``t8ks``/``t8vs``) over ``[b4[h], b8[h])``, oldest
    first; the window above."""

    k4: np.ndarray
    k4s: np.ndarray
    v4: np.ndarray
    v4s: np.ndarray
    b4: np.ndarray
    t8k: np.ndarray
    t8ks: np.ndarray
    t8v: np.ndarray
    t8vs: np.ndarray


class KiviRows(NamedTuple):
    """q2's 2-bit rows, below the window's ``b8[h]`` (a multiple of
    :data:`~kvreg.modes.Q2_GROUP`): codes ``k2``/``v2 [nkv, cap,
    ceil(hd/4)]`` uint8 (four per byte, :func:`~kvreg.quant.pack_int2`),
    value ``zero + code · scale``. V: ``v2s``/``v2z [nkv, cap, ceil(hd/32)]``
    float16 per row and 32 channels. K: one scale and zero per channel per
    block of G rows, striped over the block's rows so they stay per-row
    arrays: ``k2s``/``k2z [nkv, cap, c]`` (``c = ceil(hd/G)``), row ``r`` of
    a block holding channels ``[(r % G)·c, (r % G + 1)·c)``."""

    k2: np.ndarray
    k2s: np.ndarray
    k2z: np.ndarray
    v2: np.ndarray
    v2s: np.ndarray
    v2z: np.ndarray


#: Where each array a storage holds sits in a :class:`KvView`: ``name:
#: (group, field)``. The ``tiers`` group is a :class:`TierRows` (q4) or a
#: :class:`KiviRows` (q2): a name its type lacks reads as None.
PLACES = {name: (group, name) for group, cls in (("dense", DenseRows), ("q8", Q8Rows), ("window", WindowRows),
                                                  ("tiers", TierRows), ("tiers", KiviRows))
          for name in cls._fields if name != "ngk"}
PLACES.update(xk=("exact", "xk"), xv=("exact", "xv"), xlen=("exact", "xlen"))
del PLACES["size"]

class KvView(namedtuple("_KvViewFields", ("owner", "mode", "num_kv_heads", "head_dim", "cap", "lens", "rot_k",
                                          "rot_v", "dense", "q8", "exact", "window", "tiers", "version",
                                          "reset_version", "log_start", "floors"))):
    """One layer's rows at one ``version``, read-only (layout: docs/kernels.md).

    Head ``h`` holds ``lens[h]`` rows. The rows come in groups, one per kind
    of storage, each None where the mode has none: ``dense``
    (:class:`DenseRows`: the float sides; always there), ``q8``
    (:class:`Q8Rows`), ``exact`` (:class:`ExactRows`), ``window``
    (:class:`WindowRows`) and ``tiers`` (:class:`TierRows` for q4,
    :class:`KiviRows` for q2). Read a head's rows as the kernels answer
    with them with :meth:`attended_rows`.
    Rows of a side with ``rot_k``/``rot_v`` are in the Walsh-Hadamard rotated
    basis (the layer rotates queries and un-rotates outputs).
    """

    # A named tuple: immutable, and built in about a microsecond per version
    # (a decode step builds one per layer). ``owner`` is the storage's
    # identity (a device mirror's key; not for reading). The change log
    # behind :meth:`unchanged_rows`: ``reset_version`` the version of the last
    # rewrite of every row, ``log_start`` the version up to which truncation
    # records were dropped, ``floors`` ``(version, lens)`` per truncation.
    __slots__ = ()

    def array(self, name: str) -> np.ndarray | None:
        """The array a storage calls ``name`` (``"kq"``, ``"xlen"``, ``"b8"``,
        ...: :data:`PLACES`), read from its group; None where the mode has
        none. For code that walks a view's arrays by name (a device mirror)."""
        group, field = PLACES[name]
        return getattr(getattr(self, group), field, None)

    def unchanged_rows(self, since: int | None) -> np.ndarray | None:
        """Per head, how many leading rows are the same bits as at version
        ``since`` (a device mirror re-uploads from there): None when
        everything may have changed (``since`` is None or older than the last
        rewrite, or the truncation log no longer reaches back), else an
        int64 ``[nkv]`` floor (``INT64_MAX`` where only appends happened —
        the caller takes the minimum with the rows it holds). Under a window
        the integer rows below the ``b8`` the caller saw are covered too."""
        if since is None or since < max(self.reset_version, self.log_start):
            return None
        floor = np.full(self.num_kv_heads, _NO_FLOOR, np.int64)
        for ver, lens in self.floors:
            if ver > since:
                np.minimum(floor, lens, out=floor)
        return floor

    def attended_rows(self, side: str, h: int, lo: int, n: int) -> np.ndarray:
        """Rows ``[lo, n)`` of head ``h`` as the kernels answer with them,
        float32 ``[n-lo, hd]``: float rows widened (f32: a view), q8
        ``q·s·col`` with the window rows widened and the exact rows ``x·col``,
        q4 and q2 each row from its tier. ``side`` is ``"k"`` or ``"v"``."""
        if self.tiers is not None:
            if type(self.tiers) is KiviRows:
                return self._kivi_rows(side, h, lo, n)
            return self._tiered_rows(side, h, lo, n)
        quantized = self.mode.quant_k if side == "k" else self.mode.quant_v
        if not quantized:
            return from_half(getattr(self.dense, side)[h, lo:n])
        q8 = self.q8
        if side == "k":
            rows = dequantize_rows(q8.kq[h, lo:n], q8.ks[h, lo:n], KV_K_GROUP)
        else:
            rows = dequantize_rows(q8.vq[h, lo:n], q8.vs[h, lo:n, None], self.head_dim)
        w = self.window
        if w is not None:
            b8 = int(w.b8[h])
            w0 = max(lo, b8)
            if n > w0:
                rows[w0 - lo:] = getattr(w, "th" + side)[h, w0 - b8:n - b8]
        x = self.exact
        if x is not None:
            xl = int(x.xlen[h])
            if lo < xl:
                rows[: xl - lo] = getattr(x, "x" + side)[h, lo:xl]
        col, col_set = (q8.kcol, q8.kcol_set) if side == "k" else (q8.vcol, q8.vcol_set)
        return rows * col[h] if col_set[h] else rows

    def _tiered_rows(self, side: str, h: int, lo: int, n: int) -> np.ndarray:
        hd, t, w, x = self.head_dim, self.tiers, self.window, self.exact
        b4, b8 = int(t.b4[h]), int(w.b8[h])
        out = np.empty((max(n - lo, 0), hd), np.float32)
        z = min(b4, n)
        if z > lo:
            codes = unpack_int4((t.k4 if side == "k" else t.v4)[h, lo:z], hd)
            scales = (t.k4s if side == "k" else t.v4s)[h, lo:z]
            out[: z - lo] = dequantize_half_scaled(codes, scales, Q4_K_GROUP if side == "k" else Q4_V_GROUP)
        a0, z = max(lo, b4), min(b8, n)
        if z > a0:
            t8, t8s = (t.t8k, t.t8ks) if side == "k" else (t.t8v, t.t8vs)
            o = a0 - b4
            out[a0 - lo: z - lo] = dequantize_half_scaled(t8[h, o:o + z - a0], t8s[h, o:o + z - a0], Q4_INT8_GROUP)
        a0 = max(lo, b8)
        if n > a0:
            out[a0 - lo:] = getattr(w, "th" + side)[h, a0 - b8:n - b8].astype(np.float32)
        xl = min(int(x.xlen[h]), n)
        if lo < xl:
            out[: xl - lo] = getattr(x, "x" + side)[h, lo:xl]
        return out

    def _kivi_rows(self, side: str, h: int, lo: int, n: int) -> np.ndarray:
        hd, t, w, x = self.head_dim, self.tiers, self.window, self.exact
        b8 = int(w.b8[h])
        out = np.empty((max(n - lo, 0), hd), np.float32)
        z = min(b8, n)
        if z > lo:
            if side == "v":
                out[: z - lo] = dequantize_int2(unpack_int2(t.v2[h, lo:z], hd), t.v2s[h, lo:z], t.v2z[h, lo:z],
                                                Q2_V_GROUP)
            else:
                out[: z - lo] = kivi_keys(t.k2[h], t.k2s[h], t.k2z[h], lo, z, hd)
        a0 = max(lo, b8)
        if n > a0:
            out[a0 - lo:] = w.thk[h, a0 - b8:n - b8] if side == "k" else w.thv[h, a0 - b8:n - b8]
        xl = min(int(x.xlen[h]), n)
        if lo < xl:
            out[: xl - lo] = getattr(x, "x" + side)[h, lo:xl]
        return out


#: Every field of a :class:`KvView`, in order.
KV_FIELDS = KvView._fields


def kivi_block_stats(stripes: np.ndarray, hd: int) -> np.ndarray:
    """Per-channel statistics of whole q2 K blocks from their stripes
    ``[nb·G, c]`` (:class:`KiviRows`): ``[nb, hd]``."""
    nb = stripes.shape[0] // Q2_GROUP
    return stripes.reshape(nb, -1)[:, :hd]


def kivi_keys(k2: np.ndarray, k2s: np.ndarray, k2z: np.ndarray, lo: int, z: int, hd: int) -> np.ndarray:
    """One head's 2-bit K rows ``[lo, z)`` (all below its window) as float32
    ``[z-lo, hd]``: each row with its block's per-channel scale and zero,
    the arithmetic of :func:`~kvreg.quant.dequantize_int2`."""
    b0, b1 = lo // Q2_GROUP, -(-z // Q2_GROUP)
    s = kivi_block_stats(k2s[b0 * Q2_GROUP:b1 * Q2_GROUP], hd).astype(np.float32)
    zero = kivi_block_stats(k2z[b0 * Q2_GROUP:b1 * Q2_GROUP], hd).astype(np.float32)
    blk = np.arange(lo, z) // Q2_GROUP - b0
    return zero[blk] + unpack_int2(k2[lo:z], hd).astype(np.float32) * s[blk]


class DecodeSlot(KvView):
    """What a fused decode step writes (:meth:`kvreg.plugin.Backend.append_attend_layer`):
    a :class:`KvView`'s fields, but its arrays are the storage's own,
    writable, and its counts (``lens``, ``window.b8``) live, so the step
    stores its row and counts it where the storage reads them. A step writes
    nothing else of the storage."""

    __slots__ = ()


class RingView(namedtuple("_RingViewFields", ("k", "v", "seen", "sink_k", "sink_v", "group_windows", "rope",
                                               "owner", "version", "reset_version"))):
    """A bounded layer's ring at one ``version``, with what attending it needs.

    ``k``/``v [kvh, window, hd]`` float32 raw (un-rotated) rows, token ``t``
    in slot ``t % window``; ``seen`` tokens inserted; ``sink_k``/``sink_v
    [kvh, sink, hd]`` position-free sink rows; ``group_windows [kvh]`` int64
    (each group reads its newest ``min(len, w_g)`` rows); ``rope`` the
    rotation. ``version`` moves on every mutation of the ring;
    ``reset_version`` is the version of the last one that was not an insert
    (rollback, restore, load, clear): a mirror at version ``u >=
    reset_version`` that saw ``seen_u`` is current after uploading the slots
    of positions ``[seen_u, seen)``.
    """
    __slots__ = ()


