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
