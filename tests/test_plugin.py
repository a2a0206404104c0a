"""The kernel boundary (kvreg.plugin): typed kernels, declared capabilities,
read-only views whose version moves on every mutation."""

import inspect

import numpy as np
import pytest

import kvreg
from kvreg import registry
from kvreg.bounded import BoundedRope, BoundedState, BoundedWeights
from kvreg.plugin import CAPABILITIES, CORE_KERNELS, KERNELS, Backend, KvView, RingView
from kvreg.reference import ReferenceBackend

RNG = np.random.default_rng(0)


def rows(n, nkv=2, hd=8):
    return RNG.standard_normal((n, nkv, hd)).astype(np.float32)


def test_the_core_kernels_are_abstract_and_every_kernel_has_a_full_signature():
    assert set(Backend.__abstractmethods__) == set(CORE_KERNELS)
    for name in KERNELS + CAPABILITIES["fused_decode"]:
        params = inspect.signature(getattr(Backend, name)).parameters.values()
        assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params), name
        assert getattr(Backend, name).__doc__, f"{name} states its contract"


@pytest.mark.parametrize("name", ["reference", "numba", "opencl"])
def test_backends_keep_the_interface_signatures(name):
    cls = registry.backends()[name]
    for kernel in cls.native_kernels():
        want = inspect.signature(getattr(Backend, kernel))
        got = inspect.signature(getattr(cls, kernel))
        assert [(p.name, p.kind) for p in got.parameters.values()] == \
               [(p.name, p.kind) for p in want.parameters.values()], f"{name}.{kernel}"


def test_the_registry_refuses_an_abstract_backend_naming_its_missing_kernels():
    class Half(Backend):
        name = "half_test"

        def gather_rows(self, rows, idx):
            return rows[idx]

    class Plugin:
        @kvreg.hookspecs.hookimpl
        def kvreg_register_backends(self, register):
            register(Half)

    p = Plugin()
    registry.register_plugin(p)
    try:
        with pytest.warns(UserWarning, match="does not implement"):
            errors = registry.load_errors()
        assert "attend_layer" in errors["half_test"] and "gather_rows" not in errors["half_test"], errors
        assert "half_test" not in registry.backends() and "reference" in registry.backends()
    finally:
        registry.unregister_plugin(p)
        registry.refresh()


@pytest.mark.parametrize("provides,override,why", [
    ({"bounded_ring"}, False, "declares 'bounded_ring' but overrides none of its kernels"),
    (set(), True, "overrides bounded_attend without declaring 'bounded_ring'"),
    ({"teleport"}, False, "provides unknown capabilities teleport"),
])
def test_the_registry_refuses_a_capability_declaration_the_class_does_not_back(provides, override, why):
    attrs = {"name": "declared_test", "provides": frozenset(provides)}
    if override:
        attrs["bounded_attend"] = lambda self, q, ring, *, scale, num_heads: None
    cls = type("Declared", (ReferenceBackend,), attrs)

    class Plugin:
        @kvreg.hookspecs.hookimpl
        def kvreg_register_backends(self, register):
            register(cls)

    p = Plugin()
    registry.register_plugin(p)
    try:
        with pytest.warns(UserWarning, match=why):
            errors = registry.load_errors()
        assert why in errors["declared_test"] and "declared_test" not in registry.backends()
    finally:
        registry.unregister_plugin(p)
        registry.refresh()


