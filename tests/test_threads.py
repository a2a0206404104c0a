"""kvreg's thread budget (kvreg.threads, docs/threads.md)."""

import os
import subprocess
import sys
import types

import pytest

import kvreg
from kvreg import threads


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("KVREG_THREADS", raising=False)
    kvreg.set_num_threads(None)
    yield
    kvreg.set_num_threads(None)


def test_default_is_the_process_affinity_without_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert kvreg.get_num_threads() == len(os.sched_getaffinity(0))


def test_default_follows_torch_when_torch_is_already_imported(monkeypatch):
    fake = types.SimpleNamespace(get_num_threads=lambda: 3)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert kvreg.get_num_threads() == 3


def test_env_beats_the_default_and_the_call_beats_the_env(monkeypatch):
    monkeypatch.setenv("KVREG_THREADS", "5")
    assert kvreg.get_num_threads() == 5
    kvreg.set_num_threads(2)
    assert kvreg.get_num_threads() == 2
    kvreg.set_num_threads(None)
    assert kvreg.get_num_threads() == 5


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", "2 threads"])
def test_a_bad_env_value_is_a_config_error_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv("KVREG_THREADS", bad)
    with pytest.raises(kvreg.ConfigError, match="KVREG_THREADS"):
        kvreg.get_num_threads()


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "x"])
def test_set_num_threads_refuses_what_is_not_a_positive_integer(bad):
    with pytest.raises(kvreg.ConfigError):
        kvreg.set_num_threads(bad)
    assert kvreg.get_num_threads() >= 1


def test_small_work_runs_on_one_thread():
    kvreg.set_num_threads(4)
    assert threads.threads_for(threads.SMALL_WORK_BYTES - 1) == 1
    assert threads.threads_for(threads.SMALL_WORK_BYTES) == 4


def test_import_kvreg_does_not_import_torch():
    code = "import sys, kvreg; kvreg.get_num_threads(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _run(ch, clock, cost, steps, dt=0.01, budget=2, warm=None):
    """``steps`` calls of 1 MB, each taking ``cost[n]`` ns per byte (a
    count's first call ``warm[n]``: a compile); the counts chosen."""
    picked = []
    warm = dict(warm or {})
    for _ in range(steps):
        n = ch.choose(budget)
        ch.record(n, budget, 1 << 20, int(warm.pop(n, cost[n]) * (1 << 20)))
        picked.append(n)
        clock.t += dt
    return picked


def test_the_chooser_runs_the_budget_on_a_quiet_machine_and_one_thread_beside_a_busy_one():
    clock = _Clock()
    ch = threads.Chooser(clock)
    quiet = _run(ch, clock, {1: 1.0, 2: 0.75}, 400)
    # each count measured once, each after a warm-up call; then the budget
    assert quiet[:4] == [2, 2, 1, 1] and quiet[4:].count(2) > 0.9 * 396
    assert quiet[4:].count(1) > 0 and "1, 1" not in str(quiet[4:])   # a probe of one thread: one call
    busy = _run(ch, clock, {1: 1.0, 2: 90.0}, 2000)        # neighbours take the cores
    assert busy[-1500:].count(2) <= 12, "a slow count is retried less and less often (two calls a probe)"
    again = _run(ch, clock, {1: 1.0, 2: 0.75}, 2000)       # quiet again: the threads come back
    assert again[-1000:].count(2) > 900   # back within one probe interval (at most PROBE_MAX)
    first = _run(threads.Chooser(clock), clock, {1: 1.0, 2: 0.75}, 400, warm={2: 500.0})
    assert first[4:].count(2) > 0.9 * 396   # a first call's compile is not the count's cost
    close = _run(ch, clock, {1: 1.0, 2: 1.05}, 400)        # one thread barely faster: within the noise
    assert close[-300:].count(2) > 250
    clear = _run(ch, clock, {1: 1.0, 2: 1.25}, 400)        # a torch host's spinning workers: clearly faster
    assert clear[-300:].count(1) > 250


def test_a_lucky_probe_beside_a_busy_neighbour_does_not_start_the_probing_over():
    # Beside a busy neighbour a shared call runs at full speed or waits for a
    # preempted worker. A probe that happened to run fast brings the budget
    # back; its next call is slow again, and the probes must keep most of
    # their backing off (half the wait), not start again from PROBE_MIN.
    clock = _Clock()
    ch = threads.Chooser(clock)
    _run(ch, clock, {1: 1.0, 2: 0.75}, 100)
    _run(ch, clock, {1: 1.0, 2: 90.0}, 3000)            # 30 s busy: the longest wait
    assert ch.interval[2] == threads.Chooser.PROBE_MAX
    lucky = _run(ch, clock, {1: 1.0, 2: 0.75}, 900)     # one probe in 9 s, at full speed
    assert lucky[-1] == 2 and ch.interval[2] == threads.Chooser.PROBE_MAX / 2
    after = _run(ch, clock, {1: 1.0, 2: 90.0}, 300)     # busy again for 3 s
    assert after.count(2) == 1, after.count(2)          # the budget's one slow call, no new probes yet


