"""Decode-attend benchmark of kvreg-opencl (not a test).

    KVREG_DEVICE=0:0 python backends/opencl/bench_opencl.py [--rows 1024,4096,16384] [--mode f32|q8]
    KVREG_DEVICE=0:0 python backends/opencl/bench_opencl.py --mode bounded [--window 4096]

32 Q heads / 8 KV heads, hd 128, one whole-layer attend per call on
device-resident rows (the mirror is synced once; a decode step re-uses it).
Prints ms per call and the effective K+V read bandwidth, and the same call
on kvreg-numba's CPU kernel when that package is importable (the ratio is
the claim: both measured in the same run, same data).

``--mode bounded``: one bounded decode step per call (insert a row into a
full ring of ``--window`` slots, then ``bounded_attend`` with 4 sinks), the
OpenCL backend against the NumPy reference (and kvreg-numba when
importable), each on its own copy of the same ring so every OpenCL call is a
one-slot mirror update.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvreg.modes import KvMode
from kvreg.storage import make_storage
from kvreg_opencl import config, device

NQ, NKV, HD = 32, 8, 128


def random_view(rows: int, mode: str, seed: int = 0):
    """The view of a real layer storage holding ``rows`` random rows per
    head: float32 (``f32``), or int8 codes with random scales in the q8
    layout without a float16 window or a frozen field (``q8``: the
    ``q8_2f`` storage below its freeze, whatever the row count)."""
    rng = np.random.default_rng(seed)
    if mode == "f32":
        st = make_storage(NKV, HD, KvMode.F32)
        blocks = {"k": rng.standard_normal((NKV, rows, HD), dtype=np.float32),
                  "v": rng.standard_normal((NKV, rows, HD), dtype=np.float32)}
    else:
        st = make_storage(NKV, HD, KvMode.Q8_2F)
        blocks = {"kq": rng.integers(-127, 128, (NKV, rows, HD), dtype=np.int8),
                  "ks": rng.random((NKV, rows, HD // 32), dtype=np.float32) * 0.02,
                  "vq": rng.integers(-127, 128, (NKV, rows, HD), dtype=np.int8),
                  "vs": rng.random((NKV, rows), dtype=np.float32) * 0.02}
    st.append(blocks, np.arange(NKV), rows)  # the storage's own append: one version, every head
    return st.view()


def kv_bytes(kv) -> int:
    """Bytes of the stored K/V rows (not the capacity past them)."""
    n = int(kv.lens.max(initial=0))
    arrays = (kv.array(name) for name in ("k", "kq", "ks", "v", "vq", "vs"))
    return sum(a[:, :n].nbytes for a in arrays if a is not None)


def timeit(fns, reps: int) -> tuple[list[float], list[float]]:
    """Best wall time and mean process CPU time (all threads) of each of
    ``fns``, the calls INTERLEAVED rep by rep so a noisy shared machine slows
    every contender alike. CPU time is the steadier figure when other jobs
    share the cores; on a GPU only the wall time means anything."""
    for fn in fns:
        fn()  # warm-up (builds, JIT)
    best = [float("inf")] * len(fns)
    cpu = [0.0] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            c, t = time.process_time(), time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
            cpu[i] += (time.process_time() - c) / reps
    return best, cpu


def bench_bounded(window: int, reps: int, use_numba: bool):
    from kvreg.bounded import BoundedRope, BoundedState, BoundedWeights
    from kvreg.reference import ReferenceBackend
    from kvreg_opencl.backend import OpenCLBackend

    rng = np.random.default_rng(2)
    sink = 4
    weights = BoundedWeights(rng.standard_normal((NKV, sink, HD), dtype=np.float32),
                             rng.standard_normal((NKV, sink, HD), dtype=np.float32), sink, [window] * NKV)
    rope = BoundedRope()
    ring_k = rng.standard_normal((NKV, window, HD), dtype=np.float32)
    ring_v = rng.standard_normal((NKV, window, HD), dtype=np.float32)
    backends = [("opencl", OpenCLBackend()), ("reference", ReferenceBackend())]
    if use_numba:
        try:
            from kvreg_numba.backend import NumbaBackend

            backends.append(("numba", NumbaBackend()))
        except Exception as exc:  # noqa: BLE001  (not installed or not importable: compare without it)
            print(f"numba not compared: {exc}")
    q = rng.standard_normal((NQ, HD), dtype=np.float32)
    scale = 1.0 / np.sqrt(HD)
    nsteps = 1 + 1 + 1 + reps  # warm-up, answer check, timed reps (+1 slack)
    rows = [(rng.standard_normal((NKV, HD), dtype=np.float32),
             rng.standard_normal((NKV, HD), dtype=np.float32)) for _ in range(nsteps + 2)]
    states = []
    for _ in backends:
        st = BoundedState(NKV, HD, window)
        st.load(ring_k, ring_v, 3 * window + 17)  # full ring, wrapped
        states.append(st)

    def step(i):
        be, st = backends[i][1], states[i]

        def fn():
            st.insert(*rows[st.seen - 3 * window - 17])
            return be.bounded_attend(q, st.view(weights, rope), scale=scale, num_heads=NQ)
        return fn

    fns = [step(i) for i in range(len(backends))]
    times, cpu = timeit(fns, reps)
    outs = [fn() for fn in fns]  # same step count on every copy: same ring, same answer
    ref = outs[1]
    m = backends[0][1].ring_mirror(states[0].view(weights, rope)).counters()
    nbytes = 2 * NKV * window * HD * 4
    print(f"bounded window={window} sink={sink} {NQ}Q/{NKV}KV hd {HD} "
          f"(ring K+V {nbytes / 2**20:.0f} MiB); ring mirror: {m['slot_uploads']} one-slot updates, "
          f"{m['full_reuploads']} full upload(s)")
    for (name, _), t, c, o in zip(backends, times, cpu, outs):
        rel = float(np.abs(o - ref).max() / np.abs(ref).max())
        print(f"  {name:9s} {t*1e3:8.3f} ms (cpu {c*1e3:7.2f} ms)  vs reference wall {t/times[1]:5.2f}x "
              f"cpu {c/cpu[1]:5.2f}x  maxrel {rel:.1e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1024,4096,16384")
    ap.add_argument("--mode", default="f32", choices=("f32", "q8", "bounded"))
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-numba", action="store_true")
    a = ap.parse_args(argv)
    dev = device.get_device()
    print(f"device {dev}  BLOCK_ROWS={config.BLOCK_ROWS} LOCAL_SIZE={config.LOCAL_SIZE}")
    if a.mode == "bounded":
        bench_bounded(a.window, a.reps, not a.no_numba)
        return
    from kvreg_opencl.backend import OpenCLBackend

    ocl = OpenCLBackend()
    nb = None
    if not a.no_numba:
        try:
            from kvreg_numba.backend import NumbaBackend

            nb = NumbaBackend()
        except Exception as exc:  # noqa: BLE001  (not installed or not importable: compare without it)
            print(f"numba not compared: {exc}")
    q = np.random.default_rng(1).standard_normal((NQ, HD), dtype=np.float32)
    scale = 1.0 / np.sqrt(HD)
    for rows in [int(r) for r in a.rows.split(",")]:
        kv = random_view(rows, a.mode)
        ocl.mirror(kv)  # synced once: every timed call re-uses the device rows
        nbytes = kv_bytes(kv)
        fns = [lambda kv=kv: ocl.attend_layer(q, kv, scale=scale)]
        if nb is not None:
            fns.append(lambda kv=kv: nb.attend_layer(q, kv, scale=scale))
        times, cpu = timeit(fns, a.reps)
        t_cl = times[0]
        line = (f"{a.mode} rows={rows:6d}  opencl {t_cl*1e3:8.3f} ms {nbytes/t_cl/1e9:6.2f} GB/s"
                f" (cpu {cpu[0]*1e3:7.2f} ms)")
        if nb is not None:
            t_nb = times[1]
            o_cl, o_nb = fns[0](), fns[1]()
            rel = float(np.abs(o_cl - o_nb).max() / np.abs(o_nb).max())
            line += (f"  numba {t_nb*1e3:8.3f} ms {nbytes/t_nb/1e9:6.2f} GB/s (cpu {cpu[1]*1e3:7.2f} ms)"
                     f"  opencl/numba wall {t_cl/t_nb:5.2f}x cpu {cpu[0]/cpu[1]:5.2f}x  maxrel {rel:.1e}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