def test_a_backend_of_the_core_kernels_alone_runs_every_capability_as_the_reference():
    # The capabilities' kernels are Backend's own (the reference's code):
    # a backend needs the core kernels only.
    core = {name: getattr(ReferenceBackend, name) for name in CORE_KERNELS}
    cls = type("CoreOnly", (Backend,), dict(core, name="core_only_test"))
    assert not cls.__abstractmethods__ and cls.declaration_error() is None
    assert cls.native_kernels() == list(CORE_KERNELS) and cls.capabilities()["provides"] == []
    lay = kvreg.LayerKvCache(2, 16, "f32", cls())
    lay.install_bounded(4)
    rng = np.random.default_rng(0)
    w = BoundedWeights(np.zeros((2, 0, 16), np.float32), np.zeros((2, 0, 16), np.float32), 0, [4, 4])
    out = lay.bounded_step(rng.standard_normal((4, 16)).astype(np.float32),
                           rng.standard_normal((2, 16)).astype(np.float32),
                           rng.standard_normal((2, 16)).astype(np.float32), w, BoundedRope(10000.0), 0.25, 4)
    assert out.shape == (4, 16) and np.isfinite(out).all()


def test_capabilities_are_declared_attributes():
    caps = ReferenceBackend.capabilities()
    assert caps["native_kernels"] == list(KERNELS)
    numba = registry.backends()["numba"].capabilities()
    assert numba["parallel_seal"] and "q4" not in numba["native_modes"] and "q8" in numba["native_modes"]
    opencl = registry.backends()["opencl"].capabilities()
    assert opencl["native_q8_chunk"] and opencl["device_resident"]


def test_kvreg_info_prints_the_declarations(capsys):
    from kvreg.cli import main

    main(["info"])
    out = capsys.readouterr().out
    assert "native KV modes:" in out and "declares: parallel_seal" in out


# ── views ──

def test_a_view_is_immutable_and_its_arrays_read_only():
    c = kvreg.LayerKvCache(2, 8, backend="reference")
    c.extend(rows(5), rows(5))
    v = c.storage.view()
    assert isinstance(v, KvView) and v.version == c.storage.version
    with pytest.raises(AttributeError):
        v.dense = None
    with pytest.raises(AttributeError):
        v.dense.k = None
    for a in (v.dense.k, v.dense.v, v.lens):
        with pytest.raises(ValueError):
            a[0] = 0
    assert c.storage.view() is v, "one view per version"


@pytest.mark.parametrize("mode", ["f32", "f16", "q8", "q8_2f"])
def test_every_view_holds_the_counts_at_its_version(mode):
    """A view's counts equal the storage's at its version, whatever moved
    them (an unquantized view keeps the counts that cannot move between
    views; the test holds it to every mutation that rewrites them)."""
    c = kvreg.LayerKvCache(2, 8, mode, backend="reference")
    views = []

    def check():
        st = c.storage
        v = st.view()
        for name in ("lens", "xlen", "b8", "b4", "kcol_set", "vcol_set"):
            b = v.lens if name == "lens" else v.array(name)
            if b is not None:
                assert np.array_equal(getattr(st, name), b) and not b.flags.writeable, name
        views.append((v, {n: None if (a := v.lens if n == "lens" else v.array(n)) is None else a.copy()
                          for n in ("lens", "xlen", "kcol_set", "vcol_set")}))

    c.extend(rows(70), rows(70))      # q8_2f's field freezes at 64 rows
    check()
    c.append(rows(1)[0], rows(1)[0])
    check()
    c.append(rows(1)[0], rows(1)[0], alive=[True, False])
    check()
    c.truncate_last(3)
    check()
    c.evict(20)
    check()
    c.clear()
    check()
    c.extend(rows(3), rows(3))
    check()
    for v, counts in views:           # each view kept the counts of its own version
        for name, want in counts.items():
            assert want is None or np.array_equal(v.lens if name == "lens" else v.array(name), want), name


class Writer(ReferenceBackend):
    name = "writer_test"

    def attend_layer(self, q, kv, **kw):
        kv.dense.k[0, 0] = 0.0
        return super().attend_layer(q, kv, **kw)


def test_a_kernel_cannot_write_the_rows_it_reads():
    c = kvreg.LayerKvCache(2, 8, backend=Writer())
    c.extend(rows(5), rows(5))
    with pytest.raises(ValueError, match="read-only"):
        c.attend_layer(rows(1)[0].reshape(2, 8))