def test_an_explicit_budget_is_used_as_given_and_small_work_on_one_thread(monkeypatch):
    monkeypatch.setattr(threads, "_choosers", {})
    with threads.chosen_threads(threads.SMALL_WORK_BYTES - 1, "t") as n:
        assert n == 1
    kvreg.set_num_threads(3)
    with threads.chosen_threads(threads.SMALL_WORK_BYTES, "t", cap=8) as n:
        assert n == 3
    assert not threads._choosers
    kvreg.set_num_threads(None)
    monkeypatch.setattr(threads, "default_threads", lambda: 2)
    for _ in range(2):   # a warm-up call, then the measured one
        with threads.chosen_threads(threads.SMALL_WORK_BYTES, "t") as n:
            assert n == 2
    assert threads.chooser("t", threads.SMALL_WORK_BYTES).cost.keys() == {2}


def test_each_size_of_call_has_its_own_chooser(monkeypatch):
    # where a second thread starts to pay depends on the size: a power of
    # two of the bytes shares one measurement, the next power has its own
    monkeypatch.setattr(threads, "_choosers", {})
    small = threads.chooser("t", 3 << 20)
    assert threads.chooser("t", (2 << 20) + 1) is small and threads.chooser("t", 4 << 20) is not small
    assert threads.chooser("u", 3 << 20) is not small
    monkeypatch.setattr(threads, "default_threads", lambda: 2)
    small.cost, small.last = {2: 5.0, 1: 1.0}, {2: 1e18, 1: 1e18}    # measured: one thread, no probe due
    assert threads.pick(3 << 20, "t")[0] == 1
    assert threads.pick(64 << 20, "t")[0] == 2                          # a size not measured yet: the budget first


def test_torch_spins_only_with_torch_on_more_than_one_thread(monkeypatch):
    import sys
    import types

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert not threads.torch_spins()
    fake = types.SimpleNamespace(get_num_threads=lambda: 1)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert not threads.torch_spins()
    fake.get_num_threads = lambda: 2
    assert threads.torch_spins()


def test_set_torch_model_takes_a_bool_per_thread():
    import threading

    assert threads.torch_model() is False
    assert threads.set_torch_model(True) is False
    try:
        assert threads.torch_model() is True
        for bad in (1, "yes", None):
            with pytest.raises(kvreg.ConfigError, match="True or False"):
                threads.set_torch_model(bad)
            assert threads.torch_model() is True   # a refused value changes nothing
        seen = []
        t = threading.Thread(target=lambda: seen.append(threads.torch_model()))
        t.start()
        t.join()
        assert seen == [False]                     # another thread is not inside the model
    finally:
        assert threads.set_torch_model(False) is True
    assert threads.torch_model() is False


# ── what PoCL is handed ──

def test_cpu_threads_are_the_affinity_mask():
    assert threads.cpu_threads() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("value,want", [("1000000", "cpus"), ("2147483647", "cpus"), ("1", "1"), ("x", "x")])
def test_the_pocl_worker_count_is_lowered_to_the_cpus(monkeypatch, value, want):
    device = pytest.importorskip("kvreg_opencl.device")
    monkeypatch.setenv("POCL_MAX_PTHREAD_COUNT", value)
    device.bound_pocl_threads()
    assert os.environ["POCL_MAX_PTHREAD_COUNT"] == (str(threads.cpu_threads()) if want == "cpus" else want)


@pytest.mark.parametrize("budget", ["1000000", "2147483647"])
def test_a_huge_budget_does_not_kill_the_process_that_opens_pocl(budget):
    # PoCL starts POCL_MAX_PTHREAD_COUNT workers at once; kvreg hands it its
    # budget: unbounded, a million ends the process with SIGABRT, 2**31-1 with SIGSEGV
    pytest.importorskip("kvreg_opencl")
    pytest.importorskip("pyopencl")
    code = ("import os, kvreg\n"
            "try:\n    kvreg.get_backend('opencl')\n"
            "except kvreg.KvregError as e:\n    print('refused:', e)\n"   # a device that cannot build: said
            "print('workers', os.environ['POCL_MAX_PTHREAD_COUNT'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVREG_", "POCL_"))}
    env["KVREG_THREADS"] = budget
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert f"workers {threads.cpu_threads()}" in proc.stdout
