"""Compile the numba kernels once, ahead of their first use.

    python -m kvreg_numba.warm [--jobs N]

numba compiles a kernel the first time it is called with a new set of
argument types, and keeps the result in its on-disk cache (``__pycache__``
beside the modules, or ``NUMBA_CACHE_DIR``) for every later process. A cold
process pays minutes for the whole backend on a small machine, inside the
first model run or test that reaches each kernel. This drives every kernel
through kvreg's public API, in every KV mode, on one thread, on helper
threads and inside a torch host, so each specialization a model, the tests
or the conformance suite reach is compiled and cached now. ``--jobs N``
splits the modes over N processes (the default: the CPUs this process may
use); each compiles what its modes need, and the kernels every mode shares
are compiled by each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

#: The KV modes, in the order the parts take them (the heaviest spread out).
MODES = ("f32", "q8", "f16", "q8k", "bf16", "q8v", "q8_2f", "q8k_2f", "q8v_2f")


def _rows(rng, n: int, nkv: int, hd: int) -> np.ndarray:
    return rng.standard_normal((n, nkv, hd)).astype(np.float32)


def _layer_calls(mode: str, backend, rng) -> None:
    """Every decode, prefill and storage path of one mode."""
    import kvreg

    nkv, hd, hpk = 2, 64, 3
    nh = nkv * hpk
    for exact in (0, 1):
        lay = kvreg.LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=exact)
        lay.extend(_rows(rng, 70, nkv, hd), _rows(rng, 70, nkv, hd))
        q = rng.standard_normal((nh, hd)).astype(np.float32)
        lay.attend_chunk(rng.standard_normal((70, nh, hd)).astype(np.float32), b=70, s0=0, heads_per_kv=hpk)
        lay.attend_chunk(rng.standard_normal((70, nh, hd)).astype(np.float32), b=70, s0=0, heads_per_kv=hpk,
                         window=16, importance=False)
        for p in range(10):
            lay.append(_rows(rng, 1, nkv, hd)[0], _rows(rng, 1, nkv, hd)[0], [True, p % 2 == 0])
        sinks = rng.standard_normal(nh).astype(np.float32)
        lay.attend_layer(q)
        lay.attend_layer(q, window=9, softcap=3.0, sinks=sinks, importance=False)
        imp = np.zeros(lay.seq_len, np.float32)
        lay.attend_group(q[:hpk], 1, scale=0.1, first=3, upto=40, softcap=2.0, sinks=sinks[:hpk], imp_acc=imp)
        lay.attend_group(q[:hpk], 0, scale=0.1)
        lay.truncate_last(3)
        lay.evict_born(60, 4, 8)
        level = kvreg.LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=exact)
        level.extend(_rows(rng, 40, nkv, hd), _rows(rng, 40, nkv, hd))
        for _ in range(3):
            level.append_attend(_rows(rng, 1, nkv, hd)[0], _rows(rng, 1, nkv, hd)[0], q)
        step = level.decode_step(nh)
        for _ in range(3):
            step(_rows(rng, 1, nkv, hd)[0], _rows(rng, 1, nkv, hd)[0], q)
        kvreg.attend_batch(np.stack([q, q]), [level, level.fork()])
        kvreg.attend_batch(np.stack([q, q]), [level, lay], window=5, sinks=None, importance=False)


def _seal_and_ring(backend, rng) -> None:
    """The Nyström seal's kernels and the bounded ring's."""
    import kvreg
    from kvreg.bounded import BoundedRope, BoundedWeights

    nkv, hd, hpk = 2, 64, 2
    lay = kvreg.LayerKvCache(nkv, hd, "f32", backend)
    lay.o1_begin(8, 16, 2, auto=True, far="nystrom")
    lay.extend(_rows(rng, 60, nkv, hd), _rows(rng, 60, nkv, hd))
    q = rng.standard_normal((nkv * hpk, hd)).astype(np.float32)
    lay.attend_chunk(rng.standard_normal((60, nkv * hpk, hd)).astype(np.float32), b=60, s0=0, heads_per_kv=hpk)
    for _ in range(3):
        lay.append(_rows(rng, 1, nkv, hd)[0], _rows(rng, 1, nkv, hd)[0])
        lay.attend_layer(q, sinks=None)
    ring = kvreg.LayerKvCache(nkv, hd, "f32", backend)
    ring.install_bounded(8)
    weights = BoundedWeights(rng.standard_normal((nkv, 2, hd)).astype(np.float32),
                             rng.standard_normal((nkv, 2, hd)).astype(np.float32), 2, [8, 4])
    for _ in range(10):
        ring.bounded_step(q, _rows(rng, 1, nkv, hd)[0], _rows(rng, 1, nkv, hd)[0], weights,
                          BoundedRope(10000.0, rotary_dims=32), 0.125, nkv * hpk)


def _large_calls(mode: str, backend, rng) -> None:
    """A layer past the small-work size, so the decode runs on helper
    threads, and (torch imported) inside a torch host's region."""
    import kvreg
    from kvreg import threads

    nkv, hd, hpk = 4, 128, 2
    lay = kvreg.LayerKvCache(nkv, hd, mode, backend)
    lay.extend(_rows(rng, 600, nkv, hd), _rows(rng, 600, nkv, hd))
    q = rng.standard_normal((nkv * hpk, hd)).astype(np.float32)
    kvreg.set_num_threads(2)
    try:
        lay.attend_layer(q)
        lay.append_attend(_rows(rng, 1, nkv, hd)[0], _rows(rng, 1, nkv, hd)[0], q)
        if "torch" in sys.modules:
            previous = threads.set_torch_model(True)
            try:
                lay.attend_layer(q)
                lay.append_attend(_rows(rng, 1, nkv, hd)[0], _rows(rng, 1, nkv, hd)[0], q)
            finally:
                threads.set_torch_model(previous)
    finally:
        kvreg.set_num_threads(None)


