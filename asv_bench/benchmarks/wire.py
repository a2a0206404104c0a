"""Wire export/import of a 16k-row 8x128 layer (128 MiB of K and V in f32).

The wire bytes are the core's (exact class), not a backend kernel's: the
suite runs them on the reference backend only."""

from . import common
from .common import HEAD_DIM, NUM_KV_HEADS

ROWS = 16384


class Wire:
    params = [["f32", "f16"]]
    param_names = ["payload"]

    def setup(self, payload):
        self.f16 = payload == "f16"
        self.layer = common.layer("reference", ROWS)
        self.blob = self.layer.export_wire(self.f16)
        from kvreg import LayerKvCache

        self.target = LayerKvCache(NUM_KV_HEADS, HEAD_DIM, "f32", "reference")

    def time_export(self, payload):
        self.layer.export_wire(self.f16)

    def time_import(self, payload):
        self.target.import_wire(self.blob)

    def track_blob_bytes(self, payload):
        return len(self.blob)

    track_blob_bytes.unit = "bytes"
