"""Forks: copy-on-write sequences sharing a parent's rows.

A fork holds the parent's rows once; every mutation of any member leaves
every other member bit-identical to a deep copy that saw the same calls.
"""

import copy

import numpy as np
import pytest

import kvreg
import kvreg._snapshot
from kvreg import KvCache, LayerKvCache
from kvreg_conformance import startable_backends

NKV, HD, HPK = 2, 32, 2
BACKENDS = startable_backends(("reference", "numba", "opencl"))


def _rows(rng, n=1):
    return (rng.standard_normal((n, NKV * HD)).astype(np.float32),
            rng.standard_normal((n, NKV * HD)).astype(np.float32))


def _prompt(backend, mode, n, seed=0):
    rng = np.random.default_rng(seed)
    lay = LayerKvCache(NKV, HD, mode, backend)
    k, v = _rows(rng, n)
    lay.extend(k.reshape(n, NKV, HD), v.reshape(n, NKV, HD), layout="nhd")
    return lay


def _state(lay: LayerKvCache, q: np.ndarray):
    """What a caller can observe: the wire record and a decode answer (on a
    copy, so observing changes nothing)."""
    probe = copy.deepcopy(lay)
    out = probe.attend_layer(q, importance=False) if probe.seq_len else None
    return lay.export_wire(), out, lay.imp.copy()


def _mutate(lay: LayerKvCache, op: str, rng) -> None:
    if op == "append":
        k, v = _rows(rng)
        lay.append(k[0], v[0])
    elif op == "extend":
        k, v = _rows(rng, 5)
        lay.extend(k.reshape(5, NKV, HD), v.reshape(5, NKV, HD), layout="nhd")
    elif op == "attend":      # accumulates importance: a write of the layer's own state
        lay.attend_layer(rng.standard_normal((NKV * HPK, HD)).astype(np.float32))
    elif op == "truncate":
        lay.truncate_last(min(3, lay.seq_len))
    elif op == "trim":
        lay.trim_window(max(lay.seq_len - 4, 1), 0, 1)
    elif op == "evict":
        lay.evict(max(lay.seq_len - 6, 1))
    elif op == "evict_born":
        lay.evict_born(max(lay.seq_len - 5, 2), 1, 1)
    elif op == "clear":
        lay.clear()
    elif op == "import":       # a wire import replaces every row
        other = LayerKvCache(NKV, HD, lay.mode, lay.backend)
        k, v = _rows(rng, 7)
        other.extend(k.reshape(7, NKV, HD), v.reshape(7, NKV, HD), layout="nhd")
        lay.import_wire(other.export_wire())


OPS = ["append", "extend", "attend", "truncate", "trim", "evict", "evict_born", "clear", "import"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["f32", "f16", "q8", "q4"])
# mixed (both kinds of sharing meet) by default; each kind alone in the full tier
@pytest.mark.parametrize("sharing", [pytest.param("pages", marks=pytest.mark.full_product),
                                     pytest.param("arrays", marks=pytest.mark.full_product), "mixed"])
def test_forks_and_parent_mutated_in_random_order_match_deep_copies(backend, mode, sharing, monkeypatch):
    # pages: every fork maps one snapshot (kvreg._snapshot); arrays: small
    # layers (or no memfd) share the arrays until the first write; mixed:
    # layers cross the threshold as they grow, so both kinds meet
    threshold = {"pages": 0, "arrays": 1 << 62, "mixed": 32 << 10}[sharing]
    monkeypatch.setattr(kvreg._snapshot, "MIN_BYTES", threshold)
    rng = np.random.default_rng(hash((backend, mode)) % 2**32)
    parent = _prompt(backend, mode, 48, seed=1)
    members = [parent] + [parent.fork() for _ in range(3)]
    members.append(members[1].fork())    # a fork of a fork
    shadows = [copy.deepcopy(m) for m in members]
    q = rng.standard_normal((NKV * HPK, HD)).astype(np.float32)
    assert all(m.shared_bytes() > 0 for m in members)
    for step in range(40):
        i = int(rng.integers(len(members)))
        op = OPS[int(rng.integers(len(OPS)))] if step % 7 != 6 else "fork"
        seed = int(rng.integers(2**31))
        if op == "fork":                       # a new member mid-way, and a deep copy of one
            members += [members[i].fork(), copy.deepcopy(members[i])]
            shadows += [copy.deepcopy(shadows[i]), copy.deepcopy(shadows[i])]
        else:
            _mutate(members[i], op, np.random.default_rng(seed))
            _mutate(shadows[i], op, np.random.default_rng(seed))
        for j, (m, s) in enumerate(zip(members, shadows)):
            got, want = _state(m, q), _state(s, q)
            assert got[0] == want[0], f"step {step}: {op} on member {i} changed member {j}'s rows"
            if want[1] is not None:
                assert np.array_equal(got[1], want[1]), f"step {step}: {op} on member {i}: member {j}'s answer"
            assert np.array_equal(got[2], want[2]), f"step {step}: {op} on member {i}: member {j}'s importance"


