"""The O(1) seal: sealing a 32k-row layer of 8 KV groups (32 Q heads, hd
128, m 64, w 1024, sink 4, query trace stride 8) with the seed's Nyström far
field, and the sealed decode step of both far fields (``nystrom``, and
``tiered``: KvregCache's default), whose cost (and memory) must not depend
on the context sealed.

A 32k seal costs tens of seconds on the reference: each class that needs
one pays it once in ``setup``; the memory claim is tracked at 2k and 8k."""

import numpy as np

from . import common
from .common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS

M, W, SINK, STRIDE = 64, 1024, 4, 8


FARS = ["nystrom", "tiered"]


def collecting_layer(name, rows, far="nystrom"):
    """A fresh layer of ``rows`` rows with the O(1) overlay armed and its
    (strided) query trace recorded, ready to seal."""
    from kvreg_conformance.fill import filled_layer

    layer = filled_layer(rows, NUM_KV_HEADS, HEAD_DIM, backend=common.backend(name))
    layer.o1_begin(M, W, SINK, far=far)
    layer.o1_set_q_stride(STRIDE)
    layer.o1_set_q_trace(common.queries(-(-rows // STRIDE), NUM_HEADS, HEAD_DIM, seed=2))
    return layer


class Seal32k:
    params = [common.backend_names()]
    param_names = ["backend"]
    number = 1
    repeat = (1, 3, 60.0)
    timeout = 300

    def setup(self, name):
        self.layer = collecting_layer(name, 32768)

    def time_seal(self, name):
        if not self.layer.o1_seal(NUM_HEADS):
            raise RuntimeError(f"seal failed: {self.layer.take_o1_error()}")


class SealedStep:
    params = [common.backend_names(), [2048, 32768], FARS]
    param_names = ["backend", "sealed_rows", "far"]
    timeout = 300

    def setup(self, name, rows, far):
        self.layer = collecting_layer(name, rows, far)
        if not self.layer.o1_seal(NUM_HEADS):
            raise NotImplementedError(f"seal failed: {self.layer.take_o1_error()}")
        rng = np.random.default_rng(3)
        self.q = rng.standard_normal((NUM_HEADS, HEAD_DIM), dtype=np.float32)
        self.kv = rng.standard_normal((NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)
        self.layer.o1_step(self.q, self.kv, self.kv, NUM_HEADS)

    def time_o1_step(self, name, rows, far):
        self.layer.o1_step(self.q, self.kv, self.kv, NUM_HEADS)


class SealedMemory:
    """Bytes a sealed layer holds: the same after 2k and 8k rows (and the
    F32 rows it replaced grow 4x)."""

    params = [common.backend_names(), [2048, 8192], FARS]
    param_names = ["backend", "sealed_rows", "far"]
    timeout = 120

    def setup(self, name, rows, far):
        self.layer = collecting_layer(name, rows, far)
        self.exact_bytes = self.layer.memory_bytes()
        if not self.layer.o1_seal(NUM_HEADS):
            raise NotImplementedError(f"seal failed: {self.layer.take_o1_error()}")

    def track_sealed_memory_bytes(self, name, rows, far):
        return self.layer.memory_bytes()

    track_sealed_memory_bytes.unit = "bytes"

    def track_sealed_over_exact_bytes(self, name, rows, far):
        """Sealed state bytes over the exact rows and query trace it replaced."""
        return self.layer.memory_bytes() / self.exact_bytes

    track_sealed_over_exact_bytes.unit = "ratio"