def warm(modes, *, extra: bool) -> None:
    """Compile every kernel ``modes`` reach (``extra``: also the seal, the
    ring and the exact-class kernels every mode shares)."""
    from .backend import NumbaBackend

    backend = NumbaBackend()
    rng = np.random.default_rng(0)
    try:
        import torch  # noqa: F401  (a torch host's decode path, where torch is installed)
    except ImportError:
        pass
    for mode in modes:
        _layer_calls(mode, backend, rng)
        _large_calls(mode, backend, rng)
    if extra:
        _seal_and_ring(backend, rng)
        x = rng.standard_normal((5, 64)).astype(np.float32)
        backend.quantize_rows(x, None, group=32)
        backend.rotate_rows(x)
        backend.gather_rows(x, np.array([0, 2], np.int64))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="compile kvreg-numba's kernels into numba's on-disk cache")
    ap.add_argument("--jobs", type=int, default=None, help="processes (default: the CPUs this process may use)")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)   # "i/n": one process's share
    args = ap.parse_args(argv)
    if args.part is not None:
        i, n = (int(x) for x in args.part.split("/"))
        warm(MODES[i::n], extra=i == 0)
        return 0
    jobs = args.jobs or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    jobs = max(1, min(int(jobs), len(MODES)))
    t0 = time.perf_counter()
    print(f"kvreg-numba: compiling the kernels for this CPU into numba's cache ({jobs} processes; "
          "minutes the first time, seconds once cached)", flush=True)
    procs = [subprocess.Popen([sys.executable, "-m", "kvreg_numba.warm", "--part", f"{i}/{jobs}"])
             for i in range(1, jobs)]
    warm(MODES[0::jobs], extra=True)
    failed = [p for p in procs if p.wait() != 0]
    print(f"kvreg-numba: kernels compiled and cached in {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
