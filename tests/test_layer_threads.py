"""A layer used from two threads at once takes turns (its public calls are
serialized by a lock): no read sees a half-applied mutation
(docs/reliability.md)."""

import threading
import time

import numpy as np
import pytest

from kvreg import KvCache, KvMode, LayerKvCache
from kvreg.reference import ReferenceBackend


class Parking(ReferenceBackend):
    """attend_layer parks until released, to hold a call inside the layer."""

    name = "parking_test"

    def __init__(self):
        super().__init__()
        self.inside = threading.Event()
        self.release = threading.Event()

    def attend_layer(self, q, st, **kw):
        self.inside.set()
        assert self.release.wait(10)
        return super().attend_layer(q, st, **kw)


def rows(i, n=8):
    return np.full(n, float(i), np.float32)


@pytest.mark.parametrize("mutation", ["append", "truncate_last", "evict", "clear", "import_wire", "mode"])
def test_a_mutation_waits_for_a_read_in_progress_on_another_thread(mutation):
    be = Parking()
    c = LayerKvCache(2, 4, KvMode.F32, be)
    for i in range(6):
        c.append(rows(i), rows(-i))
    blob = c.export_wire()
    reader = threading.Thread(target=c.attend_layer, args=(np.ones((2, 4), np.float32),))
    reader.start()
    assert be.inside.wait(10)
    done = threading.Event()
    calls = {"append": lambda: c.append(rows(9), rows(9)), "truncate_last": lambda: c.truncate_last(2),
             "evict": lambda: c.evict(1), "clear": c.clear, "import_wire": lambda: c.import_wire(blob),
             "mode": lambda: (c.clear(), setattr(c, "mode", "q8"))}

    def writer():
        calls[mutation]()
        done.set()

    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.2)
    assert not done.is_set(), f"{mutation} ran while attend_layer was reading the rows"
    be.release.set()
    reader.join(10)
    w.join(10)
    assert done.is_set()


def test_two_threads_decoding_on_one_layer_read_only_whole_states():
    # One thread appends rows of value i (and truncates/re-appends), the other
    # reads: with every key and value row of a state equal to its row index,
    # a whole state answers exactly; a torn one (rows moved, counts not yet)
    # would not.
    c = LayerKvCache(1, 4, KvMode.F32, "reference")
    c.append(np.zeros(4, np.float32), np.zeros(4, np.float32))
    stop = threading.Event()
    bad = []

    def writer():
        i = 1
        while not stop.is_set():
            c.append(np.full(4, i % 7, np.float32), np.full(4, i % 7, np.float32))
            if i % 5 == 0:
                c.truncate_last(3)
            if c.seq_len > 60:
                c.evict(10)
            i += 1

    def reader():
        q = np.zeros((1, 4), np.float32)   # uniform probabilities: out = mean of the values
        for _ in range(400):
            with c.lock:   # the public lock: the test's own view of a whole state
                want = c.head_values(0).mean(axis=0)
                got = c.attend_layer(q, importance=False)[0]
            if not np.allclose(got, want, atol=1e-5):
                bad.append((got, want))

    t = threading.Thread(target=writer)
    t.start()
    try:
        reader()
    finally:
        stop.set()
        t.join(10)
    assert not bad


def test_a_cache_import_is_seen_whole_by_other_threads():
    a = KvCache(3, 1, 4, 64, mode=KvMode.F32, backend="reference")
    for layer in a.layers:
        for i in range(5):
            layer.append(rows(i, 4), rows(i, 4))
    blob = a.export_wire()
    b = KvCache(3, 1, 4, 64, mode=KvMode.F32, backend="reference")
    seen = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            with b._all_layers_locked():
                seen.append(tuple(layer.seq_len for layer in b.layers))

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(30):
        b.import_wire(blob)
        b.clear()
    stop.set()
    t.join(10)
    assert set(seen) <= {(0, 0, 0), (5, 5, 5)}


@pytest.mark.parametrize("name", ["reference", "numba", "opencl"])
def test_different_layers_decode_on_different_threads(name):
    import kvreg

    try:
        kvreg.get_backend(name)
    except kvreg.KvregError as exc:
        pytest.skip(str(exc))
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 40, 2 * 16)).astype(np.float32)
    q = rng.standard_normal((40, 4, 16)).astype(np.float32)

    def decode(i, out):
        layer = LayerKvCache(2, 16, KvMode.F32, name)
        for p in range(40):
            layer.append(k[i, p], k[i, p])
            out.append(layer.attend_layer(q[p]))

    want = []
    for i in range(3):
        want.append([])
        decode(i, want[i])
    got = [[] for _ in range(3)]
    threads = [threading.Thread(target=decode, args=(i, got[i])) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for g, w in zip(got, want):
        assert len(g) == len(w) and all(np.array_equal(a, b) for a, b in zip(g, w))
