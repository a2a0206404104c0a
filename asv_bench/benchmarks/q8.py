"""The q8_2f cache: append cost, decode time, and accuracy against the f64 oracle."""

import numpy as np

from . import common
from .common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS


class Q8Append:
    """One q8 append (quantize K per 32-channel group, V per row) of an 8x128
    row, field frozen."""

    params = [common.backend_names(), ["f32", "q8"]]
    param_names = ["backend", "kv"]

    def setup(self, name, kv):
        from kvreg import LayerKvCache

        self.layer = LayerKvCache(NUM_KV_HEADS, HEAD_DIM, kv, common.backend(name))
        self.rows = np.random.default_rng(0).standard_normal((256, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)
        for i in range(80):
            self.layer.append(self.rows[i], self.rows[i])
        self.i = 0

    def time_append(self, name, kv):
        r = self.rows[self.i & 255]
        self.i += 1
        self.layer.append(r, r)

    def track_over_memcpy(self, name, kv):
        """One append (K and V) over copying the same two rows with numpy,
        same process (OpenCL's q8 append: at most 20x)."""
        dst = np.empty_like(self.rows[0])

        def copy():
            np.copyto(dst, self.rows[self.i & 255])
            np.copyto(dst, self.rows[self.i & 255])

        t = common.best_time(lambda: self.time_append(name, kv))
        return t / common.best_time(copy)

    track_over_memcpy.unit = "x a memcpy of the rows"


class Q8Decode:
    params = [common.backend_names(), [4096, 16384]]
    param_names = ["backend", "rows"]

    def setup(self, name, rows):
        self.q = common.queries(1)[0]
        self.layers = common.cold_layers(name, rows, self.q, mode="q8")

    def time_attend_layer_q8(self, name, rows):
        self.layers.next().attend_layer(self.q)

    def track_q8_over_f32_time(self, name, rows):
        """Decode time of the q8 layer over the F32 layer's, same process,
        both read from memory (``common.cold_layers``; below 1: q8 reads
        ~3.7x fewer bytes and it shows)."""
        f32 = common.cold_layers(name, rows, self.q, mode="f32")
        tq = common.best_time(lambda: self.layers.next().attend_layer(self.q))
        tf = common.best_time(lambda: f32.next().attend_layer(self.q))
        return tq / tf

    track_q8_over_f32_time.unit = "ratio"


class Q8Error:
    """Relative error ``||o - ô|| / ||o||`` (median over heads) of the decode
    output against float64 exact attention over the unquantized rows, on
    realistic data (RoPE, outlier channels, a sink: kvreg_conformance.data.realistic_qkv)."""

    params = [common.backend_names(), ["f32", "q8"]]
    param_names = ["backend", "kv"]
    ROWS = 4096

    def setup(self, name, kv):
        from kvreg_conformance.data import realistic_qkv
        from kvreg_conformance.fill import filled_layer
        from kvreg_conformance.oracle import attention_oracle

        d = realistic_qkv(self.ROWS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, seed=0)
        k = np.ascontiguousarray(d.k.transpose(1, 0, 2))
        v = np.ascontiguousarray(d.v.transpose(1, 0, 2))
        self.layer = filled_layer(self.ROWS, NUM_KV_HEADS, HEAD_DIM, mode=kv, backend=common.backend(name),
                                  k=k, v=v)
        self.q = d.q[-1]
        self.ref = attention_oracle(d.q[-1:], d.k, d.v, d.scale)[0]

    def track_rel_error_vs_f64(self, name, kv):
        out = self.layer.attend_layer(self.q, importance=False).astype(np.float64)
        err = np.linalg.norm(out - self.ref, axis=-1) / np.linalg.norm(self.ref, axis=-1)
        return float(np.median(err))

    track_rel_error_vs_f64.unit = "relative error"
