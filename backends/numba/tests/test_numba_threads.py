"""kvreg-numba runs its parallel kernels on kvreg's thread budget
(kvreg.threads): small work on one thread, the caller's numba setting
restored after every call, the same bits on any count."""

from contextlib import contextmanager

import numba
import numpy as np
import pytest

import kvreg
from kvreg import threads
from kvreg_numba import chunk, dispatch
from kvreg_numba import threads as numba_threads


@pytest.fixture(autouse=True)
def _budget(monkeypatch):
    monkeypatch.delenv("KVREG_THREADS", raising=False)
    yield
    kvreg.set_num_threads(None)


def test_the_budget_sets_numba_threads_inside_and_restores_them_after():
    kvreg.set_num_threads(1)
    before = numba.get_num_threads()
    with numba_threads.thread_budget(1 << 40):
        assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == before


def test_small_work_runs_on_one_thread_whatever_the_budget():
    kvreg.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    with numba_threads.thread_budget(threads.SMALL_WORK_BYTES - 1):
        assert numba.get_num_threads() == 1
    with numba_threads.thread_budget(threads.SMALL_WORK_BYTES):
        assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS


def test_a_budget_above_numbas_pool_is_clamped_to_it():
    kvreg.set_num_threads(numba.config.NUMBA_NUM_THREADS + 7)
    with numba_threads.thread_budget(1 << 40):
        assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS


def test_decode_answers_the_same_bits_on_every_budget(monkeypatch):
    monkeypatch.setattr(threads, "SMALL_WORK_BYTES", 0)
    rng = np.random.default_rng(3)
    nkv, hpk, hd, n = 2, 4, 64, 300
    k = rng.standard_normal((nkv, n, hd), dtype=np.float32)
    v = rng.standard_normal((nkv, n, hd), dtype=np.float32)
    q = rng.standard_normal((nkv * hpk, hd), dtype=np.float32)
    outs = []
    for t in (1, 2, 3):
        kvreg.set_num_threads(t)
        imp = np.zeros(n, np.float32)
        outs.append((dispatch.attend_layer(q, np.full(nkv, n), k=k, v=v, scale=0.1, imp=imp, block=32), imp))
    for out, imp in outs[1:]:
        assert out.tobytes() == outs[0][0].tobytes() and imp.tobytes() == outs[0][1].tobytes()


def test_a_bad_kvreg_threads_fails_the_backend_with_a_config_error(monkeypatch):
    from kvreg_numba.backend import NumbaBackend

    monkeypatch.setenv("KVREG_THREADS", "lots")
    with pytest.raises(kvreg.ConfigError, match="KVREG_THREADS"):
        NumbaBackend()


def test_the_first_decode_leaves_torchs_thread_count_as_the_host_set_it():
    # numba's OpenMP layer set the process's OpenMP thread count (torch's
    # intra-op count) as it started; a fresh process shows it.
    import subprocess
    import sys

    pytest.importorskip("torch")
    code = (
        "import torch, numpy as np, kvreg\n"
        "torch.set_num_threads(1)\n"
        "c = kvreg.LayerKvCache(8, 128, backend='numba')\n"
        "k = np.ones((4096, 8, 128), np.float32); c.extend(k, k)\n"
        "c.attend_layer(np.ones((32, 128), np.float32))\n"
        "print(torch.get_num_threads())\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "KVREG_THREADS"}
    env["KVREG_THREADS"] = "2"  # a budget above torch's: the kernel may use two, torch keeps one
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1"


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs a pool of 2 threads")
def test_under_the_default_budget_the_count_measured_faster_runs(monkeypatch):
    import time

    monkeypatch.setattr(threads, "default_threads", lambda: 2)
    monkeypatch.setattr(threads, "_choosers", {})
    ch = threads.chooser("numba.decode", 1 << 30)
    now = time.monotonic()
    # two threads measured 50x slower (busy neighbours), probed a moment ago
    ch.cost, ch.last, ch.interval = {2: 50.0, 1: 1.0}, {2: now, 1: now}, {2: 8.0}
    for _ in range(2):                     # a warm-up call, then the measured one
        with numba_threads.thread_budget(1 << 30):
            assert numba.get_num_threads() == 1
    ch.cost[2] = 0.5                       # quiet again (a probe said so)
    for _ in range(2):                     # a switch's warm-up call, then the measured one
        with numba_threads.thread_budget(1 << 30):
            assert numba.get_num_threads() == 2
    assert ch.last[2] > now                # the call was timed for the chooser


def _blas_threads():
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_a_chunk_holds_blas_to_one_thread_and_gives_the_hosts_count_back(monkeypatch):
    from threadpoolctl import threadpool_limits

    from kvreg_numba import blas

    with threadpool_limits(limits=2, user_api="blas"):   # a host that gave BLAS two threads
        before = _blas_threads()
        if not before or 2 not in before:
            pytest.skip(f"no BLAS library threadpoolctl can set to 2 threads ({before})")
        _chunk_under_spy(monkeypatch, blas.one_blas_thread)
        assert _blas_threads() == before


def _chunk_under_spy(monkeypatch, real):
    seen = []

    @contextmanager
    def spy():
        with real():
            seen.append(_blas_threads())
            with real():   # nested holders share the limit
                seen.append(_blas_threads())
            seen.append(_blas_threads())   # the outer holder still holds it
            yield

    monkeypatch.setattr(chunk, "one_blas_thread", spy)
    rng = np.random.default_rng(2)
    # hd 12, not a multiple of 16: the BLAS path (kvreg_numba.chunk takes the rest)
    k = rng.standard_normal((1, 40, 12), dtype=np.float32)
    chunk.attend_chunk(rng.standard_normal((40, 2, 12), dtype=np.float32), k, k, s0=0, b=40, hpk=2, scale=0.25)
    assert seen and all(n == 1 for counts in seen for n in counts)
