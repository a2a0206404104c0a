"""Every bad input is a clear kvreg error, raised before anything changes."""

import numpy as np
import pytest

from kvreg import ConfigError, KvCache, KvMode, KvregError, LayerKvCache, ShapeError, StateError


def busy(mode=KvMode.F32):
    c = LayerKvCache(2, 4, mode, "reference")
    rng = np.random.default_rng(0)
    for _ in range(6):
        c.append(rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32))
    c.accumulate_imp(np.arange(6, dtype=np.float32))
    return c


def state(c):
    st = c.storage
    return (c.seq_len, c.base, c.generation, c.tail_window, st.lens.tolist(), c.imp.tolist(),
            [c.head_keys(h).tolist() for h in range(2)], [c.head_values(h).tolist() for h in range(2)],
            st.kcol_set.tolist(), c.kv_abs_max() if False else None)


Q2 = np.ones((2, 4), np.float32)

BAD_CALLS = [
    ("append wrong length", lambda c: c.append(np.ones(7, np.float32), np.ones(8, np.float32)), "expected (8,)"),
    ("append wrong 2-d shape", lambda c: c.append(np.ones((4, 2), np.float32), np.ones(8, np.float32)),
     "expected (8,) or (2, 4)"),
    ("append lossy float64", lambda c: c.append(np.full(8, 0.1), np.ones(8, np.float32)), "float32"),
    ("append complex", lambda c: c.append(np.ones(8, complex), np.ones(8, np.float32)), "float32"),
    ("append strings", lambda c: c.append(["a"] * 8, np.ones(8, np.float32)), "float32"),
    ("append alive wrong length", lambda c: c.append(np.ones(8, np.float32), np.ones(8, np.float32), [True]),
     "2 booleans"),
    ("attend head out of range", lambda c: c.attend(np.ones(4, np.float32), 2), "kv_head"),
    ("attend wrong q", lambda c: c.attend(np.ones(5, np.float32), 0), "q"),
    ("group first out of range", lambda c: c.attend_group(Q2, 0, scale=0.5, first=6), "first=6"),
    ("group negative upto", lambda c: c.attend_group(Q2, 0, scale=0.5, upto=-1), "upto"),
    ("group sink length", lambda c: c.attend_group(Q2, 0, scale=0.5, sinks=[1.0]), "one per Q head"),
    ("group bad scale", lambda c: c.attend_group(Q2, 0, scale=0.0), "scale"),
    ("group bad softcap", lambda c: c.attend_group(Q2, 0, scale=0.5, softcap=-1.0), "softcap"),
    ("group imp not f32", lambda c: c.attend_group(Q2, 0, scale=0.5, imp_acc=np.zeros(6)), "imp_acc"),
    ("layer heads not a multiple", lambda c: c.attend_layer(np.ones((3, 4), np.float32)), "multiple"),
    ("layer window zero", lambda c: c.attend_layer(np.ones((2, 4), np.float32), window=0), "window"),
    ("chunk rows mismatch", lambda c: c.attend_chunk(np.ones((2, 2, 4), np.float32), 2, 5, 1), "s0+b=7"),
    ("truncate negative", lambda c: c.truncate_last(-1), "n_drop"),
    ("trim bool", lambda c: c.trim_window(True, 0, 1), "w"),
    ("evict negative", lambda c: c.evict(-2), "keep_last"),
    ("evict_born float", lambda c: c.evict_born(2.5, 1, 1), "keep_last"),
    ("head_len out of range", lambda c: c.head_len(-1), "kv_head"),
    ("mode change with rows", lambda c: setattr(c, "mode", "q8"), "clear()"),
    ("sinks 2-d", lambda c: setattr(c, "sinks", np.ones((2, 2), np.float32)), "1-D"),
    ("o1_step unsealed", lambda c: c.o1_step(Q2, np.ones(8), np.ones(8), 2), "not sealed"),
    ("bounded_step without ring", lambda c: c.bounded_step(Q2, np.ones(8), np.ones(8), None, None, 0.5, 2),
     "install_bounded"),
]


