"""Prefill: ``attend_chunk`` of a 512-row chunk after 8k stored rows, GQA 4
(8 Q / 2 KV heads: the fraction of matmul peak does not depend on the head
count, the run time does), hd 128."""

import numpy as np

from . import common

NH, NKV, HD, S0, B = 8, 2, 128, 8192, 512


def chunk_flops(s0: int, b: int, nh: int, hd: int) -> float:
    """FLOPs of the causal chunk (QK^T and PV over the visible keys only)."""
    keys = b * s0 + b * (b + 1) / 2
    return 4.0 * nh * hd * keys


class AttendChunk:
    params = [common.backend_names()]
    param_names = ["backend"]
    timeout = 120

    def setup(self, name):
        self.layer = common.layer(name, S0 + B, nkv=NKV, hd=HD)
        self.q = common.queries(B, NH, HD)
        self.layer.attend_chunk(self.q, B, S0, NH // NKV)

    def time_attend_chunk(self, name):
        self.layer.attend_chunk(self.q, B, S0, NH // NKV)

    def track_matmul_fraction(self, name):
        """Useful chunk FLOP/s over numpy's float32 matmul FLOP/s, same process."""
        t = common.best_time(lambda: self.layer.attend_chunk(self.q, B, S0, NH // NKV), min_time=0, repeats=2)
        return chunk_flops(S0, B, NH, HD) / t / common.matmul_flops()

    track_matmul_fraction.unit = "fraction of matmul FLOP/s"


class ChunkVsSDPA:
    """A 4k-token prefill chunk at SmolLM2's geometry (9 Q / 3 KV heads, hd
    64, from row 0) against torch's ``scaled_dot_product_attention(is_causal,
    enable_gqa)`` over the same rows, same process, on a quiet machine and
    beside a process spinning on one core (at most 1x SDPA)."""

    params = [common.backend_names()]
    param_names = ["backend"]
    timeout = 300
    NH, NKV, HD, B = 9, 3, 64, 4096

    def setup(self, name):
        try:
            import torch
        except ImportError:
            raise NotImplementedError("torch is not installed") from None
        if name == "reference":
            raise NotImplementedError("the reference's chunk is not a speed contender")
        self.torch = torch
        self.layer = common.layer(name, self.B, nkv=self.NKV, hd=self.HD)
        self.q = common.queries(self.B, self.NH, self.HD)
        kv = self.layer.storage.view()
        self.tq = torch.from_numpy(np.ascontiguousarray(self.q.transpose(1, 0, 2)))[None]
        self.tk = torch.from_numpy(kv.k[:, :self.B].copy())[None]
        self.tv = torch.from_numpy(kv.v[:, :self.B].copy())[None]
        self.chunk()
        self.sdpa()

    def chunk(self):
        # no importance: a model's prefill asks for none (SDPA computes none)
        self.layer.attend_chunk(self.q, self.B, 0, self.NH // self.NKV, importance=False)

    def sdpa(self):
        with self.torch.inference_mode():
            return self.torch.nn.functional.scaled_dot_product_attention(self.tq, self.tk, self.tv, is_causal=True,
                                                                         enable_gqa=True)

    def time_attend_chunk(self, name):
        self.chunk()

    def _ratio(self):
        # interleaved, best of each: a shared machine's swings hit both
        tc, ts = float("inf"), float("inf")
        for _ in range(3):
            tc = min(tc, common.best_time(self.chunk, min_time=0, repeats=1))
            ts = min(ts, common.best_time(self.sdpa, min_time=0, repeats=1))
        return tc / ts

    def track_vs_sdpa(self, name):
        return self._ratio()

    def track_vs_sdpa_beside_a_busy_process(self, name):
        from kvreg_tools.bench import busy_process

        with busy_process():
            return self._ratio()

    track_vs_sdpa.unit = track_vs_sdpa_beside_a_busy_process.unit = "x torch SDPA (target <= 1)"
