"""Prefill: ``attend_chunk`` of a 512-row chunk after 8k stored rows, GQA 4
(8 Q / 2 KV heads: the fraction of matmul peak does not depend on the head
count, the run time does), hd 128."""

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
