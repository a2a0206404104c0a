"""Storage: appending a token into a 32-layer cache; resident memory of 16k
rows under F32 and q8."""

import numpy as np

from . import common
from .common import HEAD_DIM, NUM_KV_HEADS


class Append32Layers:
    """One decode token's append into every layer of a 32-layer cache
    (steady state: the q8 field is already frozen)."""

    params = [common.backend_names(), ["f32", "q8"]]
    param_names = ["backend", "kv"]

    def setup(self, name, kv):
        from kvreg import KvCache

        be = common.backend(name)
        self.cache = KvCache(32, NUM_KV_HEADS, HEAD_DIM, 1 << 20, mode=kv, backend=be)
        rng = np.random.default_rng(0)
        self.rows = rng.standard_normal((256, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)
        for i in range(80):           # past KV_COL_WARMUP: the freeze is not in the timing
            for layer in self.cache.layers:
                layer.append(self.rows[i], self.rows[i])
        self.i = 0

    def time_append_token(self, name, kv):
        r = self.rows[self.i & 255]
        self.i += 1
        for layer in self.cache.layers:
            layer.append(r, r)


class Storage16k:
    """Peak resident memory after storing 16k rows of an 8x128 layer.
    F32 holds 2*16384*8*128*4 = 128 MiB of K and V; q8 about 3.7x less.
    The rows are appended from a small cycled block, so that input data
    does not hide the difference."""

    params = [common.backend_names(), ["f32", "q8"]]
    param_names = ["backend", "kv"]
    timeout = 120

    def setup(self, name, kv):
        self.be = common.backend(name)
        rng = np.random.default_rng(0)
        self.rows = rng.standard_normal((512, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)

    def peakmem_store_16k_rows(self, name, kv):
        from kvreg import LayerKvCache

        layer = LayerKvCache(NUM_KV_HEADS, HEAD_DIM, kv, self.be)
        rows = self.rows
        for i in range(16384):
            r = rows[i & 511]
            layer.append(r, r)
        return layer

    def track_memory_bytes_16k(self, name, kv):
        layer = common.layer(name, 16384, mode=kv)
        return layer.memory_bytes()

    track_memory_bytes_16k.unit = "bytes"
