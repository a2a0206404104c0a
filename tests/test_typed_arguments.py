"""Every integer argument takes Python and numpy integers with identical
results; out-of-range values and numbers float32 cannot hold are refused
with a kvreg error before anything changes."""

from fractions import Fraction

import numpy as np
import pytest

from kvreg import KvCache, KvMode, KvregError, LayerKvCache, ShapeError
from kvreg.bounded import BoundedState

INT_TYPES = [int, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


def busy(mode=KvMode.F32, rows=20, nkv=2, hd=4):
    c = LayerKvCache(nkv, hd, mode, "reference")
    rng = np.random.default_rng(3)
    for _ in range(rows):
        c.append(rng.standard_normal(nkv * hd).astype(np.float32), rng.standard_normal(nkv * hd).astype(np.float32))
    c.accumulate_imp(rng.random(rows).astype(np.float32))
    return c


def snapshot(c):
    st = c.storage
    return (type(c.seq_len), c.seq_len, type(c.base), c.base, c.pos_len, c.tail_window, st.lens.tolist(),
            c.imp.tobytes(), [c.head_keys(h).tobytes() for h in range(c.num_kv_heads)],
            [c.head_values(h).tobytes() for h in range(c.num_kv_heads)], c.kv_abs_max())


Q = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)

# (name, call(layer, T) -> result); T converts a Python int to the type under test.
CALLS = [
    ("trim_window", lambda c, T: c.trim_window(T(8), T(30), T(1))),
    ("trim_window drains", lambda c, T: c.trim_window(T(4), T(2), T(3))),
    ("trim_window_anchored", lambda c, T: c.trim_window_anchored(T(4), T(1), T(2), T(12))),
    ("evict", lambda c, T: c.evict(T(5))),
    ("evict_born", lambda c, T: c.evict_born(T(9), T(2), T(3))),
    ("truncate_last", lambda c, T: c.truncate_last(T(3))),
    ("attend", lambda c, T: c.attend(Q[0], T(1))),
    ("attend_group first upto", lambda c, T: c.attend_group(Q, T(1), scale=0.5, first=T(2), upto=T(11))),
    ("attend_group upto past rows", lambda c, T: c.attend_group(Q, T(0), scale=0.5, upto=T(200))),
    ("attend_layer window", lambda c, T: c.attend_layer(np.tile(Q, (2, 1)), window=T(7))),
    ("attend_layer window past rows", lambda c, T: c.attend_layer(np.tile(Q, (2, 1)), window=T(250))),
    ("head_len", lambda c, T: c.head_len(T(1))),
    ("head_keys", lambda c, T: c.head_keys(T(1)).tobytes()),
    ("seq_len setter", lambda c, T: setattr(c, "seq_len", T(25))),
    ("o1_boundary_crossed_by", lambda c, T: (c.o1_begin_with_boundary(T(4), T(2), T(1), seal_at=T(22), far="nystrom"),
                                             c.o1_boundary_crossed_by(T(3)), c.o1_pending_boundary())),
]


def _fits(t, values=(250, 200, 30, 25, 22, 12, 11, 9, 8, 7, 5, 4, 3, 2, 1)):
    return t is int or max(values) <= np.iinfo(t).max


@pytest.mark.parametrize("itype", INT_TYPES, ids=[t.__name__ for t in INT_TYPES])
@pytest.mark.parametrize("name,call", CALLS, ids=[c[0] for c in CALLS])
def test_numpy_integers_give_the_python_int_result(name, call, itype):
    if not _fits(itype):
        pytest.skip("value does not fit the type")
    want_layer, got_layer = busy(), busy()
    want = call(want_layer, int)
    got = call(got_layer, itype)
    assert snapshot(got_layer) == snapshot(want_layer)
    if isinstance(want, np.ndarray):
        assert got.tobytes() == want.tobytes()
    elif isinstance(want, tuple) and want and isinstance(want[0], np.ndarray):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want))
    else:
        assert got == want and type(got) is type(want)


def test_uint8_trim_does_not_wrap_the_base():
    # The reproduction: the window arithmetic wrapped at 256.
    c = busy()
    assert c.trim_window(np.uint8(8), np.uint8(30), np.uint8(1)) == 0
    assert (c.seq_len, c.base) == (20, 0) and type(c.base) is int


def test_numpy_seq_len_is_a_python_int():
    c = LayerKvCache(1, 4, KvMode.F32, "reference")
    c.seq_len = np.uint8(255)
    c.seq_len += 1
    assert c.seq_len == 256 and type(c.seq_len) is int