@pytest.mark.parametrize("backend", BACKENDS)
def test_n_forks_of_a_4k_prompt_hold_it_once(backend):
    parent = _prompt(backend, "f32", 4096)
    alone = parent.memory_bytes()
    forks = [parent.fork() for _ in range(8)]
    assert all(f.memory_bytes() == alone and f.shared_bytes() > 0.99 * alone for f in forks)
    # one device mirror serves them all: their views name the same rows
    assert all(f.storage.view().owner is parent.storage.view().owner for f in forks)
    held = kvreg.resident_bytes(parent, forks)
    assert held < 1.01 * alone, (held, alone)
    # decoding on, every fork keeps reading the prompt from the one copy
    rng = np.random.default_rng(0)
    for f in forks:
        for _ in range(16):
            k, v = _rows(rng)
            f.append(k[0], v[0])
    own = 8 * 16 * 2 * NKV * HD * 4                      # each fork's 16 new rows
    pages = 8 * 2 * NKV * 4096                            # and a page per head and block it wrote into
    assert all(f.shared_bytes() == alone for f in forks)
    assert kvreg.resident_bytes(parent, forks) <= alone + own + pages
    # a rewrite of the prompt's rows (a truncation into it) ends that fork's share
    forks[0].truncate_last(4096 + 16 - 100)
    assert forks[0].shared_bytes() == forks[0].memory_bytes()   # its 100 rows left are still shared
    k, v = _rows(rng, 50)
    forks[0].extend(k.reshape(50, NKV, HD), v.reshape(50, NKV, HD), layout="nhd")
    assert forks[0].shared_bytes() == 100 * 2 * NKV * HD * 4
    twin = _prompt(backend, "f32", 4096)
    q = rng.standard_normal((NKV * HPK, HD)).astype(np.float32)
    assert np.array_equal(parent.attend_layer(q), twin.attend_layer(q))


@pytest.mark.parametrize("far", ["nystrom", "tiered"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_answers_as_a_deep_copy_and_the_seal_leaves_siblings(backend, far):
    parent = _prompt(backend, "f32", 0)
    parent.o1_begin(4, 8, 2, auto=True, far=far)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((NKV * HPK, HD)).astype(np.float32)
    k, v = _rows(rng, 24)                     # the prompt, its queries recorded
    parent.extend(k.reshape(24, NKV, HD), v.reshape(24, NKV, HD), layout="nhd")
    parent.attend_chunk(rng.standard_normal((24, NKV * HPK, HD)).astype(np.float32), 24, 0, HPK)
    fork, twin = parent.fork(), copy.deepcopy(parent)
    k, v = _rows(rng)
    for lay in (fork, twin):                  # the first decode row seals the fork (and the twin)
        lay.append(k[0], v[0])
    assert fork.lifecycle is kvreg.Lifecycle.SEALED and parent.lifecycle is kvreg.Lifecycle.COLLECTING
    assert np.array_equal(fork.attend_layer(q, sinks=None), twin.attend_layer(q, sinks=None))
    # the parent still holds its exact prompt: it answers as before the fork
    again = copy.deepcopy(parent)
    assert np.array_equal(parent.attend_layer(q), again.attend_layer(q))


def test_cache_fork_and_resident_bytes():
    cache = KvCache(3, NKV, HD, max_seq_len=1 << 20, mode="q8", backend="reference")
    rng = np.random.default_rng(0)
    for lay in cache.layers:
        k, v = _rows(rng, 64)
        lay.extend(k.reshape(64, NKV, HD), v.reshape(64, NKV, HD), layout="nhd")
    forks = [cache.fork() for _ in range(4)]
    assert kvreg.resident_bytes(cache, *forks) < 1.01 * cache.total_memory_bytes()
    assert forks[0].export_wire() == cache.export_wire()
    forks[0].evict(10)
    assert cache.layers[0].seq_len == 64 and forks[1].export_wire() == cache.export_wire()
    with pytest.raises(kvreg.ConfigError, match="resident_bytes takes"):
        kvreg.resident_bytes(cache, 3)
