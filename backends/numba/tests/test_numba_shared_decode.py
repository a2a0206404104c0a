"""A decode shared with helper threads (kvreg_numba.decode: attend_groups,
decode_helper; kvreg_numba.pool: the helper threads). Helpers claim tasks from a shared array; the
caller runs what is left, copies what helpers finished and takes back what
a helper still holds, so it never waits long for a thread that lost its
core. These tests would catch a caller that used a helper's half-written
state, one that skipped a task, bits that depend on who ran a task, helper
threads lost after a fork, and a process that aborts at exit while a
helper is busy."""

import subprocess
import sys
import threading

import numpy as np
import pytest

import kvreg
from kvreg_numba import decode, dispatch, pool


def _call(rows=5000, nkv=2, hd=64, hpk=3, mode="f32", imp=False, seed=0):
    """attend_groups' arguments for a layer (several tasks per group), the
    scratch size and the task count."""
    rng = np.random.default_rng(seed)
    lay = kvreg.LayerKvCache(nkv, hd, mode, "numba")
    x = rng.standard_normal((rows, nkv, hd)).astype(np.float32)
    lay.extend(x, x)
    got = {}
    real = dispatch._run
    dispatch._run = lambda nbytes, nfloats, *args: got.update(nfloats=nfloats, args=args)
    try:
        lay.attend_layer(rng.standard_normal((nkv * hpk, hd)).astype(np.float32), importance=imp)
    finally:
        dispatch._run = real
    args = list(got["args"])
    args[26] = 1024      # block: 5 tasks per group
    nfloats = dispatch.scratch_floats(nkv * hpk, hpk, hd, np.asarray(args[3]), np.asarray(args[4]), 1024)
    ntask = nfloats // (hpk * (1024 + 3 + hd))
    return args, nfloats, ntask


def _run_alone(args, nfloats):
    a = list(args)
    a[29] = a[29].copy()     # imp
    a[30] = np.empty_like(a[30])
    decode.attend_groups(*a, np.empty(nfloats, np.float32), decode.NO_STATE, decode.NO_HELPERS)
    return a[30], a[29]


@pytest.mark.parametrize("imp", [False, True])
@pytest.mark.parametrize("mode", ["f32", "f16", "q8"])
def test_the_caller_copies_finished_tasks_and_takes_back_held_ones(mode, imp):
    args, nfloats, ntask = _call(mode=mode, imp=imp)
    want, want_imp = _run_alone(args, nfloats)
    # helper 0 ran every task into its own scratch
    hs = np.full((1, nfloats), np.nan, np.float32)
    done = np.zeros(ntask, np.int64)
    decode.decode_helper(*args, hs[0], done, decode.HELPER)
    assert (done == decode.HELPER + 1).all()
    # now: tasks 0-1 free (the caller runs them), 2-4 finished by the helper,
    # the rest still held by it (taken back: their slots in hs are garbage)
    state = np.full(ntask, decode.HELPER, np.int64)
    state[:2] = decode.TASK_FREE
    state[2:5] = decode.HELPER + 1
    hs[0, :] = np.where(np.arange(nfloats) % 7 == 0, np.nan, hs[0])  # garbage the caller must not read...
    decode.decode_helper(*args, hs[0], np.zeros(ntask, np.int64), decode.HELPER)  # ...except in finished tasks
    a = list(args)
    a[29], a[30] = args[29].copy(), np.empty_like(args[30])
    decode.attend_groups(*a, np.empty(nfloats, np.float32), state, hs)
    np.testing.assert_array_equal(a[30].view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(a[29].view(np.uint32), want_imp.view(np.uint32))
    assert (state[:2] == decode.TASK_CALLER).all() and (state[5:] == decode.TASK_TAKEN_BACK).all()


@pytest.mark.parametrize("imp", [False, True])
@pytest.mark.parametrize("mode", ["f32", "f16", "q8"])
def test_the_prange_decode_gives_the_single_threads_bits(mode, imp):
    # attend_groups_par: the decode inside a torch model, its tasks in a
    # prange region; worker counts past the task count are clamped.
    args, nfloats, ntask = _call(mode=mode, imp=imp)
    want, want_imp = _run_alone(args, nfloats)
    for workers in (1, 2, 3, ntask + 5):
        a = list(args)
        a[29], a[30] = args[29].copy(), np.empty_like(args[30])
        decode.attend_groups_par(*a, np.empty(nfloats, np.float32), workers)
        np.testing.assert_array_equal(a[30].view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(a[29].view(np.uint32), want_imp.view(np.uint32))


def test_a_held_task_is_taken_back_not_read():
    args, nfloats, ntask = _call()
    want, _ = _run_alone(args, nfloats)
    hs = np.full((1, nfloats), np.nan, np.float32)   # the helper wrote nothing yet
    state = np.full(ntask, decode.HELPER, np.int64)       # and holds every task
    a = list(args)
    a[30] = np.empty_like(args[30])
    decode.attend_groups(*a, np.empty(nfloats, np.float32), state, hs)
    np.testing.assert_array_equal(a[30].view(np.uint32), want.view(np.uint32))


def test_two_threads_give_one_threads_bits_and_post_to_a_helper(monkeypatch):
    lay = kvreg.LayerKvCache(8, 128, "f32", "numba")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4096, 8, 128)).astype(np.float32)
    lay.extend(x, x)
    q = rng.standard_normal((32, 128)).astype(np.float32)
    monkeypatch.setenv("KVREG_THREADS", "1")
    one = lay.attend_layer(q)
    posted = []
    real = pool.helpers.post
    monkeypatch.setattr(pool.helpers, "post", lambda jobs: (posted.append(len(jobs)), real(jobs)))
    monkeypatch.setenv("KVREG_THREADS", "2")
    for _ in range(20):
        np.testing.assert_array_equal(lay.attend_layer(q).view(np.uint32), one.view(np.uint32))
    assert posted and set(posted) == {1}