def test_cache_evict_takes_numpy_integers():
    a = KvCache(2, 2, 4, 64, mode="f32", backend="reference")
    b = KvCache(2, 2, 4, 64, mode="f32", backend="reference")
    for cache in (a, b):
        for layer in cache.layers:
            for i in range(12):
                layer.append(np.full(8, i, np.float32), np.full(8, -i, np.float32))
    a.evict(5)
    b.evict(np.uint64(5))
    assert [snapshot(x) for x in a.layers] == [snapshot(x) for x in b.layers]


BIG = [2**63, 2**64 - 1, np.uint64(2**64 - 1), 2**80]
OUT_OF_RANGE = [
    ("evict", lambda c, x: c.evict(x)),
    ("evict_born", lambda c, x: c.evict_born(x, 1, 1)),
    ("truncate_last", lambda c, x: c.truncate_last(x)),
    ("trim_window w", lambda c, x: c.trim_window(x, 0, 1)),
    ("trim_window slack", lambda c, x: c.trim_window(4, x, 1)),
    ("trim_window align", lambda c, x: c.trim_window(4, 0, x)),
    ("trim anchor", lambda c, x: c.trim_window_anchored(4, 0, 1, x)),
    ("attend_group upto", lambda c, x: c.attend_group(Q, 0, scale=0.5, upto=x)),
    ("attend_group first", lambda c, x: c.attend_group(Q, 0, scale=0.5, first=x)),
    ("attend_layer window", lambda c, x: c.attend_layer(np.tile(Q, (2, 1)), window=x)),
    ("attend_chunk s0", lambda c, x: c.attend_chunk(np.ones((1, 2, 4), np.float32), 1, x, 1)),
    ("attend_chunk b", lambda c, x: c.attend_chunk(np.ones((1, 2, 4), np.float32), x, 0, 1)),
    ("attend_chunk window", lambda c, x: c.attend_chunk(np.ones((1, 2, 4), np.float32), 1, 19, 1, window=x)),
    ("head_len", lambda c, x: c.head_len(x)),
    ("seq_len", lambda c, x: setattr(c, "seq_len", x)),
    ("o1_begin seal_at", lambda c, x: c.o1_begin_with_boundary(4, 2, 1, seal_at=x, far="nystrom")),
    ("install_bounded", lambda c, x: LayerKvCache(2, 4, KvMode.F32, "reference").install_bounded(x)),
]


@pytest.mark.parametrize("x", BIG + [-1, np.int64(-1)], ids=lambda x: f"{type(x).__name__}({x})")
@pytest.mark.parametrize("name,call", OUT_OF_RANGE, ids=[c[0] for c in OUT_OF_RANGE])
def test_out_of_range_integers_are_refused_before_any_change(name, call, x):
    c = busy()
    before = snapshot(c)
    with pytest.raises(KvregError):
        call(c, x)
    assert snapshot(c) == before


@pytest.mark.parametrize("value", [2**53 + 1, 2**62])
def test_positions_past_float64_resolution_are_refused(value):
    c = busy()
    with pytest.raises(ShapeError, match="2\\*\\*53"):
        c.seq_len = value
    with pytest.raises(ShapeError, match="2\\*\\*53"):
        c.trim_window_anchored(4, 0, 1, value)
    with pytest.raises(KvregError):
        BoundedState(1, 4, 2).load(np.zeros((1, 2, 4), np.float32), np.zeros((1, 2, 4), np.float32), value)


def test_install_bounded_past_int32_rows_is_a_kvreg_error():
    c = LayerKvCache(2, 4, KvMode.F32, "reference")
    with pytest.raises(KvregError, match="2147483647"):
        c.install_bounded(2**31)
    assert c.bounded is None


def test_bools_are_not_integers():
    c = busy()
    for call in (lambda: c.evict(np.bool_(True)), lambda: c.head_len(True), lambda: c.trim_window(np.True_, 0, 1)):
        with pytest.raises(ShapeError):
            call()


# ── real numbers ──

def test_fraction_scale_equals_the_float_scale():
    c = busy()
    want = c.attend_group(Q, 1, scale=0.5)
    assert c.attend_group(Q, 1, scale=Fraction(1, 2)).tobytes() == want.tobytes()
    assert c.attend_group(Q, 1, scale=0.5, softcap=Fraction(30)).tobytes() == \
        c.attend_group(Q, 1, scale=0.5, softcap=30.0).tobytes()


BAD_REALS = [1e39, -1e39, 1e-50, float("inf"), float("nan"), 0, -0.5, 10**400, Fraction(10**400), True,
             "0.5", complex(1, 0)]


@pytest.mark.parametrize("value", BAD_REALS, ids=repr)
def test_scales_float32_cannot_hold_are_refused(value):
    c = busy()
    before = (snapshot(c), c.imp.tobytes())
    for call in (lambda: c.attend_group(Q, 0, scale=value), lambda: c.attend_layer(np.tile(Q, (2, 1)), scale=value),
                 lambda: c.attend_chunk(np.ones((1, 2, 4), np.float32), 1, 19, 1, scale=value),
                 lambda: c.o1_begin(4, 2, 1, scale=value, far="nystrom")):
        with pytest.raises(ShapeError, match="scale"):
            call()
    assert (snapshot(c), c.imp.tobytes()) == before


