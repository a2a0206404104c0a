"""Decode attention: ``attend_layer`` of one token, 32 Q / 8 KV heads, hd 128
(and Gemma 3's 4 Q / 1 KV heads, hd 256)."""

from . import common


class AttendLayerDecode:
    """One decode step of one layer over ``rows`` stored rows (importance
    accumulated, as an engine running Born eviction does), the layer read
    from memory as in a model (copies taken in turn: ``common.cold_layers``)."""

    params = [common.backend_names(), [1024, 4096, 16384, 65536]]
    param_names = ["backend", "rows"]

    def setup(self, name, rows):
        self.q = common.queries(1)[0]
        self.layers = common.cold_layers(name, rows, self.q)   # compiled / uploaded outside the timing

    def time_attend_layer(self, name, rows):
        self.layers.next().attend_layer(self.q)

    def track_bandwidth_fraction(self, name, rows):
        """Bytes of K and V read per second over the machine's streaming-read
        bandwidth, measured in the same process (1.0 = memory-bound optimum)."""
        t, bw = common.beside_probe(lambda: common.best_time(lambda: self.layers.next().attend_layer(self.q)))
        return self.layers.items[0].memory_bytes() / t / 1e9 / bw

    track_bandwidth_fraction.unit = "fraction of stream bandwidth"


class AttendLayerDecodeHd256(AttendLayerDecode):
    """:class:`AttendLayerDecode` at Gemma 3's geometry: 4 Q / 1 KV heads, hd
    256 (its global layers; a sliding layer reads 512 rows). Its value pass
    reads each row in slices, so it leans on the kernel's own prefetch hints."""

    params = [common.backend_names(), [512, 4096, 32768]]

    def setup(self, name, rows):
        self.q = common.queries(1, num_heads=4, hd=256)[0]
        self.layers = common.cold_layers(name, rows, self.q, nkv=1, hd=256)


class AttendLayerVsNumba:
    """A backend's decode throughput over kvreg-numba's on the same rows,
    same process (OpenCL on PoCL: at least 0.5 at 4k-16k rows)."""

    params = [common.backend_names(), [4096, 16384]]
    param_names = ["backend", "rows"]

    def setup(self, name, rows):
        if name == "numba" or "numba" not in common.backend_names():
            raise NotImplementedError("compared against numba")
        self.q = common.queries(1)[0]
        self.layers, self.numba = common.cold_layers(name, rows, self.q), common.cold_layers("numba", rows, self.q)

    def track_throughput_vs_numba(self, name, rows):
        t = common.best_time(lambda: self.layers.next().attend_layer(self.q))
        tn = common.best_time(lambda: self.numba.next().attend_layer(self.q))
        return tn / t

    track_throughput_vs_numba.unit = "x numba's throughput"
