"""Reference-backend specifics: views, kernel invariants through its own primitives.

The Rust engine's own tests run on every backend in kvreg_conformance/test_reference_semantics.py."""

import numpy as np

from kvreg import KvMode, LayerKvCache
from kvreg.reference import key_scores, softmax_rows, value_pass


def f32(xs):
    return np.asarray(xs, dtype=np.float32)


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def pseudo_random_row(p, n, salt):
    i = np.arange(n)
    return f32(((p * 7919 + i * 104_729 + salt * 1_299_709) % 2003) / 1001.5 - 1.0)


def layer(nkv, hd):
    return LayerKvCache(nkv, hd, KvMode.F32, "reference")


def test_head_keys_is_a_view_not_a_copy():
    cache = layer(2, 4)
    cache.append(np.ones(8, np.float32), np.ones(8, np.float32))
    view = cache.head_keys(0)
    assert np.shares_memory(view, cache.storage.k)
    assert not view.flags.writeable


def test_recent_eviction_keeps_the_newest_rows_in_order():
    c = layer(1, 2)
    for p in range(6):
        c.append(np.full(2, p, np.float32), np.full(2, p, np.float32))
    c.evict(3)
    assert c.head_keys(0)[:, 0].tolist() == [3.0, 4.0, 5.0]


def _grouped_fixture(mode, kv_heads=2, hd=32, rows=70):
    c = LayerKvCache(kv_heads, hd, mode, "reference")
    i = np.arange(kv_heads * hd)
    for p in range(rows):
        c.append(f32(((i * 31 + p * 17 + 3) % 97) / 97.0 - 0.5), f32(((i * 13 + p * 29 + 7) % 89) / 89.0 - 0.5))
    return c


def test_attend_layer_equals_attend_group_per_group_bit_for_bit():
    c = _grouped_fixture(KvMode.F32, 2, 32)
    q = np.random.default_rng(0).standard_normal((6, 32)).astype(np.float32)
    sinks = f32([0.3, -1.0, 2.0, 0.0, 1.5, -0.5])
    imp_layer = np.zeros(70, np.float32)
    c.sinks = sinks
    before = c.imp.copy()
    out = c.attend_layer(q, scale=0.2, window=17, softcap=5.0)
    imp_layer = c.imp - before
    imp_ref = np.zeros(70, np.float32)
    for g in range(2):
        og = c.attend_group(q[g * 3:(g + 1) * 3], g, scale=0.2, first=70 - 17, softcap=5.0,
                            sinks=sinks[g * 3:(g + 1) * 3], imp_acc=imp_ref)
        assert np.array_equal(bits(out[g * 3:(g + 1) * 3]), bits(og))
    assert np.allclose(imp_layer, imp_ref, atol=1e-6)


def test_windowed_attend_equals_masked_full_row():
    nkv, hd, hpk, rows = 1, 16, 2, 40
    c = layer(nkv, hd)
    i = np.arange(hd)
    for r in range(rows):
        c.append(f32(((r * 13 + i * 5) % 29) / 29.0 - 0.5), f32(((r * 7 + i * 3) % 31) / 31.0 - 0.5))
    q = f32(((np.arange(hpk * hd) * 19) % 23) / 23.0 - 0.5).reshape(hpk, hd)
    scale = np.float32(0.25)
    st = c.storage.view()
    for w in (1, 7, 39, 40, 100):
        first = max(rows - w, 0)
        imp = np.zeros(rows, np.float32)
        out = c.attend_group(q, 0, scale=scale, first=first, imp_acc=imp)
        # Reference: the whole row scored, -inf before the window, softmax over
        # the full row; the library's own score/value primitives on the rows.
        s = np.full((hpk, rows), -np.inf, np.float32)
        s[:, first:] = key_scores(st, 0, q, first, rows) * scale
        p = softmax_rows(s, None)
        assert (p[:, :first] == 0).all()
        out_ref = value_pass(st, 0, p[:, first:], first, rows)
        imp_ref = p.sum(axis=0, dtype=np.float32) if hpk == 1 else (p[0] + p[1])
        assert np.array_equal(bits(out), bits(out_ref)), f"out window {w}"
        assert np.array_equal(bits(imp), bits(imp_ref)), f"imp window {w}"


def test_a_backend_without_the_fused_step_goes_straight_to_the_two_calls(monkeypatch):
    # append_attend asks the storage for the one-launch step only where the
    # backend overrides Backend.append_attend_layer (the reference does not)
    from kvreg.storage import Storage

    lay = LayerKvCache(2, 16, "f32", "reference")
    rng = np.random.default_rng(4)
    k, v = rng.standard_normal((2, 2, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    def asked(*a, **kw):
        raise AssertionError("asked for the fused step")

    monkeypatch.setattr(Storage, "append_row_attend_by", asked)
    got = lay.append_attend(k, v, q)
    ref = LayerKvCache(2, 16, "f32", "reference")
    ref.append(k, v)
    np.testing.assert_array_equal(got, ref.attend_layer(q))
    assert lay.seq_len == 1