@pytest.mark.skipif(__import__("numba").config.NUMBA_NUM_THREADS < 2, reason="needs a pool of 2 threads")
def test_in_a_torch_host_the_default_budget_runs_the_decode_count_measured_faster(monkeypatch):
    # The decode measures both counts (kvreg.threads.Chooser, per size of
    # call) and runs the faster; inside a torch model's forward
    # (kvreg.threads.set_torch_model) with torch on several threads its
    # tasks run in a prange region on torch's spinning workers, elsewhere
    # it shares the call with helper threads.
    import time

    from kvreg import threads

    lay = kvreg.LayerKvCache(8, 128, "f32", "numba")
    x = np.ones((4096, 8, 128), np.float32)
    lay.extend(x, x)
    q = np.ones((32, 128), np.float32)
    monkeypatch.delenv("KVREG_THREADS", raising=False)
    monkeypatch.setattr(threads, "default_threads", lambda: 2)
    monkeypatch.setattr(threads, "_choosers", {})
    ch = threads.chooser("numba.decode", 4096 * 8 * 128 * 8)   # the call's size: 4k rows of K and V
    now = time.monotonic()
    ch.cost, ch.last, ch.interval = {2: 50.0, 1: 1.0}, {2: now, 1: now}, {2: 8.0}   # two threads measured slower
    posted = []
    real = pool.helpers.post
    monkeypatch.setattr(pool.helpers, "post", lambda jobs: (posted.append(len(jobs)), real(jobs)))
    regions = []
    par = decode.attend_groups_par
    monkeypatch.setattr(dispatch, "attend_groups_par", lambda *a: (regions.append(a[-1]), par(*a)))
    monkeypatch.setattr(dispatch, "in_torch_pool", lambda: True)
    monkeypatch.setattr(threads, "_model", threading.local())   # this test's own, dropped after it
    threads.set_torch_model(True)
    monkeypatch.setattr(dispatch, "torch_spins", lambda: True)
    want = None
    for _ in range(2):                          # a switch's warm-up call, then the measured one
        want = lay.attend_layer(q)
    assert not posted and not regions and ch.last[1] > now      # one thread, timed for the chooser
    ch.cost[2] = 0.5                            # a probe found two faster again
    for _ in range(2):
        np.testing.assert_array_equal(lay.attend_layer(q).view(np.uint32), want.view(np.uint32))
    assert not posted and regions == [2, 2] and ch.last[2] > now
    threads.set_torch_model(False)              # torch loaded, no model running: helpers, measured
    before = ch.last[2]
    np.testing.assert_array_equal(lay.attend_layer(q).view(np.uint32), want.view(np.uint32))
    assert posted == [1] and regions == [2, 2] and ch.last[2] > before
    monkeypatch.setattr(dispatch, "torch_spins", lambda: False)   # no torch: helpers, measured all the same
    posted.clear()
    before = ch.last[2]
    np.testing.assert_array_equal(lay.attend_layer(q).view(np.uint32), want.view(np.uint32))
    assert posted == [1] and ch.last[2] > before


