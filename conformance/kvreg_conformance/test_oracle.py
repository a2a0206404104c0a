"""The tolerance class: the backend under test against the float64 oracle.

Outputs, probabilities and importance of ``attend`` / ``attend_group`` /
``attend_layer`` (every KV mode; q8 rows are dequantized by the oracle so the
kernel math is checked, not the quantization error), ``attend_chunk``, the q8
field freeze, bounded attention and the Nyström decode step. Tolerances:
conformance/tolerances.py.
"""

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache
from kvreg.bounded import BoundedRope, BoundedWeights
from kvreg.quant import dequantize_rows

from . import oracle
from .data import ALL_MODES, filled, queries, rng_rows

# Each case runs at the backend's tunables and at its small ones (conftest.py).
pytestmark = pytest.mark.usefixtures("tunables")

MODE_IDS = [m.value for m in ALL_MODES]


@pytest.mark.quick
@pytest.mark.parametrize("exact_rows", [0, 1, 4], ids=lambda x: f"x{x}")
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_attend_outputs_and_probabilities_match_the_oracle(backend, check, mode, exact_rows):
    nkv, hd, rows = 2, 40, 90
    c, _, _ = filled(backend, nkv, hd, mode, rows, seed=100, exact_rows=exact_rows)
    scale = 1.0 / np.sqrt(hd)
    for g in range(nkv):
        q = queries(100 + g, 1, hd, 3.0)
        out, probs = c.attend(q[0], g)
        o, p, _, _ = oracle.attend_group_oracle(c.storage, g, q, scale=scale)
        check.close("attend_group", out, o[0], f"{mode.value} head {g}: attend output")
        check.close("attend_probs", probs, p[0], f"{mode.value} head {g}: attend probabilities")


CASES = {
    "plain": dict(first=0, upto=None, softcap=0.0, sinks=False),
    "first": dict(first=31, upto=None, softcap=0.0, sinks=False),
    "first_in_exact": dict(first=2, upto=None, softcap=0.0, sinks=False),
    "upto_in_exact": dict(first=1, upto=3, softcap=1.0, sinks=True),
    "upto": dict(first=0, upto=50, softcap=0.0, sinks=False),
    "softcap": dict(first=0, upto=None, softcap=1.5, sinks=False),
    "sinks": dict(first=0, upto=None, softcap=0.0, sinks=True),
    "all": dict(first=20, upto=77, softcap=2.0, sinks=True),
    "last_row": dict(first=89, upto=None, softcap=0.0, sinks=True),
}


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("hpk", [1, 4])
def test_attend_group_matches_the_oracle(backend, check, mode, case, hpk):
    nkv, hd, rows = 2, 24, 90
    c, _, _ = filled(backend, nkv, hd, mode, rows, seed=110 + hpk)
    o = CASES[case]
    sinks = rng_rows(111, 1, hpk, 2.0)[0] if o["sinks"] else None
    for g in range(nkv):
        q = queries(110 + g, hpk, hd, 3.0)
        imp = np.zeros(rows, np.float32)
        out = c.attend_group(q, g, scale=0.25, first=o["first"], upto=o["upto"], softcap=o["softcap"],
                             sinks=sinks, imp_acc=imp)
        want, p, f0, n = oracle.attend_group_oracle(c.storage, g, q, scale=0.25, first=o["first"],
                                                    upto=o["upto"], softcap=o["softcap"], sinks=sinks)
        what = f"{mode.value} {case} hpk {hpk} group {g}"
        check.close("attend_group", out, want, what)
        check.close("importance", imp, oracle.importance_delta(p, f0, n, rows), what)


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("window", [None, 1, 10, 90], ids=lambda w: f"w{w}")
def test_attend_layer_matches_the_oracle(backend, check, mode, window):
    nkv, hd, hpk, rows = 2, 32, 3, 80
    c, _, _ = filled(backend, nkv, hd, mode, rows, seed=120, alive=None)
    sinks = rng_rows(121, 1, nkv * hpk, 2.0)[0]
    c.sinks = sinks
    q = queries(120, nkv * hpk, hd, 3.0)
    before = c.imp.astype(np.float64)
    out = c.attend_layer(q, scale=0.2, window=window, softcap=3.0)
    want, imp = oracle.attend_layer_oracle(c.storage, q, scale=0.2, window=window, softcap=3.0, sinks=sinks)
    check.close("attend_layer", out, want, f"{mode.value} window {window}")
    check.close("importance", c.imp, before + imp, f"{mode.value} window {window}: attend_layer importance")


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("window", [None, 1, 7, 64], ids=lambda w: f"w{w}")
def test_attend_chunk_matches_the_oracle(backend, check, mode, window):
    nkv, hd, hpk, s0, b = 2, 16, 2, 70, 12
    c, _, _ = filled(backend, nkv, hd, mode, s0 + b, seed=130)
    q = queries(130, b * nkv * hpk, hd, 2.0).reshape(b, nkv * hpk, hd)
    before = c.imp.astype(np.float64)
    keys = [oracle.head_keys64(c.storage, g) for g in range(nkv)]
    vals = [oracle.head_values64(c.storage, g) for g in range(nkv)]
    out = c.attend_chunk(q, b, s0, hpk, scale=0.3, window=window)
    want, imp = oracle.attend_chunk_oracle(keys, vals, q, s0=s0, b=b, hpk=hpk, scale=0.3, window=window)
    check.close("attend_chunk", out, want, f"{mode.value} window {window}")
    check.close("attend_chunk_importance", c.imp, before + imp, f"{mode.value} window {window}")


