"""The decode append of a q8 (q8k, q8v) storage whose float16 window is
full, in one call (:meth:`kvreg_numba.backend.NumbaBackend.store_window_row`):
the bits of :meth:`kvreg.storage.LayerStorage.append_window_row`, with the
window's rows widened by the decode kernels' own binary16 decode
(:func:`kvreg_numba.intrinsics.widen`) and quantized by :mod:`.quant`'s."""

from __future__ import annotations

import numpy as np
from numba import njit

from .decode import attend_groups
from .intrinsics import JIT_CACHE, widen
from .quant import fwht_rows, quant_row
from .store import half_bits


@njit(nogil=True, cache=JIT_CACHE)
def _within(x, bound):
    for i in range(x.shape[0]):
        for d in range(x.shape[1]):
            if not abs(x[i, d]) <= bound:   # NaN compares false
                return False
    return True


@njit(nogil=True, cache=JIT_CACHE)
def _window_side(x, th, q, s, group, row):
    # One quantized side of every head: the window's oldest row into the
    # integer slot (q [nkv, hd], s [nkv, groups]: the slot's rows), the
    # window moved up a row, x (stored basis) its newest.
    nkv, w, hd = th.shape
    for h in range(nkv):
        t = th[h]
        for d in range(hd):
            row[d] = widen(t[0, d])   # exact, as the decode reads the window
        quant_row(row, group, q[h], s[h])
        for i in range(w - 1):
            t[i] = t[i + 1]
        half_bits(x[h], t[w - 1])


@njit(nogil=True, cache=JIT_CACHE)
def window_row_step(k, v, rot_k, rot_v, thk, thv, kq, ks, vq, vs, kf, vf, lens, b8, imp, seq, exact_cap, kgroup,
                    bound):
    """The decode append of a q8 storage whose float16 window is full
    (:meth:`kvreg.storage.LayerStorage.append_window_row`'s bits in one
    call): ``k``/``v`` ``[nkv, hd]`` float32 as given; a side whose window
    ``thk``/``thv`` (int16 bits ``[nkv, w, hd]``) is empty is stored as
    float32 rows ``kf``/``vf`` instead. Returns False, having written
    nothing, when the storage is not in that state (heads at one count ``n
    >= exact_cap``, ``b8 == n - w`` on each) or a quantized side holds a
    value beyond ``bound`` (or NaN): the caller's other paths then take the
    row, or raise."""
    qk = thk.shape[2] > 0
    qv = thv.shape[2] > 0
    nkv, hd = k.shape
    at = lens[0]
    p = at - (thk.shape[1] if qk else thv.shape[1])
    if at < exact_cap:
        return False
    for h in range(nkv):
        if lens[h] != at or b8[h] != p:
            return False
    if (qk and not _within(k, bound)) or (qv and not _within(v, bound)):
        return False
    scale = np.float32(1.0 / np.sqrt(hd))
    kr = fwht_rows(k, scale) if rot_k else k
    vr = fwht_rows(v, scale) if rot_v else v
    row = np.empty(hd, np.float32)
    if qk:
        _window_side(kr, thk, kq[:, p], ks[:, p], kgroup, row)
    else:
        kf[:, at] = kr
    if qv:
        _window_side(vr, thv, vq[:, p], vs[:, p:p + 1], hd, row)
    else:
        vf[:, at] = vr
    for h in range(nkv):
        lens[h] = at + 1
        b8[h] = p + 1
    imp[seq] = 0.0
    return True


@njit(nogil=True, cache=JIT_CACHE)
def append_window_attend(k, v, rot_k, rot_v, thk, thv, kq, ks, vq, vs, kf, vf, lens, b8, imp_all, seq, exact_cap,
                         kgroup, bound, importance, q, hpk, gids, firsts, ns, akf, akq, aks, kcol, kcol_set, avf, avq,
                         avs, vcol, vcol_set, kquant, vquant, xk, xv, xlen, athk, athv, ab8, scale, softcap, sinks,
                         block, window, upto, imp, out, scratch, state, helpers):
    """A q8 (q8k, q8v) decode step in one dispatch: :func:`window_row_step`
    (the leading arguments), then :func:`kvreg_numba.decode.attend_groups`
    (the rest, ``imp`` unread) over the rows with it, the query and the
    answer through the Walsh-Hadamard transform of a rotated side, as
    ``LayerKvCache._rotated_attend`` does with ``rotate_rows``; importance
    into ``imp_all[:seq + 1]`` when ``importance``. Returns False, having
    written nothing, where ``window_row_step`` does."""
    if not window_row_step(k, v, rot_k, rot_v, thk, thv, kq, ks, vq, vs, kf, vf, lens, b8, imp_all, seq,
                           exact_cap, kgroup, bound):
        return False
    rs = np.float32(1.0 / np.sqrt(q.shape[1]))
    qr = fwht_rows(q, rs) if rot_k else q.copy()
    upto_imp = seq + 1 if importance else 0
    attend_groups(qr, hpk, gids, firsts, ns, akf, akq, aks, kcol, kcol_set, avf, avq, avs, vcol, vcol_set, kquant,
                  vquant, xk, xv, xlen, athk, athv, ab8, scale, softcap, sinks, block, window, upto,
                  imp_all[:upto_imp], out, scratch, state, helpers)
    if rot_v:
        out[:] = fwht_rows(out, rs)
    return True