@pytest.mark.parametrize("name,call,needle", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input_is_a_clear_error_and_changes_nothing(name, call, needle):
    c = busy()
    before = state(c)
    with pytest.raises(KvregError) as exc:
        call(c)
    assert needle in str(exc.value), str(exc.value)
    assert state(c) == before


def test_q8_refuses_non_finite_rows_and_changes_nothing():
    c = busy(KvMode.Q8)
    before = (state(c), c.memory_bytes())
    bad = np.ones(8, np.float32)
    bad[3] = np.inf
    with pytest.raises(ShapeError, match="inf/NaN"):
        c.append(bad, np.ones(8, np.float32))
    assert (state(c), c.memory_bytes()) == before


def test_q8_accepts_non_finite_rows_of_a_dead_head():
    c = LayerKvCache(2, 4, KvMode.Q8, "reference")
    k = np.ones(8, np.float32)
    k[5] = np.nan
    c.append(k, np.ones(8, np.float32), np.array([True, False]))
    assert c.head_len(0) == 1 and c.head_len(1) == 0


def test_kv_mode_from_env(monkeypatch):
    for value, mode in (("q8", KvMode.Q8), ("q8_2f", KvMode.Q8_2F), ("q8k", KvMode.Q8K), ("q8v", KvMode.Q8V),
                        ("q8k_2f", KvMode.Q8K_2F), ("q8v_2f", KvMode.Q8V_2F), ("f32", KvMode.F32), ("Q8", KvMode.Q8),
                        ("f16", KvMode.F16), ("BF16", KvMode.BF16)):
        monkeypatch.setenv("KVREG_KV", value)
        assert KvMode.from_env() is mode
    monkeypatch.delenv("KVREG_KV")
    assert KvMode.from_env() is KvMode.F32
    monkeypatch.setenv("KVREG_KV", "int4")
    with pytest.raises(ConfigError, match="accepted: ") as err:
        KvMode.from_env()
    accepted = str(err.value).split("accepted: ")[1].split(" (")[0].split(", ")
    assert sorted(accepted) == sorted(m.value for m in KvMode)


def test_cache_refuses_bad_policy_and_sizes():
    with pytest.raises(ConfigError, match="EvictionPolicy"):
        KvCache(1, 1, 4, 8, policy="recent")
    with pytest.raises(ShapeError, match="num_layers"):
        KvCache(0, 1, 4, 8)


def test_attends_from_threads_on_different_caches_agree_with_serial():
    from concurrent.futures import ThreadPoolExecutor

    caches = [busy() for _ in range(4)]
    q = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32)
    serial = [c.attend_layer(q, importance=False) for c in caches]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            par = list(pool.map(lambda c: c.attend_layer(q, importance=False), caches))
            assert all(np.array_equal(a, b) for a, b in zip(serial, par))


def test_state_error_is_a_runtime_error():
    assert issubclass(StateError, RuntimeError) and issubclass(ShapeError, ValueError)


def test_linear_state_takes_floats_and_refuses_the_rest():
    c = LayerKvCache(1, 4, "f32", "reference")
    c.linear_state = [0.5, -0.25]
    assert c.linear_state.dtype == np.float32 and c.linear_state.tolist() == [0.5, -0.25]
    with pytest.raises(ShapeError, match="1-D"):
        c.linear_scratch = np.ones((2, 2), np.float32)
    assert c.linear_scratch.size == 0


def test_a_repeated_decode_call_answers_as_a_fresh_layer_after_each_change():
    # attend_layer memoizes its resolved arguments between decode steps:
    # each thing they depend on (sinks, scale, window, the capacity a
    # window is clamped to) must still reach the kernel when it changes.
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((300, 2, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)

    def layer(n, sinks=None):
        lay = LayerKvCache(2, 16, "f32", "reference")
        lay.extend(rows[:n], rows[:n])
        lay.sinks = sinks
        return lay

    lay = layer(30)
    calls = [dict(), dict(scale=0.5), dict(window=4), dict(window=4, scale=0.5), dict()]
    for kw in calls:
        got = lay.attend_layer(q, importance=False, **kw)
        np.testing.assert_array_equal(got, layer(30).attend_layer(q, importance=False, **kw))
    s1, s2 = np.full(4, 0.5, np.float32), np.full(4, -3.0, np.float32)
    for sinks in (s1, s2, None):
        lay.sinks = sinks
        np.testing.assert_array_equal(lay.attend_layer(q, importance=False),
                                      layer(30, sinks).attend_layer(q, importance=False))
    np.testing.assert_array_equal(lay.attend_layer(q, importance=False, sinks=None),
                                  layer(30).attend_layer(q, importance=False, sinks=None))
    fresh = layer(30)                    # importance: into the layer's current array
    for lay_ in (lay, fresh):
        lay_.attend_layer(q)
        lay_._st.reserve(lay_._st.cap * 4)   # reallocates the importance array
        lay_.attend_layer(q)
        lay_.append(rows[30], rows[30])      # one more row the next call's importance covers
        lay_.attend_layer(q)
    np.testing.assert_array_equal(lay.imp, fresh.imp)
    assert lay.imp.shape == (31,) and lay.imp[30] > 0
    with pytest.raises(ShapeError):      # a bad argument is refused, memo or not
        lay.attend_layer(q[:3], importance=False)
    for bad in (dict(scale=np.array([0.5, 0.5])), dict(window=np.array([3, 4])), dict(scale=-1.0)):
        with pytest.raises(KvregError):
            lay.attend_layer(q, importance=False, **bad)
    cap = lay._st.cap                    # a window past it is clamped to it
    w = cap + 5
    lay.attend_layer(q, importance=False, window=w)
    lay.extend(rows[31:cap + 10], rows[31:cap + 10])   # grows the capacity
    assert lay._st.cap > cap
    np.testing.assert_array_equal(lay.attend_layer(q, importance=False, window=w),
                                  layer(cap + 10).attend_layer(q, importance=False, window=w))