@pytest.mark.skipif(__import__("numba").config.NUMBA_NUM_THREADS < 2, reason="needs a pool of 2 threads")
@pytest.mark.parametrize("mode", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("path", ["one thread", "helpers", "prange region"])
def test_the_fused_decode_step_gives_append_then_attend_layers_bits(monkeypatch, path, mode):
    # LayerKvCache.append_attend on numba F32/f16/bf16: the row stored
    # (rounded as the core rounds a 2-byte row) inside the launch
    # (append_attend_groups / _par), or before helpers are posted, then the
    # same tasks and merge as attend_layer after an append.
    from kvreg import threads

    rng = np.random.default_rng(7)
    x = rng.standard_normal((4096, 8, 128)).astype(np.float32)
    steps = rng.standard_normal((4, 2, 8, 128)).astype(np.float32)
    q = rng.standard_normal((32, 128)).astype(np.float32)
    monkeypatch.setenv("KVREG_THREADS", "1")
    ref = kvreg.LayerKvCache(8, 128, mode, "numba")
    ref.extend(x, x)
    want = []
    for k, v in steps:
        ref.append(k, v)
        want.append(ref.attend_layer(q, window=3000))
    posted, fused = [], []
    real = pool.helpers.post
    monkeypatch.setattr(pool.helpers, "post", lambda jobs: (posted.append(len(jobs)), real(jobs)))
    # (only the entries _run calls: a kernel other njit code calls is resolved when that compiles)
    for name in ("append_attend_groups_par", "append_attend_groups"):
        kernel = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, kernel=kernel, name=name: (fused.append(name), kernel(*a)))
    monkeypatch.setattr(threads, "_model", threading.local())
    if path != "one thread":
        monkeypatch.setenv("KVREG_THREADS", "2")
    if path == "prange region":
        monkeypatch.setattr(dispatch, "torch_spins", lambda: True)
        monkeypatch.setattr(dispatch, "in_torch_pool", lambda: True)
        threads.set_torch_model(True)
    lay = kvreg.LayerKvCache(8, 128, mode, "numba")
    lay.extend(x, x)
    for (k, v), w in zip(steps, want):
        np.testing.assert_array_equal(lay.append_attend(k, v, q, window=3000).view(np.uint32), w.view(np.uint32))
    np.testing.assert_array_equal(lay.imp.view(np.uint32), ref.imp.view(np.uint32))
    n = ref.seq_len
    assert lay.seq_len == n and (lay.storage.lens == ref.storage.lens).all()
    for side in ("k", "v"):   # the stored bits (a 2-byte row rounded as the core rounds it)
        assert getattr(lay.storage, side)[:, :n].tobytes() == getattr(ref.storage, side)[:, :n].tobytes(), side
    # the first step grows the capacity (append, then attend_layer); the
    # others store their row in the launch, except before posting helpers
    assert (len(posted), fused) == {"one thread": (0, ["append_attend_groups"] * 3), "helpers": (4, []),
                                    "prange region": (0, ["append_attend_groups_par"] * 3)}[path]


_CHILD = """
import os, sys, numpy as np, kvreg
kvreg.set_num_threads(2)
lay = kvreg.LayerKvCache(8, 128, "f32", "numba")
x = np.ones((4096, 8, 128), np.float32); lay.extend(x, x)
q = np.ones((32, 128), np.float32)
want = lay.attend_layer(q)
pid = os.fork()
if pid == 0:   # the child: its own helper threads
    ok = all(np.array_equal(lay.attend_layer(q), want) for _ in range(10))
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
for _ in range(50):
    lay.attend_layer(q)   # exit right after: a helper may still be in a call
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_decodes_and_the_process_exits_cleanly():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("child 0")