@pytest.mark.parametrize("value", [1e39, float("inf"), -1.0, 10**400, "1"], ids=repr)
def test_softcaps_float32_cannot_hold_are_refused(value):
    c = busy()
    with pytest.raises(ShapeError, match="softcap"):
        c.attend_group(Q, 0, scale=0.5, softcap=value)


def test_non_contiguous_imp_acc_is_refused():
    c = busy()
    acc = np.zeros(40, np.float32)[::2]
    with pytest.raises(ShapeError, match="contiguous"):
        c.attend_group(Q, 0, scale=0.5, imp_acc=acc)
    assert not acc.any()


@pytest.mark.parametrize("mode", [KvMode.Q8_2F, KvMode.Q8K_2F, KvMode.Q8V_2F])
@pytest.mark.parametrize("value", [3e19, 2e18, -1e30])
def test_q8_rows_whose_field_would_overflow_are_refused(mode, value):
    c = busy(mode, rows=10)
    before = snapshot(c)
    row = np.full(8, 1.0, np.float32)
    row[3] = value
    with pytest.raises(ShapeError, match="1e\\+18"):
        c.append(row, row)
    assert snapshot(c) == before
    # 1e18 itself is storable, and the frozen field stays finite
    row[3] = 1e18
    for _ in range(70):
        c.append(row, row)
    st = c.storage
    assert st.field_frozen() and np.isfinite(st.kcol).all() and np.isfinite(st.vcol).all()


# ── every bad argument is a kvreg error, on every backend ──

BAD_ARGS = [-1, 2**63, np.uint64(2**64 - 1), 1.5, "3", None, Fraction(3, 2), True, np.array([3]), 2**53 + 1,
            float("nan"), 1e39, 2**64]


def _calls(be):
    from kvreg.bounded import BoundedRope, BoundedWeights

    def bstep(scale=0.5, nh=4):
        layer = LayerKvCache(2, 4, KvMode.F32, be)
        layer.install_bounded(4)
        w = BoundedWeights(np.zeros((2, 1, 4), np.float32), np.zeros((2, 1, 4), np.float32), 1, [4, 4])
        return layer.bounded_step(np.ones((4, 4), np.float32), np.ones(8, np.float32), np.ones(8, np.float32), w,
                                  BoundedRope(), scale, nh)

    q4 = np.ones((4, 4), np.float32)
    chunk = np.ones((1, 2, 4), np.float32)
    return {
        "attend kv_head": lambda c, x: c.attend(Q[0], x),
        "attend_group scale": lambda c, x: c.attend_group(Q, 0, scale=x),
        "attend_group first": lambda c, x: c.attend_group(Q, 0, scale=0.5, first=x),
        "attend_group upto": lambda c, x: c.attend_group(Q, 0, scale=0.5, upto=x),
        "attend_group softcap": lambda c, x: c.attend_group(Q, 0, scale=0.5, softcap=x),
        "attend_group imp_acc": lambda c, x: c.attend_group(Q, 0, scale=0.5, imp_acc=x),
        "attend_layer window": lambda c, x: c.attend_layer(q4, window=x),
        "attend_layer scale": lambda c, x: c.attend_layer(q4, scale=x),
        "attend_chunk b": lambda c, x: c.attend_chunk(chunk, x, 19, 1),
        "attend_chunk s0": lambda c, x: c.attend_chunk(chunk, 1, x, 1),
        "attend_chunk window": lambda c, x: c.attend_chunk(chunk, 1, 19, 1, window=x),
        "truncate_last": lambda c, x: c.truncate_last(x),
        "trim_window": lambda c, x: c.trim_window(x, 1, 1),
        "trim anchor": lambda c, x: c.trim_window_anchored(4, 1, 1, x),
        "evict": lambda c, x: c.evict(x),
        "evict_born": lambda c, x: c.evict_born(5, x, 1),
        "seq_len": lambda c, x: setattr(c, "seq_len", x),
        "install_bounded": lambda c, x: LayerKvCache(2, 4, KvMode.F32, be).install_bounded(x),
        "o1_begin scale": lambda c, x: c.o1_begin(4, 2, 1, scale=x, far="nystrom"),
        "LayerKvCache heads": lambda c, x: LayerKvCache(x, 4, KvMode.F32, be),
        "LayerKvCache q8_exact_rows": lambda c, x: LayerKvCache(2, 4, KvMode.Q8, be, q8_exact_rows=x),
        "LayerKvCache layer": lambda c, x: LayerKvCache(2, 4, KvMode.F32, be, layer=x),
        "KvCache layers": lambda c, x: KvCache(x, 2, 4, 10, backend=be),
        "KvCache evict": lambda c, x: KvCache(2, 2, 4, 10, backend=be).evict(x),
        "bounded_step scale": lambda c, x: bstep(scale=x),
        "bounded_step num_heads": lambda c, x: bstep(nh=x),
    }


