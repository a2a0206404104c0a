"""Batched decode: one layer of 32 sequences x 2k rows (32 Q / 8
KV heads, hd 128, F32 and q8) through numba's ``attend_batch`` (one
parallel launch), a Python loop of ``attend_layer`` over the same views,
and torch's SDPA on the padded ``[32, 8, 2048, 128]`` batch (``enable_gqa``),
with the fraction of the same run's streaming-read bandwidth
(:func:`kvreg_numba.bandwidth.stream_read_bandwidth`) ``attend_batch``
reads its K/V bytes at."""

from __future__ import annotations

import functools

import numpy as np

from . import common

BATCH, ROWS = 32, 2048
#: The short context of the script's last figure.
SHORT = 64
NH, NKV, HD = common.NUM_HEADS, common.NUM_KV_HEADS, common.HEAD_DIM
SCALE = HD ** -0.5


@functools.lru_cache(maxsize=1)
def _batch(mode: str, rows: int = ROWS):
    """32 numba layers of ``rows`` rows (distinct data) and their queries."""
    from kvreg_conformance.fill import filled_layer

    be = common.backend("numba")
    layers = [filled_layer(rows, NKV, HD, mode=mode, backend=be, seed=s) for s in range(BATCH)]
    q = np.random.default_rng(11).standard_normal((BATCH, NH, HD), dtype=np.float32)
    return be, layers, q


def rows_bytes(kv) -> int:
    """Bytes of the stored rows a decode reads (K and V blocks, their scales,
    the float16 windows and exact rows where the mode has them)."""
    total = 0
    for name in ("k", "v", "kq", "ks", "vq", "vs"):
        a = getattr(kv, name)
        if a is not None and kv.cap:
            total += a.nbytes * int(np.asarray(kv.lens).sum()) // (kv.num_kv_heads * kv.cap)
    for name in ("thk", "thv", "xk", "xv"):
        a = getattr(kv, name)
        if a is not None:
            total += a.nbytes
    return total


@functools.lru_cache(maxsize=1)
def _bandwidth() -> float:
    from kvreg_numba.bandwidth import stream_read_bandwidth

    return stream_read_bandwidth()


class BatchDecode:
    """One layer of 32 sequences x 2k rows: numba ``attend_batch``, a loop
    of ``attend_layer``, torch SDPA on the padded batch."""

    params = [["f32", "q8"]]
    param_names = ["mode"]
    timeout = 600

    def setup(self, mode, rows=ROWS):
        self.be, self.layers, self.q = _batch(mode, rows)
        self.views = [lay.storage.view() for lay in self.layers]
        self.batch()
        self.loop()  # both paths compiled (and their scratch grown) before any timing

    def batch(self):
        return self.be.attend_batch(self.q, self.views, scale=SCALE)

    def loop(self):
        out = np.empty((BATCH, NH, HD), np.float32)
        for b, kv in enumerate(self.views):
            out[b] = self.be.attend_layer(self.q[b], kv, scale=SCALE)
        return out

    def time_attend_batch(self, mode):
        self.batch()

    def time_attend_layer_loop(self, mode):
        self.loop()

    def track_bandwidth_fraction(self, mode):
        t = common.best_time(self.batch)
        return sum(rows_bytes(kv) for kv in self.views) / t / 1e9 / _bandwidth()

    track_bandwidth_fraction.unit = "x (K/V bytes read / stream bandwidth)"


class TorchSDPA:
    """``scaled_dot_product_attention(enable_gqa=True)`` of the 32 queries
    over the padded F32 ``[32, 8, 2048, 128]`` K/V (the same rows as
    :class:`BatchDecode`'s f32 layers)."""

    timeout = 600

    def setup(self):
        try:
            import torch
        except ImportError:
            raise NotImplementedError("torch is not installed") from None
        self.torch = torch
        _, layers, q = _batch("f32")
        kvs = [lay.storage.view() for lay in layers]
        self.k = torch.from_numpy(np.stack([kv.k[:, :ROWS] for kv in kvs]))
        self.v = torch.from_numpy(np.stack([kv.v[:, :ROWS] for kv in kvs]))
        self.qt = torch.from_numpy(np.ascontiguousarray(q[:, :, None, :]))  # [32, 32, 1, 128]
        self.sdpa()

    def sdpa(self):
        with self.torch.inference_mode():
            return self.torch.nn.functional.scaled_dot_product_attention(self.qt, self.k, self.v, scale=SCALE,
                                                                         enable_gqa=True)

    def time_sdpa(self):
        self.sdpa()


def main() -> None:
    """Print the figures once (``cd asv_bench && python -m benchmarks.batch``)."""
    import os

    import numba

    from kvreg import get_num_threads

    sd = TorchSDPA()
    sd.setup()
    torch_threads = sd.torch.get_num_threads()
    t_sdpa = common.best_time(sd.sdpa, min_time=0.1, repeats=5)
    bw = _bandwidth()
    print(f"stream-read bandwidth {bw:.1f} GB/s; kvreg threads {get_num_threads()} "
          f"(numba {numba.config.NUMBA_NUM_THREADS}), torch threads {torch_threads}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    for mode in BatchDecode.params[0]:
        b = BatchDecode()
        b.setup(mode)
        # interleaved, best of 5 rounds: a shared machine's drift hits both alike
        t_batch = t_loop = float("inf")
        for _ in range(5):
            t_batch = min(t_batch, common.best_time(b.batch, min_time=0.1, repeats=1))
            t_loop = min(t_loop, common.best_time(b.loop, min_time=0.1, repeats=1))
        nbytes = sum(rows_bytes(kv) for kv in b.views)
        frac = nbytes / t_batch / 1e9 / bw
        assert b.batch().tobytes() == b.loop().tobytes()  # the contract, on the benchmark's data
        print(f"{mode:4s} {BATCH} x {ROWS} rows ({nbytes / 2**20:.0f} MiB of K/V): attend_batch "
              f"{t_batch * 1e3:7.2f} ms ({frac:.2f} of the bandwidth), attend_layer loop {t_loop * 1e3:7.2f} ms "
              f"({t_loop / t_batch:.2f}x), torch SDPA f32 padded {t_sdpa * 1e3:7.2f} ms "
              f"({t_sdpa / t_batch:.2f}x)")

    # where the per-call Python overhead shows: a short context
    b = BatchDecode()
    b.setup("f32", SHORT)
    t_batch = t_loop = float("inf")
    for _ in range(5):
        t_batch = min(t_batch, common.best_time(b.batch, min_time=0.1, repeats=1))
        t_loop = min(t_loop, common.best_time(b.loop, min_time=0.1, repeats=1))
    print(f"f32  {BATCH} x {SHORT} rows: attend_batch {t_batch * 1e3:7.3f} ms, attend_layer loop "
          f"{t_loop * 1e3:7.3f} ms ({t_loop / t_batch:.2f}x)")


if __name__ == "__main__":
    main()
