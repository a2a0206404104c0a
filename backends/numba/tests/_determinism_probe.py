"""Run by test_numba_determinism.py in a subprocess: prints, as JSON, the
SHA-256 of the bits of attend_layer (F32, q8, q8 with float16 windows, f16 and bf16, with importance, window,
soft-cap and sinks) and attend_chunk outputs at kvreg thread budgets 1 and 2
(capped by the process's NUMBA_NUM_THREADS).

``python _determinism_probe.py f32`` runs the F32 decode only, so a later
process compiles the q8 and chunk specializations fresh against callees
already in the on-disk cache (the state a first q8 run after install is in).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvreg  # noqa: E402
from kvreg import threads as kvreg_threads  # noqa: E402
from kvreg_numba import chunk, dispatch, quant  # noqa: E402

kvreg_threads.SMALL_WORK_BYTES = 0  # every call on the count asked for


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def inputs():
    rng = np.random.default_rng(7)
    nkv, hpk, hd, n = 4, 4, 128, 5000  # 3 decode blocks of 2048 rows
    k = rng.standard_normal((nkv, n, hd), dtype=np.float32)
    v = rng.standard_normal((nkv, n, hd), dtype=np.float32)
    q = rng.standard_normal((nkv * hpk, hd), dtype=np.float32)
    lens = np.array([n, n - 7, n - 1000, 3], np.int64)  # ragged heads
    nocol = np.empty((0, hd), np.float32)
    kq, ks = quant.quantize_rows(k.reshape(-1, hd), nocol, 32)
    vq, vs = quant.quantize_rows(v.reshape(-1, hd), nocol, hd)
    q8 = dict(kq=kq.reshape(nkv, n, hd), ks=ks.reshape(nkv, n, -1), vq=vq.reshape(nkv, n, hd),
              vs=vs.reshape(nkv, n), kcol=(1 + rng.random((nkv, hd))).astype(np.float32),
              kcol_set=np.ones(nkv, bool), vcol=(1 + rng.random((nkv, hd))).astype(np.float32),
              vcol_set=np.ones(nkv, bool))
    qc = rng.standard_normal((300, nkv * hpk, hd), dtype=np.float32)
    sinks = rng.standard_normal(nkv * hpk).astype(np.float32)
    return k, v, q, lens, q8, qc, sinks, hpk


def halves(k, v) -> dict:
    """The f16 and bf16 storage blocks of ``k``/``v``."""
    from kvreg.quant import to_bf16

    return {"f16": (k.astype(np.float16), v.astype(np.float16)), "bf16": (to_bf16(k), to_bf16(v))}


def run(which: str) -> dict:
    k, v, q, lens, q8, qc, sinks, hpk = inputs()
    n = k.shape[1]
    r = np.random.default_rng(11)
    smol = (r.standard_normal((4096, 9, 64), dtype=np.float32), r.standard_normal((3, 4096, 64), dtype=np.float32),
            r.standard_normal((3, 4096, 64), dtype=np.float32))
    b8 = np.maximum(lens - 8, 0)
    b8[3] = lens[3] - 2  # a window cut short
    q8w = dict(q8, thk=np.stack([k[g, b8[g]:b8[g] + 8] for g in range(4)]).astype(np.float16),
               thv=np.stack([v[g, b8[g]:b8[g] + 8] for g in range(4)]).astype(np.float16), b8=b8,
               xk=k[:, :1] * 0.5, xv=v[:, :1] * 0.5, xlen=np.ones(4, np.int64))
    res = {}
    for threads in (1, 2):
        kvreg.set_num_threads(threads)
        imp = np.zeros(n, np.float32)
        o1 = dispatch.attend_layer(q, lens, k=k, v=v, scale=0.088, imp=imp)
        o2 = dispatch.attend_layer(q, lens, k=k, v=v, scale=0.088, window=3000, softcap=30.0, sinks=sinks)
        res[f"f32 threads={threads}"] = digest(o1, imp, o2)
        if which == "f32":
            continue
        imp = np.zeros(n, np.float32)
        o1 = dispatch.attend_layer(q, lens, scale=0.088, imp=imp, **q8)
        o2 = dispatch.attend_layer(q, lens, scale=0.088, window=2500, softcap=20.0, sinks=sinks, **q8)
        res[f"q8 threads={threads}"] = digest(o1, imp, o2)
        # q8's float16 windows: each head's newest rows (7 of the short head)
        # read from thk/thv, the rest int8 (ragged bounds, one exact row)
        imp = np.zeros(n, np.float32)
        o1 = dispatch.attend_layer(q, lens, scale=0.088, imp=imp, **q8w)
        o2 = dispatch.attend_layer(q, lens, scale=0.088, window=2500, softcap=20.0, sinks=sinks, **q8w)
        res[f"q8w threads={threads}"] = digest(o1, imp, o2)
        for name, (kh, vh) in halves(k, v).items():  # the 2-byte blocks, read as stored
            imp = np.zeros(n, np.float32)
            o1 = dispatch.attend_layer(q, lens, k=kh, v=vh, scale=0.088, imp=imp)
            o2 = dispatch.attend_layer(q, lens, k=kh, v=vh, scale=0.088, window=3000, softcap=30.0, sinks=sinks)
            res[f"{name} threads={threads}"] = digest(o1, imp, o2)
        s0, b = 700, qc.shape[0]
        imp = np.zeros(s0 + b, np.float32)
        o1 = chunk.attend_chunk(qc, k[:, :s0 + b], v[:, :s0 + b], s0=s0, b=b, hpk=hpk, scale=0.088, imp=imp)
        o2 = chunk.attend_chunk(qc, k[:, :s0 + b], v[:, :s0 + b], s0=s0, b=b, hpk=hpk, scale=0.088, window=256)
        # SmolLM2's geometry (9/3 heads, hd 64): a 4k chunk whose score tiles
        # ([1536, 64] @ [64, keys]) OpenBLAS answered differently on 1 and 2
        # threads on a Zen 5, before the chunk held BLAS to one thread
        o3 = chunk.attend_chunk(*smol, s0=0, b=smol[0].shape[0], hpk=3, scale=0.125)
        res[f"chunk threads={threads}"] = digest(o1, imp, o2, o3)
    # call history: the same call again after others of other shapes
    kvreg.set_num_threads(2)
    dispatch.attend_layer(q[:8], lens[:2] // 2, k=k[:2], v=v[:2], scale=0.5)
    imp = np.zeros(n, np.float32)
    o1 = dispatch.attend_layer(q, lens, k=k, v=v, scale=0.088, imp=imp)
    o2 = dispatch.attend_layer(q, lens, k=k, v=v, scale=0.088, window=3000, softcap=30.0, sinks=sinks)
    res["f32 after other calls"] = digest(o1, imp, o2)
    return res


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "all")))