@pytest.mark.quick
@pytest.mark.parametrize("mode", [KvMode.Q8_2F, KvMode.Q8K_2F, KvMode.Q8V_2F], ids=lambda m: m.value)
def test_freeze_field_is_the_rms_of_the_stored_rows(backend, check, mode):
    nkv, hd = 2, 40
    c, k, v = filled(backend, nkv, hd, mode, 64, seed=140, alive=[True, True])
    st = c.storage
    before = {}
    for h in range(nkv):
        if mode.quant_k:
            before["k", h] = dequantize_rows(st.kq[h, :64], st.ks[h, :64], 32).astype(np.float64)
        if mode.quant_v:
            before["v", h] = dequantize_rows(st.vq[h, :64], st.vs[h, :64, None], hd).astype(np.float64)
    c.append(k[0], v[0])       # the 65th append freezes the field first
    assert st.field_frozen()
    for (which, h), rows in before.items():
        col = st.kcol[h] if which == "k" else st.vcol[h]
        check.close("freeze_rms", col, oracle.field_rms_oracle(rows), f"{mode.value}: {which} field of head {h}")


def _bounded_setup(kvh, hd, window, hpk, sink, seed):
    rope = BoundedRope(theta=10000.0)
    sk = rng_rows(seed, kvh * sink, hd).reshape(kvh, sink, hd) if sink else np.zeros((kvh, 0, hd), np.float32)
    sv = rng_rows(seed + 1, kvh * sink, hd).reshape(kvh, sink, hd) if sink else np.zeros((kvh, 0, hd), np.float32)
    gws = [window] + [max(1, window // 2)] * (kvh - 1)
    return rope, BoundedWeights(sk, sv, sink, gws)


@pytest.mark.quick
@pytest.mark.parametrize("sink", [0, 2])
def test_bounded_attend_matches_the_oracle(backend, check, sink):
    kvh, hd, window, hpk = 2, 16, 8, 2
    c = LayerKvCache(kvh, hd, KvMode.F32, backend)
    c.install_bounded(window)
    rope, weights = _bounded_setup(kvh, hd, window, hpk, sink, 150)
    scale = hd ** -0.5
    for t in range(20):
        k, v = rng_rows(151 + t, 1, kvh * hd)[0], rng_rows(251 + t, 1, kvh * hd)[0]
        q = queries(150 + t, kvh * hpk, hd, 2.0)
        out = c.bounded_step(q, k, v, weights, rope, scale, kvh * hpk)
        b = c.bounded
        want = oracle.bounded_attend_oracle(q, b.ring_k, b.ring_v, b.seen, weights.sink_k, weights.sink_v,
                                            weights.group_windows, rope, scale, kvh * hpk)
        check.close("bounded_attend", out, want, f"sink {sink}, step {t}")


@pytest.mark.quick
@pytest.mark.parametrize("q_scale, steps", [(1.5, 12), (3.0, 40)])
def test_nystrom_step_matches_the_oracle(backend, check, q_scale, steps):
    # Both cases take the pooled fallback on some reads (its Jensen floor);
    # the longer one with sharper queries also fails the value-box check on
    # some (8 of 80 reads when written), so every branch of the read is compared.
    nkv, hd, hpk, t0 = 1, 16, 2, 60
    m, w, sink = 6, 10, 3
    nh = nkv * hpk
    scale = hd ** -0.5
    total = t0 + steps
    k = rng_rows(160, total, nkv * hd)
    v = rng_rows(161, total, nkv * hd)
    q = rng_rows(162, total, nh * hd, q_scale)
    c = LayerKvCache(nkv, hd, KvMode.F32, backend)
    c.o1_begin(m, w, sink, scale=scale, far="nystrom")
    for p in range(t0):
        c.o1_push_q(q[p])
        c.append(k[p], v[p])
    assert c.o1_seal_checked(nh)
    trace = q[:t0].reshape(t0, nh, hd).transpose(1, 0, 2)
    for p in range(t0, total):
        out = c.o1_step(q[p].reshape(nh, hd), k[p], v[p], nh)
        want = oracle.nystrom_oracle(trace, k, v, t0, p, q[p].reshape(nh, hd), m=m, w=w, sink=sink, scale=scale,
                                     rcond=1e-3)
        check.close("nystrom_step", out, want, f"step at position {p}")


@pytest.mark.quick
def test_bounded_ring_equals_a_sliding_window_f32_layer(backend, check):
    # The ring stores raw keys and rotates them at their positions; an
    # unbounded F32 layer fed the same keys pre-rotated and attended with a
    # window of W rows must answer the same (no sinks).
    kvh, hd, window, hpk = 2, 16, 6, 2
    nh = kvh * hpk
    ring = LayerKvCache(kvh, hd, KvMode.F32, backend)
    ring.install_bounded(window)
    flat = LayerKvCache(kvh, hd, KvMode.F32, backend)
    rope = BoundedRope(theta=10000.0)
    empty = np.zeros((kvh, 0, hd), np.float32)
    weights = BoundedWeights(empty, empty, 0, [window] * kvh)
    scale = hd ** -0.5
    for t in range(3 * window + 2):
        k = rng_rows(170 + t, 1, kvh * hd)[0].reshape(kvh, hd)
        v = rng_rows(270 + t, 1, kvh * hd)[0].reshape(kvh, hd)
        q = queries(370 + t, nh, hd, 2.0)
        out = ring.bounded_step(q, k, v, weights, rope, scale, nh)
        flat.append(rope.apply(k[:, None, :], [t])[:, 0, :], v)
        qr = rope.apply(q[:, None, :], [t])[:, 0, :]
        n = flat.seq_len
        want = np.concatenate([flat.attend_group(qr[g * hpk:(g + 1) * hpk], g, scale=scale,
                                                 first=max(n - window, 0)) for g in range(kvh)])
        check.close("bounded_attend", out, want, f"step {t}")
