"""Batched decode, bit for bit WITHIN the backend under test: one
``kvreg.attend_batch`` call over B sequences answers exactly what
``attend_layer`` answers per sequence (outputs and importance), whatever the
sequences' lengths, dead heads, windows, sinks and soft-capping."""

import numpy as np
import pytest

import kvreg

from .data import ALL_MODES, filled, queries, rng_rows

# Each case runs at the backend's tunables and at its small ones (conftest.py).
pytestmark = pytest.mark.usefixtures("tunables")

MODE_IDS = [m.value for m in ALL_MODES]


def _batch(backend, mode, lengths, nkv=2, hd=32, seed=0):
    """Two copies of each sequence: one for the batch, one for the loop."""
    pairs = []
    for b, n in enumerate(lengths):
        alive = [True] * nkv if b % 3 else [True] + [False] * (nkv - 1)   # every third: dead heads after its rows
        one, _, _ = filled(backend, nkv, hd, mode, n, seed=seed + 7 * b)
        two, _, _ = filled(backend, nkv, hd, mode, n, seed=seed + 7 * b)
        extra = rng_rows(seed + 90 + b, 2, 2 * nkv * hd)
        for lay in (one, two):
            if n:  # a ragged head: the sequence's last row reaches only its live heads
                lay.append(extra[0, :nkv * hd], extra[0, nkv * hd:], alive)
        pairs.append((one, two))
    return pairs


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("opt", ["plain", "window", "sinks_softcap"])
def test_attend_batch_equals_attend_layer_per_sequence(backend, check, mode, opt):
    nkv, hd, hpk = 2, 32, 3
    lengths = [70, 1, 33, 0, 129, 5]
    pairs = _batch(backend, mode, lengths, nkv, hd)
    kw = {"window": 9} if opt == "window" else {}
    if opt == "sinks_softcap":
        kw["softcap"] = 3.0
        sinks = rng_rows(77, 1, nkv * hpk, 2.0)[0]
        for one, two in pairs:
            one.sinks = two.sinks = sinks
    q = np.stack([queries(b, nkv * hpk, hd, 2.0) for b in range(len(lengths))])
    out = kvreg.attend_batch(q, [one for one, _ in pairs], scale=0.2, **kw)
    for b, (one, two) in enumerate(pairs):
        want = two.attend_layer(q[b], scale=0.2, **kw)
        check.exact("attend_batch", out[b], want, f"{mode.value} {opt} sequence {b} ({lengths[b]} rows)")
        check.exact("importance", one.imp, two.imp, f"{mode.value} {opt} sequence {b}: importance")


@pytest.mark.parametrize("mode", [m for m in ALL_MODES if m.value in ("f32", "q8")], ids=lambda m: m.value)
def test_attend_batch_of_one_and_repeated_steps(backend, check, mode):
    # A decode loop: append a row to every sequence, attend the batch, again.
    nkv, hd, hpk = 2, 32, 2
    pairs = _batch(backend, mode, [12, 40, 3], nkv, hd, seed=5)
    for step in range(3):
        rows = rng_rows(300 + step, len(pairs), 2 * nkv * hd)
        for b, (one, two) in enumerate(pairs):
            for lay in (one, two):
                lay.append(rows[b, :nkv * hd], rows[b, nkv * hd:])
        q = np.stack([queries(40 + step + b, nkv * hpk, hd) for b in range(len(pairs))])
        out = kvreg.attend_batch(q, [one for one, _ in pairs])
        for b, (_, two) in enumerate(pairs):
            check.exact("attend_batch", out[b], two.attend_layer(q[b]), f"{mode.value} step {step} seq {b}")
    single = kvreg.attend_batch(q[:1], [pairs[0][0]])
    check.exact("attend_batch", single[0], pairs[0][1].attend_layer(q[0]), f"{mode.value}: a batch of one")