MUTATIONS = {
    "append": lambda c: c.append(rows(1)[0], rows(1)[0]),
    "extend": lambda c: c.extend(rows(3), rows(3)),
    "truncate_last": lambda c: c.truncate_last(2),
    "trim_window": lambda c: c.trim_window(8, 0, 1),
    "evict": lambda c: c.evict(6),
    "evict_born": lambda c: c.evict_born(8, 1, 4),
    "clear": lambda c: c.clear(),
    "import_wire": lambda c: c.import_wire(c.export_wire()),
}


@pytest.mark.parametrize("mode", ["f32", "q8", "q8_2f", "q4"])
@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_every_mutation_moves_the_version_and_unchanged_rows_tells_what_stayed(what, mode):
    c = kvreg.LayerKvCache(2, 8, mode=mode, backend="reference")
    c.extend(rows(70), rows(70))  # q8_2f's field froze at 64 rows
    before = c.storage.view()
    bits = {n: before.array(n).copy() for n in c.storage.block_names()}
    MUTATIONS[what](c)
    after = c.storage.view()
    assert after.version > before.version
    floor = after.unchanged_rows(before.version)
    if floor is None:
        return  # a rewrite: a mirror uploads everything
    for name, old in bits.items():
        new = after.array(name)
        for h in range(2):
            keep = int(min(floor[h], before.lens[h], after.lens[h]))
            if c.storage.window:  # integer slots of window rows are written as they leave
                keep = min(keep, int(before.window.b8[h]))
            assert np.array_equal(new[h, :keep], old[h, :keep]), f"{what}: {name} head {h} changed below {keep}"


def test_the_freeze_is_a_rewrite():
    c = kvreg.LayerKvCache(2, 8, mode="q8_2f", backend="reference")
    c.extend(rows(63), rows(63))
    v = c.storage.view()
    c.append(rows(1)[0], rows(1)[0])
    c.append(rows(1)[0], rows(1)[0])  # the append that finds 64 rows freezes the field first
    assert c.storage.field_frozen() and c.storage.view().unchanged_rows(v.version) is None


def test_truncations_past_the_log_are_a_rewrite():
    c = kvreg.LayerKvCache(2, 8, backend="reference")
    c.extend(rows(100), rows(100))
    v = c.storage.view()
    for _ in range(64):
        c.truncate_last(1)
    assert c.storage.view().unchanged_rows(v.version).tolist() == [36, 36]
    c.truncate_last(1)
    assert c.storage.view().unchanged_rows(v.version) is None


def test_a_ring_view_version_moves_on_every_ring_mutation():
    s = BoundedState(2, 4, 3)
    w = BoundedWeights(np.zeros((2, 1, 4)), np.zeros((2, 1, 4)), 1, [3, 3])
    rope = BoundedRope()
    seen = []

    def look():
        v = s.view(w, rope)
        assert isinstance(v, RingView) and not v.k.flags.writeable
        seen.append((v.version, v.reset_version))

    s.insert(np.ones((2, 4)), np.ones((2, 4)))
    look()
    s.insert(np.ones((2, 4)), np.ones((2, 4)))
    look()
    assert seen[1][0] > seen[0][0] and seen[1][1] == seen[0][1], "an insert is not a reset"
    snap = s.snapshot()
    s.rollback(1)
    look()
    s.restore(snap)
    look()
    s.load(s.ring_k.copy(), s.ring_v.copy(), 2)
    look()
    s.clear()
    s.insert(np.ones((2, 4)), np.ones((2, 4)))
    look()
    versions = [v for v, _ in seen]
    assert versions == sorted(set(versions)), "strictly increasing"
    assert all(r == v for v, r in seen[2:5]), "rollback, restore and load reset"
    assert seen[5][1] > seen[4][1], "clear resets"
