"""The bounded anchor (``swa_sink_v1``): one ``bounded_step`` per token,
32 Q / 8 KV heads, hd 128, window 4096, 4 sinks per group.

Position 100k is reached the way a wire import reaches it (``load`` of a
full ring at ``seen = 100000``): stepping 100k tokens would take minutes and
by construction changes nothing the ring holds but its contents."""

import numpy as np

from . import common
from .common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS

WINDOW, SINK = 4096, 4


def bounded_layer(name, position):
    from kvreg import LayerKvCache
    from kvreg.bounded import BoundedRope, BoundedWeights

    layer = LayerKvCache(NUM_KV_HEADS, HEAD_DIM, "f32", common.backend(name))
    layer.install_bounded(WINDOW)
    rng = np.random.default_rng(4)
    ring = rng.standard_normal((NUM_KV_HEADS, WINDOW, HEAD_DIM), dtype=np.float32)
    layer.bounded.load(ring, ring, position)
    layer.seq_len = position
    sk = rng.standard_normal((NUM_KV_HEADS, SINK, HEAD_DIM), dtype=np.float32)
    weights = BoundedWeights(sk, sk, SINK, [WINDOW] * NUM_KV_HEADS)
    return layer, weights, BoundedRope(10000.0)


class BoundedStep:
    params = [common.backend_names(), [4096, 100_000]]
    param_names = ["backend", "position"]

    def setup(self, name, position):
        self.layer, self.weights, self.rope = bounded_layer(name, position)
        rng = np.random.default_rng(5)
        self.q = rng.standard_normal((NUM_HEADS, HEAD_DIM), dtype=np.float32)
        self.kv = rng.standard_normal((NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)
        self.scale = 1.0 / np.sqrt(HEAD_DIM)
        self.step()

    def step(self):
        return self.layer.bounded_step(self.q, self.kv, self.kv, self.weights, self.rope, self.scale, NUM_HEADS)

    def time_bounded_step(self, name, position):
        self.step()

    def track_bounded_state_bytes(self, name, position):
        """Constant in the position: the rings and the undo buffer."""
        for _ in range(4):
            self.step()
        return self.layer.bounded_state_bytes()

    track_bounded_state_bytes.unit = "bytes"
