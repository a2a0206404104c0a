"""Which rows an eviction keeps: each policy answers with the ascending
row indices to keep, and the layer's storage gathers them."""

from __future__ import annotations

import numpy as np


def born_keep(imp: np.ndarray, keep_last: int, sink: int, recent: int) -> np.ndarray | None:
    """The seed's mass-based eviction: the ``sink`` earliest rows, the
    ``recent`` latest, and the rest of ``keep_last`` by accumulated
    attention mass ``imp`` (ties: the earlier row; NaN mass ranks last).
    None when every row fits."""
    stored = imp.shape[0]
    if stored <= keep_last:
        return None
    sink_n = min(sink, keep_last)
    recent_n = min(recent, keep_last - sink_n)
    keep = np.zeros(stored, dtype=bool)
    keep[:sink_n] = True
    if recent_n:
        keep[stored - recent_n:] = True
    budget = keep_last - int(keep.sum())
    if budget > 0:
        rest = np.flatnonzero(~keep)
        mass = np.nan_to_num(imp[rest].astype(np.float64), nan=-np.inf)
        order = rest[np.argsort(-mass, kind="stable")]
        keep[order[:budget]] = True
    return np.flatnonzero(keep)


def window_cut(pos_len: int, base: int, keep: int, align: int, anchor: int | None) -> int:
    """How many front rows a sliding-window trim drops: down to ``keep`` rows
    (``w + slack``), the new base rounded DOWN to a multiple of ``align`` and
    never past ``anchor - keep`` (None = no anchor); 0 when the base would
    not move."""
    keep_from = max(pos_len - keep, 0)
    if anchor is not None:
        keep_from = min(keep_from, max(anchor - keep, 0))
    new_base = keep_from // max(align, 1) * max(align, 1)
    return max(new_base - base, 0)


def sliding_slack(window: int) -> int:
    """Rows a drop-in sliding layer may hold beyond ``window - 1`` before it
    is trimmed: ``window // 32``, so it holds about 3% more than
    ``DynamicCache``'s and the trim's copy costs about 32 rows per token."""
    return max(1, window // 32)


def sliding_trim(rows: int, window: int, align: int = 1) -> int:
    """How many front rows a drop-in sliding layer holding ``rows`` drops
    after a step: none within ``window - 1 + sliding_slack(window)``, then
    the most whole multiples of ``align`` (a blocked mode's block, so a trim
    requantizes nothing) that leave at least ``window - 1``."""
    if rows <= window - 1 + sliding_slack(window):
        return 0
    return (rows - (window - 1)) // align * align


def observed_mass(q: np.ndarray, k: np.ndarray, scale: float, pool: int = 1) -> np.ndarray:
    """SnapKV's score of each stored row, per KV group: the attention
    probabilities that the prompt's last ``n`` queries ``q [n, nh, hd]``
    (those of the last ``n`` of the ``t`` rows, each reading the rows up to
    its own, causally) give the rows ``k [nkv, t, hd]``, summed over the
    queries and each group's heads; with ``pool`` (odd), a row scores at
    least the average of the ``pool`` rows around it (SnapKV's pooling: the
    neighbours of a heavy row are kept with it, the row itself first). The
    unit is the layer's importance (probabilities summed over queries and
    heads), so decode mass adds to it. Returns float32 ``[nkv, t]``."""
    n, nh, hd = q.shape
    nkv, t, _ = k.shape
    qg = q.astype(np.float64).reshape(n, nkv, nh // nkv, hd).transpose(1, 2, 0, 3)    # [nkv, hpk, n, hd]
    s = np.matmul(qg, k.astype(np.float64).transpose(0, 2, 1)[:, None]) * float(scale)  # [nkv, hpk, n, t]
    causal = np.arange(t)[None, :] > (t - n + np.arange(n))[:, None]
    s[..., causal] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    mass = p.sum(axis=(1, 2))
    if pool > 1:
        half = pool // 2
        padded = np.pad(mass, ((0, 0), (half, half)), mode="edge")
        csum = np.concatenate([np.zeros((nkv, 1)), np.cumsum(padded, axis=1)], axis=1)
        mass = np.maximum(mass, (csum[:, pool:] - csum[:, :-pool]) / pool)
    return mass.astype(np.float32)
