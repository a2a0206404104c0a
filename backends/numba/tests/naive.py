"""Slow, obvious float64 oracles (loops) for the Numba kernels."""

import numpy as np


def attend_oracle(q, k, v, *, scale, first, n, softcap=0.0, sinks=None):
    """(out [nh, hd], probs [nh, n-first]) of one KV head's rows ``k, v`` (f64)."""
    q = np.asarray(q, np.float64)
    nh = q.shape[0]
    out = np.zeros((nh, k.shape[1]))
    probs = np.zeros((nh, n - first))
    if n == 0:
        return out, probs
    for h in range(nh):
        s = np.array([scale * float(q[h] @ k[p]) for p in range(first, n)])
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        m = s.max() if sinks is None else max(s.max(), sinks[h])
        e = np.exp(s - m)
        z = e.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
        probs[h] = e / z
        out[h] = probs[h] @ v[first:n]
    return out, probs


def dequant_k(kq, ks, kcol):
    hd = kq.shape[-1]
    idx = np.arange(hd) // 32
    return kq.astype(np.float64) * ks[..., idx].astype(np.float64) * kcol.astype(np.float64)


def dequant_v(vq, vs, vcol):
    return vq.astype(np.float64) * vs[..., None].astype(np.float64) * vcol.astype(np.float64)


def round_half_away(x):
    t = np.trunc(x)
    f = x - t
    return (t + np.where(f >= 0.5, 1.0, 0.0) - np.where(f <= -0.5, 1.0, 0.0)).astype(np.float32)


def quantize_oracle(x, col, group):
    """The contract row by row in float32 numpy: NaN ignored by the group's
    absmax (Rust's f32::max), NaN -> 0, ties away from zero, clamp 127."""
    x = np.asarray(x, np.float32)
    n, hd = x.shape
    ng = -(-hd // group)
    q = np.zeros((n, hd), np.int8)
    s = np.zeros((n, ng), np.float32)
    with np.errstate(all="ignore"):
        for i in range(n):
            r = x[i] / col[i if col.shape[0] > 1 else 0] if col is not None else x[i].copy()
            for j in range(ng):
                rg = r[j * group:(j + 1) * group]
                a = np.abs(rg)
                amax = np.float32(a[~np.isnan(a)].max()) if (~np.isnan(a)).any() else np.float32(0)
                sc = max(np.float32(amax / np.float32(127)), np.float32(1e-12))
                s[i, j] = sc
                qq = round_half_away(rg / np.float32(sc))
                qq = np.clip(qq, -127, 127)
                qq[np.isnan(qq)] = 0
                q[i, j * group:(j + 1) * group] = qq.astype(np.int8)
    return q, s
