"""kvreg inside a host: the small model's whole decode call, extend's layouts,
and a decode step beside a competing busy process (the ratios, each
measured in one process against its own reference)."""

from __future__ import annotations

import numpy as np

from . import common


class SmallModelDecodeCall:
    """A decode step of one token at SmolLM2's geometry over 1k rows, going
    round its 30 layers (``kvreg_tools.bench.SmallModelCall``), as ``append``
    + ``attend_layer``, as the one call ``append_attend`` and as the layer's
    prepared :class:`kvreg.DecodeStep`, against reading its K/V bytes at the
    machine's stream bandwidth plus 10 µs (the bound: at most 1.5x)."""

    params = [common.backend_names()]
    param_names = ["backend"]

    def setup(self, name):
        from kvreg_tools.bench import SmallModelCall

        self.small = SmallModelCall(common.backend(name))

    def time_append_attend(self, name):
        self.small.call("append + attend_layer").truncate_last(1)   # the layer stays at 1k rows

    def _ratio(self, call):
        return self.small.vs_bytes_plus_10us(call)["ratio"]

    def track_vs_bytes_plus_10us(self, name):
        return self._ratio("append + attend_layer")

    def track_one_call_vs_bytes_plus_10us(self, name):
        return self._ratio("append_attend")

    def track_decode_step_vs_bytes_plus_10us(self, name):
        return self._ratio("decode_step")

    track_vs_bytes_plus_10us.unit = track_one_call_vs_bytes_plus_10us.unit = \
        track_decode_step_vs_bytes_plus_10us.unit = "x (bytes at stream bandwidth + 10 us)"


class ExtendLayouts:
    """A 512-row prefill chunk stored from token-major and head-major blocks
    (head-major is the storage's layout: no copy before the store)."""

    params = [["nhd", "hnd"]]
    param_names = ["layout"]

    def setup(self, layout):
        import kvreg

        rng = np.random.default_rng(6)
        k = rng.standard_normal((512, common.NUM_KV_HEADS, common.HEAD_DIM)).astype(np.float32)
        self.k = np.ascontiguousarray(k.transpose(1, 0, 2)) if layout == "hnd" else k
        self.layer = kvreg.LayerKvCache(common.NUM_KV_HEADS, common.HEAD_DIM, "f32", "reference")
        self.layer.extend(self.k, self.k, layout=layout)

    def time_extend(self, layout):
        self.layer.truncate_last(512)
        self.layer.extend(self.k, self.k, layout=layout)


class DecodeBesideABusyProcess:
    """A decode step (4k rows, 32/8 heads, hd 128, each call from memory)
    while another process spins on the same cores, over the same step on a
    quiet machine timed before and after (``kvreg_tools.bench.
    quiet_and_busy``, as ``kvreg bench decode``: at most 1.5x with
    kvreg's default thread budget)."""

    params = [common.backend_names()]
    param_names = ["backend"]
    timeout = 300

    def setup(self, name):
        self.q = common.queries(1)[0]
        self.layers = common.cold_layers(name, 4096, self.q)

    def track_busy_over_quiet(self, name):
        from kvreg_tools.bench import quiet_and_busy

        return quiet_and_busy(lambda: self.layers.next().attend_layer(self.q), common.best_time)["ratio"]

    track_busy_over_quiet.unit = "x (busy neighbour / quiet)"


def main() -> None:
    """Print the three figures once (``cd asv_bench && python -m benchmarks.host``)."""
    import timeit

    for name in common.backend_names():
        if name not in ("reference", "numba"):
            continue
        b = SmallModelDecodeCall()
        b.setup(name)
        d = DecodeBesideABusyProcess()
        d.setup(name)
        print(f"{name:10s} small call / (bytes + 10 us): append + attend_layer "
              f"{b.track_vs_bytes_plus_10us(name):5.2f}x, "
              f"append_attend {b.track_one_call_vs_bytes_plus_10us(name):5.2f}x"
              f", decode_step {b.track_decode_step_vs_bytes_plus_10us(name):5.2f}x"
              f"   busy / quiet {d.track_busy_over_quiet(name):5.2f}x")
    for layout in ExtendLayouts.params[0]:
        e = ExtendLayouts()
        e.setup(layout)
        t = min(timeit.repeat(lambda e=e, layout=layout: e.time_extend(layout), number=20, repeat=3)) / 20
        print(f"extend 512 rows, {layout}: {t * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
