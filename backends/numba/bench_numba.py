"""Speed of kvreg-numba, as ratios measured in the same run (not a test).

    .venv/bin/python backends/numba/bench_numba.py [--rounds N] [--skip-compile]

Reports: streaming-read bandwidth (numba parallel sum over 512 MB); F32
decode of a 32 Q / 8 KV head, hd 128 layer at 16k rows in GB/s and as a
fraction of that bandwidth; the q8/F32 decode time ratio; a b=512 prefill
chunk after 8k rows (GQA 4) as a fraction of numpy float32 matmul FLOP/s;
a bounded ring step (8 KV / 32 Q heads, hd 128, window 4096, 4 sinks) and an
O(1) seal (32k rows, 8 groups, hd 128, m 64, w 1024, sink 4), each against
the NumPy reference in the same run;
first-call compile time and a warm-cache second process. Each figure is the
best of interleaved rounds (the machine is shared: best-of is the figure
least disturbed by neighbours).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

_COMPILE_SNIPPET = """
import time, numpy as np
t0 = time.perf_counter()
from kvreg_numba import chunk, dispatch, quant
nkv, hd = 2, 128
k = np.ones((nkv, 64, hd), np.float32); kq = np.ones((nkv, 64, hd), np.int8)
ks = np.ones((nkv, 64, 4), np.float32); vs = np.ones((nkv, 64), np.float32)
col = np.ones((nkv, hd), np.float32); cs = np.ones(nkv, bool); lens = np.full(nkv, 64)
q = np.ones((8, hd), np.float32); imp = np.zeros(64, np.float32)
dispatch.attend_layer(q, lens, k=k, v=k, scale=0.1, imp=imp)
dispatch.attend_layer(q, lens, kq=kq, ks=ks, kcol=col, kcol_set=cs, vq=kq, vs=vs, vcol=col, vcol_set=cs, scale=0.1)
quant.quantize_rows(k[0], col[:1], 32)
chunk.attend_chunk(np.ones((4, 8, hd), np.float32), k, k, s0=60, b=4, hpk=4, scale=0.1, imp=imp)
print(time.perf_counter() - t0)
"""


def compile_times() -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=str(HERE))

        def run():
            return float(subprocess.run([sys.executable, "-c", _COMPILE_SNIPPET], env=env, check=True,
                                        capture_output=True, text=True).stdout.split()[-1])

        return run(), run()


def seal_times(rounds: int) -> dict[str, float]:
    """Best ``o1_seal`` time per backend: 32k rows, 8 KV / 32 Q heads, hd 128,
    m 64, w 1024, sink 4 (building the layer is not timed)."""
    from kvreg_conformance.fill import filled_layer

    t, nkv, nh, hd = 32768, 8, 32, 128
    trace = np.random.default_rng(1).standard_normal((t, nh * hd), dtype=np.float32)
    best: dict[str, float] = {}
    for _ in range(max(rounds, 1)):
        for name in ("numba", "reference"):
            lay = filled_layer(t, nkv, hd, backend=name)
            lay.o1_begin(64, 1024, 4, far="nystrom")
            lay.o1_set_q_trace(trace)
            t0 = time.perf_counter()
            if not lay.o1_seal(nh):
                raise RuntimeError(f"seal failed on {name}: {lay.take_o1_error()}")
            best[name] = min(best.get(name, np.inf), time.perf_counter() - t0)
            del lay
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads (default: kvreg.get_num_threads(), i.e. KVREG_THREADS or the CPU affinity)")
    args = ap.parse_args()

    import numba

    if args.threads:
        import kvreg

        numba.set_num_threads(args.threads)
        kvreg.set_num_threads(args.threads)  # the kernels run on kvreg's budget

    from kvreg_numba import bandwidth, chunk, config, dispatch, quant

    rng = np.random.default_rng(0)
    nkv, nh, hd, n = 8, 32, 128, 16384
    k = rng.standard_normal((nkv, n, hd), dtype=np.float32)
    v = rng.standard_normal((nkv, n, hd), dtype=np.float32)
    q = rng.standard_normal((nh, hd), dtype=np.float32)
    lens = np.full(nkv, n)
    imp = np.zeros(n, np.float32)
    nocol = np.empty((0, hd), np.float32)
    kq, ks = quant.quantize_rows(k.reshape(-1, hd), nocol, 32)
    vq, vs = quant.quantize_rows(v.reshape(-1, hd), nocol, hd)
    kq, ks, vq, vs = kq.reshape(nkv, n, hd), ks.reshape(nkv, n, -1), vq.reshape(nkv, n, hd), vs.reshape(nkv, n)
    col = np.ones((nkv, hd), np.float32)
    cs = np.ones(nkv, bool)
    big = np.ones(config.BANDWIDTH_BYTES // 4, np.float32)  # 512 MB

    # prefill: b=512 after s0=8192, GQA 4 (32 Q / 8 KV heads)
    s0, b = 8192, 512
    kp = rng.standard_normal((nkv, s0 + b, hd), dtype=np.float32)
    vp = rng.standard_normal((nkv, s0 + b, hd), dtype=np.float32)
    qp = rng.standard_normal((b, nh, hd), dtype=np.float32)
    impp = np.zeros(s0 + b, np.float32)
    visible = sum(s0 + i + 1 for i in range(b))
    chunk_flop = 4.0 * hd * visible * nh  # QK^T and PV, causal keys only
    ma = rng.standard_normal((2048, 2048), dtype=np.float32)
    mb = rng.standard_normal((2048, 2048), dtype=np.float32)

    # bounded ring step: groups alternate windows 4096 / 1024, position 100k
    from kvreg.bounded import BoundedRope, ring_view
    from kvreg.reference import ReferenceBackend
    from kvreg_numba.backend import NumbaBackend

    nb, ref = NumbaBackend(), ReferenceBackend()
    W, sink = 4096, 4
    ring = ring_view(rng.standard_normal((nkv, W, hd), dtype=np.float32),
                     rng.standard_normal((nkv, W, hd), dtype=np.float32), 100_003,
                     rng.standard_normal((nkv, sink, hd), dtype=np.float32),
                     rng.standard_normal((nkv, sink, hd), dtype=np.float32),
                     [W, 1024] * (nkv // 2), BoundedRope())

    cases = {
        "bandwidth": lambda: bandwidth._parallel_sum(big),
        "decode_f32": lambda: dispatch.attend_layer(q, lens, k=k, v=v, scale=0.088, imp=imp),
        "decode_q8": lambda: dispatch.attend_layer(q, lens, kq=kq, ks=ks, kcol=col, kcol_set=cs, vq=vq, vs=vs,
                                            vcol=col, vcol_set=cs, scale=0.088, imp=imp),
        "matmul": lambda: ma @ mb,
        "chunk": lambda: chunk.attend_chunk(qp, kp, vp, s0=s0, b=b, hpk=4, scale=0.088, imp=impp),
        "bounded": lambda: nb.bounded_attend(q, ring, scale=hd ** -0.5, num_heads=nh),
        "bounded_ref": lambda: ref.bounded_attend(q, ring, scale=hd ** -0.5, num_heads=nh),
    }
    best = {}
    for f in cases.values():
        f()
    # Short cases repeat within a round: on a shared machine the best of many
    # ~5 ms runs is the one a neighbour did not interrupt.
    repeat = {"bandwidth": 3, "decode_f32": 5, "decode_q8": 5, "matmul": 2, "chunk": 1,
              "bounded": 5, "bounded_ref": 1}
    for _ in range(args.rounds):
        for name, f in cases.items():
            for _ in range(repeat[name]):
                t0 = time.perf_counter()
                f()
                dt = time.perf_counter() - t0
                best[name] = min(best.get(name, dt), dt)

    bw = big.nbytes / best["bandwidth"] / 1e9
    f32_gbs = (k.nbytes + v.nbytes) / best["decode_f32"] / 1e9
    mm = 2.0 * 2048**3 / best["matmul"] / 1e9
    ch = chunk_flop / best["chunk"] / 1e9
    import kvreg

    nthreads = min(kvreg.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    print(f"threads                      {nthreads} ({numba.threading_layer()}; kvreg.get_num_threads())")
    print(f"stream read bandwidth        {bw:7.1f} GB/s")
    print(f"decode F32 16k 32/8 hd128    {best['decode_f32'] * 1e3:7.2f} ms  {f32_gbs:6.1f} GB/s  "
          f"= {f32_gbs / bw:.2f} of bandwidth (target >= 0.85)")
    print(f"decode q8  16k 32/8 hd128    {best['decode_q8'] * 1e3:7.2f} ms  q8/F32 time = "
          f"{best['decode_q8'] / best['decode_f32']:.2f} (target <= 0.35)")
    print(f"numpy f32 matmul 2048^3      {mm:7.1f} GFLOP/s")
    print(f"prefill b=512 after 8k GQA4  {best['chunk'] * 1e3:7.1f} ms  {ch:6.1f} GFLOP/s  "
          f"= {ch / mm:.2f} of matmul (target >= 0.40)")
    print(f"bounded step W4096 32/8 hd128 {best['bounded'] * 1e3:7.2f} ms  reference "
          f"{best['bounded_ref'] * 1e3:.2f} ms = {best['bounded_ref'] / best['bounded']:.1f}x")
    seal = seal_times(min(args.rounds, 3))
    print(f"o1 seal 32k rows 8 groups    {seal['numba']:7.2f} s   reference {seal['reference']:.2f} s "
          f"= {seal['reference'] / seal['numba']:.2f}x (target < 2 s)")
    if not args.skip_compile:
        first, second = compile_times()
        print(f"first call, cold cache       {first:7.2f} s (import + compile every kernel)")
        print(f"second process, warm cache   {second:7.2f} s")


if __name__ == "__main__":
    main()
