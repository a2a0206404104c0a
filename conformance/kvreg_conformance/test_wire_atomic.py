"""Whole-cache imports are all or nothing, and what an import installs is
what the backend then reads (a regression case: a bad Bounded record after
good ones once failed at install, after the earlier layers had changed), for v2
records as for v3 records of quantized storage."""

import struct

import pytest

from kvreg import KvCache, KvMode, LayerKvCache, WireError
from kvreg.bounded import BoundedRope, BoundedWeights
from kvreg.wire import decode_cache, encode_cache

from .data import rng_rows

NKV, HD, HPK, W = 2, 16, 2, 8


def cache(backend, seed, inserts=13):
    """Layers: Full, Bounded (ring of W, stepped through the backend), Full."""
    c = KvCache(3, NKV, HD, 4096, mode=KvMode.F32, backend=backend)
    c.layers[1].install_bounded(W)
    k = rng_rows(seed, 24, NKV * HD)
    v = rng_rows(seed + 1, 24, NKV * HD)
    for i in (0, 2):
        for p in range(20):
            c.layers[i].append(k[p], v[p])
    for p in range(inserts):
        step(c.layers[1], seed + p)
    return c


def weights():
    return BoundedWeights(rng_rows(50, NKV * 2, HD).reshape(NKV, 2, HD),
                          rng_rows(51, NKV * 2, HD).reshape(NKV, 2, HD), 2, [W, W // 2])


def step(layer, seed):
    k, v = rng_rows(seed + 100, 2, NKV * HD)
    q = rng_rows(seed + 200, NKV * HPK, HD)
    return layer.bounded_step(q, k, v, weights(), BoundedRope(theta=10000.0), 0.25, NKV * HPK)


def state(c):
    return c.export_wire(), [(x.seq_len, x.base, x.generation) for x in c.layers]


def assert_refused_changes_nothing(check, backend, dst, blob, where, answers_of):
    """``dst.import_wire(blob)`` raises WireError and leaves every layer, and
    what ``answers_of(dst)`` answers, as it was."""
    before, outs = state(dst), answers_of(dst)
    try:
        dst.import_wire(blob)
    except WireError:
        pass
    else:
        raise AssertionError(f"kernel wire on backend {backend.name!r}: import accepted a container with {where}")
    check.equal("wire", state(dst) == before, True, f"{where}: a refused import left every layer as it was")
    for got, want in zip(answers_of(dst), outs):
        check.exact("attend_layer", got, want, f"{where}: answers after a refused import")


def answers(c):
    q = rng_rows(77, NKV * HPK, HD)
    outs = [c.layers[i].attend_layer(q, importance=False) for i in (0, 2)]
    return outs


@pytest.mark.quick
@pytest.mark.parametrize("where", ["ring nan", "ring inf", "last truncated", "last layer id"])
def test_a_bad_record_after_good_ones_changes_no_layer(backend, check, where):
    src, dst = cache(backend, 1), cache(backend, 2)
    parts = decode_cache(src.export_wire())
    if where.startswith("ring"):
        b = bytearray(parts[1])
        struct.pack_into("<f", b, 32 + 20 + 4 * 9, float("nan") if where == "ring nan" else float("-inf"))
        parts[1] = bytes(b)
    elif where == "last truncated":
        parts[2] = parts[2][:-3]
    else:
        b = bytearray(parts[2])
        struct.pack_into("<I", b, 16, 9)
        parts[2] = bytes(b)
    assert_refused_changes_nothing(check, backend, dst, encode_cache(parts), where, answers)


@pytest.mark.quick
def test_an_import_at_the_same_position_is_what_the_next_step_reads(backend, check):
    # dst's ring is at the same position as src's: only the contents differ,
    # so a device copy keyed on the position alone would answer from dst's rows.
    src, dst = cache(backend, 1), cache(backend, 2)
    blob = src.export_wire()
    dst.import_wire(blob)
    for p in range(3):
        check.exact("bounded_attend", step(dst.layers[1], 900 + p), step(src.layers[1], 900 + p),
                    f"step {p} after importing a ring at the same position")
    for got, want in zip(answers(dst), answers(src)):
        check.exact("attend_layer", got, want, "Full layers after the import")


def q8_cache(backend, mode, seed):
    """Three Full layers of a storage mode (v3 records), rows from ``seed``."""
    c = KvCache(3, NKV, HD, 4096, mode=mode, backend=backend, q8_exact_rows=2)
    for i, layer in enumerate(c.layers):
        n = 20 + 30 * i   # layer 2 passes the 2f freeze (64 rows), layer 0 does not
        layer.extend(rng_rows(seed + i, n, NKV * HD).reshape(n, NKV, HD),
                     rng_rows(seed + 10 + i, n, NKV * HD).reshape(n, NKV, HD))
    return c


@pytest.mark.quick
@pytest.mark.parametrize("mode", [KvMode.Q8, KvMode.Q8_2F, KvMode.Q8V], ids=lambda m: m.value)
@pytest.mark.parametrize("where", ["last truncated", "last mode", "last exact rows", "last lens"])
def test_a_bad_v3_record_after_good_ones_changes_no_layer(backend, check, mode, where):
    src, dst = q8_cache(backend, mode, 1), q8_cache(backend, mode, 2)
    parts = decode_cache(src.export_wire())
    check.equal("wire", [p[4] for p in parts], [3, 3, 3], "non-F32 layers write v3")
    b = bytearray(parts[2])
    m = struct.unpack_from("<I", b, 32)[0]
    if where == "last truncated":
        del b[-3:]
    elif where == "last mode":
        # a sound record of layer 2, but of another mode: refused by the mode policy
        other = LayerKvCache(NKV, HD, KvMode.Q8K if mode is not KvMode.Q8K else KvMode.Q8, backend,
                             layer=2, q8_exact_rows=2)
        other.append(rng_rows(5, 1, NKV * HD)[0], rng_rows(6, 1, NKV * HD)[0])
        b = bytearray(other.export_wire())
    elif where == "last exact rows":
        struct.pack_into("<I", b, 36 + m + 12, 3)
    else:
        struct.pack_into("<I", b, 36 + m + 28 + 4 * struct.unpack_from("<I", b, 36 + m + 20)[0], 999)
    parts[2] = bytes(b)
    q = rng_rows(77, NKV * HPK, HD)
    assert_refused_changes_nothing(check, backend, dst, encode_cache(parts), f"{mode.value} {where}",
                                   lambda c: [x.attend_layer(q, importance=False) for x in c.layers])
    # the good container installs, and the backend then reads what was sent
    good = src.export_wire()
    dst.import_wire(good)
    check.equal("wire", dst.export_wire() == good, True, "re-export of the installed container")
    for x, y in zip(dst.layers, src.layers):
        check.exact("attend_layer", x.attend_layer(q, importance=False), y.attend_layer(q, importance=False),
                    f"{mode.value}: the installed storage answers as the exporter's")
