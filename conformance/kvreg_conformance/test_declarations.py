"""A backend's declared capabilities (:class:`kvreg.plugin.Backend`) are the
types the interface says, and the claims they make hold."""

from __future__ import annotations

import pytest

from kvreg import KvMode, LayerKvCache
from kvreg.plugin import KERNELS, Backend

from .data import rng_rows


@pytest.mark.quick
def test_the_declarations_have_the_interface_types(backend, check):
    cls = type(backend)
    assert isinstance(cls.name, str) and cls.name, "name"
    for flag in ("auto", "parallel_seal", "native_q8_chunk", "device_resident"):
        assert isinstance(getattr(cls, flag), bool), f"{flag} must be a bool"
    assert isinstance(cls.native_modes, frozenset) and all(isinstance(m, KvMode) for m in cls.native_modes), \
        "native_modes must be a frozenset of KvMode"
    assert cls.conformance_xfail is None or (isinstance(cls.conformance_xfail, str) and ":" in cls.conformance_xfail), \
        "conformance_xfail must be None or 'package:path'"
    assert set(cls.native_kernels()) <= set(KERNELS) and not cls.__abstractmethods__
    assert issubclass(cls, Backend)


def _sealed_outputs(backend, steps=3):
    nkv, hpk, hd, t = 4, 2, 16, 72
    nh = nkv * hpk
    k, v = rng_rows(1, t + steps, nkv * hd), rng_rows(2, t + steps, nkv * hd)
    q = rng_rows(3, (t + steps) * nh, hd).reshape(t + steps, nh, hd)
    lay = LayerKvCache(nkv, hd, KvMode.F32, backend)
    lay.o1_begin(8, 16, 2, far="nystrom")
    lay.extend(k[:t].reshape(t, nkv, hd), v[:t].reshape(t, nkv, hd), layout="nhd")
    lay.o1_set_q_trace(q[:t])
    assert lay.o1_seal(nh)
    return [lay.o1_step(q[p], k[p], v[p], nh) for p in range(t, t + steps)]


def test_a_parallel_seal_answers_as_a_serial_one(backend, check):
    """``parallel_seal`` lets a seal run its KV groups on threads: that must
    not change a bit."""
    cls = type(backend)
    if not cls.parallel_seal:
        pytest.skip("the backend does not declare parallel_seal")
    serial = type(f"{cls.__name__}Serial", (cls,), {"parallel_seal": False})(backend.device)
    for got, want in zip(_sealed_outputs(backend), _sealed_outputs(serial)):
        check.exact("nystrom_step", got, want, "a seal on threads against the same seal serially")
