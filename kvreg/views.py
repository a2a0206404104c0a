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

import numpy as np

from .modes import KV_K_GROUP, Q4_INT8_GROUP, Q4_K_GROUP, Q4_V_GROUP
from .quant import dequantize_half_scaled, dequantize_rows, from_half, unpack_int4

_NO_FLOOR = np.iinfo(np.int64).max


def readonly(a: np.ndarray | None) -> np.ndarray | None:
    """A read-only view of ``a`` (None stays None)."""
    if a is None:
        return None
    v = a.view()
    v.flags.writeable = False
    return v


#: The row and field arrays of a :class:`KvView` (None where the mode has
#: none): read-only views of the storage's own.
KV_ARRAYS = ("k", "v", "kq", "ks", "vq", "vs", "kcol", "vcol", "xk", "xv", "thk", "thv", "k4", "k4s", "v4",
             "v4s", "t8k", "t8ks", "t8v", "t8vs")
#: The per-head counts and flags of a :class:`KvView`: copies taken at its version.
KV_COUNTS = ("lens", "xlen", "b8", "b4", "kcol_set", "vcol_set")
#: Every field of a :class:`KvView`, in order.
KV_FIELDS = ("owner", "mode", "num_kv_heads", "head_dim", "ngk", "cap", "exact_cap", "window", "rot_k",
             "rot_v") + KV_ARRAYS + KV_COUNTS + ("version", "reset_version", "log_start", "floors")


class KvView(namedtuple("_KvViewFields", KV_FIELDS)):
    """One layer's rows at one ``version``, read-only (layout: docs/kernels.md).

    Head ``h`` holds ``lens[h]`` rows. Which blocks are present depends on
    ``mode`` (absent ones are None):

    * unquantized side: ``k``/``v [nkv, cap, hd]`` in ``mode.float_dtype``
      (float32, float16, or bfloat16 as uint16 bits);
    * q8 side: ``kq [nkv, cap, hd]`` int8 with ``ks [nkv, cap, ngk]`` float32
      scales (``KV_K_GROUP`` channels each), ``vq`` with ``vs [nkv, cap]``;
      a 2f field ``kcol``/``vcol [nkv, hd]`` applies where ``kcol_set[h]``;
    * exact rows: ``xk``/``xv [nkv, exact_cap, hd]`` float32 in field space,
      rows ``[0, xlen[h])`` of head ``h`` are read there;
    * float16 window (``window > 0``): rows ``[b8[h], lens[h])`` of a
      quantized side are ``thk``/``thv [nkv, window, hd]`` (oldest first),
      not the integer blocks;
    * q4 (``mode.tiered``): int4 ``k4``/``v4`` with ``k4s``/``v4s`` below
      ``b4[h]``, the int8 tier ``t8k``/``t8v`` (``t8ks``/``t8vs``) over
      ``[b4, b8)``, the window above. Read rows with :meth:`attended_rows`.

    Rows of a side with ``rot_k``/``rot_v`` are in the Walsh–Hadamard
    rotated basis (the layer rotates queries and un-rotates outputs).
    """

    # A named tuple: immutable, and built in about a microsecond per version
    # (a decode step builds one per layer). ``owner`` is the storage's
    # identity (a device mirror's key; not for reading). The change log
    # behind :meth:`unchanged_rows`: ``reset_version`` the version of the last
    # rewrite of every row, ``log_start`` the version up to which truncation
    # records were dropped, ``floors`` ``(version, lens)`` per truncation.
    __slots__ = ()

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
        float32 ``[n-lo, hd]``: unquantized rows widened (f32: a view), q8
        ``q·s·col`` with the window rows widened and the exact rows ``x·col``,
        q4 each row from its tier. ``side`` is ``"k"`` or ``"v"``."""
        if self.mode.tiered:
            return self._tiered_rows(side, h, lo, n)
        quantized = self.mode.quant_k if side == "k" else self.mode.quant_v
        if not quantized:
            return from_half((self.k if side == "k" else self.v)[h, lo:n])
        if side == "k":
            rows = dequantize_rows(self.kq[h, lo:n], self.ks[h, lo:n], KV_K_GROUP)
        else:
            rows = dequantize_rows(self.vq[h, lo:n], self.vs[h, lo:n, None], self.head_dim)
        if self.window:
            b8 = int(self.b8[h])
            w0 = max(lo, b8)
            if n > w0:
                th = self.thk if side == "k" else self.thv
                rows[w0 - lo:] = th[h, w0 - b8:n - b8]
        x = self.xk if side == "k" else self.xv
        xl = int(self.xlen[h])
        if lo < xl:
            rows[: xl - lo] = x[h, lo:xl]
        col, col_set = (self.kcol, self.kcol_set) if side == "k" else (self.vcol, self.vcol_set)
        return rows * col[h] if col_set[h] else rows

    def _tiered_rows(self, side: str, h: int, lo: int, n: int) -> np.ndarray:
        hd = self.head_dim
        b4, b8 = int(self.b4[h]), int(self.b8[h])
        out = np.empty((max(n - lo, 0), hd), np.float32)
        z = min(b4, n)
        if z > lo:
            codes = unpack_int4((self.k4 if side == "k" else self.v4)[h, lo:z], hd)
            scales = (self.k4s if side == "k" else self.v4s)[h, lo:z]
            out[: z - lo] = dequantize_half_scaled(codes, scales, Q4_K_GROUP if side == "k" else Q4_V_GROUP)
        a0, z = max(lo, b4), min(b8, n)
        if z > a0:
            t8, t8s = (self.t8k, self.t8ks) if side == "k" else (self.t8v, self.t8vs)
            o = a0 - b4
            out[a0 - lo: z - lo] = dequantize_half_scaled(t8[h, o:o + z - a0], t8s[h, o:o + z - a0], Q4_INT8_GROUP)
        a0 = max(lo, b8)
        if n > a0:
            th = self.thk if side == "k" else self.thv
            out[a0 - lo:] = th[h, a0 - b8:n - b8].astype(np.float32)
        xl = min(int(self.xlen[h]), n)
        if lo < xl:
            out[: xl - lo] = (self.xk if side == "k" else self.xv)[h, lo:xl]
        return out


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