@pytest.mark.parametrize("name", ["reference", "numba", "opencl"])
def test_bad_arguments_raise_kvreg_errors_on_every_backend(name):
    import kvreg

    try:
        be = kvreg.get_backend(name)
    except KvregError as exc:
        pytest.skip(str(exc))
    wrong = []
    for call_name, call in _calls(be).items():
        for x in BAD_ARGS:
            c = LayerKvCache(2, 4, KvMode.F32, be)
            for i in range(20):
                c.append(np.full(8, i * 0.1, np.float32), np.full(8, -i * 0.1, np.float32))
            try:
                call(c, x)
            except KvregError:
                pass
            except Exception as exc:  # noqa: BLE001
                wrong.append(f"{call_name}({x!r}): {type(exc).__name__}: {exc}")
    assert not wrong, "\n".join(wrong)


def test_geometry_past_any_model_is_refused():
    with pytest.raises(ShapeError, match="2\\*\\*24"):
        LayerKvCache(2**13, 2**12, KvMode.F32, "reference")
    with pytest.raises(ShapeError, match="num_layers"):
        KvCache(2**53, 2, 4, 10, backend="reference")


def test_a_hand_built_snapshot_past_2_53_is_refused_before_any_copy():
    import dataclasses

    from kvreg import ConfigError

    ring = BoundedState(1, 4, 2)
    ring.insert(np.ones(4, np.float32), np.ones(4, np.float32))
    snap = dataclasses.replace(ring.snapshot(), seen=2**64 - 1, ring_k=np.full((1, 2, 4), 7, np.float32))
    with pytest.raises(ConfigError, match="seen"):
        ring.restore(snap)
    assert ring.seen == 1 and ring.ring_k.max() == 1.0


def test_appends_stop_at_position_2_53():
    c = LayerKvCache(1, 4, KvMode.F32, "reference")
    c.seq_len = 2**53 - 1
    c.append(np.ones(4, np.float32), np.ones(4, np.float32))
    assert c.pos_len == 2**53
    with pytest.raises(ShapeError, match="2\\*\\*53"):
        c.append(np.ones(4, np.float32), np.ones(4, np.float32))
    with pytest.raises(ShapeError, match="2\\*\\*53"):
        c.extend(np.ones((3, 1, 4), np.float32), np.ones((3, 1, 4), np.float32))
    assert c.pos_len == 2**53 and c.storage.lens.tolist() == [1]


ODD = [None, 1.5, "3", [], np.array([3]), np.ones((2, 2)), (1, 2), object(), complex(1)]


@pytest.mark.parametrize("x", ODD + [-1, 2**64], ids=repr)
def test_header_fields_flags_and_chunk_maxima_are_checked_when_given(x):
    from kvreg import BackendError, ConfigError

    c = busy()
    before = snapshot(c)
    for call in (lambda: setattr(c, "wire_layer", x), lambda: setattr(c, "wire_identity", x),
                 lambda: setattr(c, "wire_kind", x), lambda: c.set_linear_wire_allowed(x),
                 lambda: c.export_wire(x), lambda: c.attend_layer(np.tile(Q, (2, 1)), importance=x),
                 lambda: c.kv_abs_max_after(x), lambda: c.kv_abs_max_after((x, 20, 1.0, 1.0)),
                 lambda: c.kv_abs_max_after((0, 20, -1.0 if isinstance(x, (int, float)) else x, 1.0))):
        with pytest.raises(KvregError):
            call()
    assert snapshot(c) == before and c.wire_kind == 0 and c.wire_layer == 0 and c.wire_identity == 0
    if x is not None and not isinstance(x, int):   # None: the default backend
        with pytest.raises(BackendError):
            LayerKvCache(2, 4, KvMode.F32, x)
    with pytest.raises(ConfigError):
        c.wire_kind = 3   # FullTail is what a Full layer becomes on the wire, not a layer kind


def test_header_fields_take_numpy_integers():
    c = busy()
    c.wire_layer, c.wire_identity, c.wire_kind = np.uint32(7), np.uint64(2**64 - 1), np.int8(0)
    d = LayerKvCache(2, 4, KvMode.F32, "reference", layer=np.int16(7))
    d.wire_identity = 2**64 - 1
    d.import_wire(c.export_wire(np.bool_(True)))
    assert type(d.wire_layer) is int and d.seq_len == 20
