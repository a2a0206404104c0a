"""Write the golden wire blobs of tests/test_wire_codec.py.

Run from the repository root: ``PYTHONPATH=. python tests/data/make_golden.py``.
The blobs are checked in; the test rebuilds each one field by field with
``struct.pack``, so a change here or in the codec that moves a byte fails.
Values are small binary fractions (exact in f16) except ``0.1`` and ``1e5``
in the bounded ring, which pin f16 rounding and overflow to inf.
"""

from __future__ import annotations

import pathlib

import numpy as np

from kvreg.wire import BoundedRecord, LayerState, WireKind, encode_full_body, encode_layer

HERE = pathlib.Path(__file__).resolve().parent


def rows(start: float, n: int, hd: int = 4) -> np.ndarray:
    """``n`` rows of ``hd`` channels: start, start + 0.125, ... (exact in f16)."""
    return (start + 0.125 * np.arange(n * hd, dtype=np.float32)).reshape(n, hd)


def states() -> dict:
    """name -> (LayerState, f16, legacy) of every golden blob."""
    full = LayerState(WireKind.Full, identity=0x0123456789ABCDEF, layer=3, position=2, base=0,
                      seq_len=2, num_kv_heads=2, head_dim=4,
                      linear_state=np.array([0.5, -0.25], np.float32),
                      imp=np.array([0.75, 0.25], np.float32),
                      k=[rows(1.0, 2), rows(-1.0, 2)], v=[rows(2.0, 2), rows(-2.0, 2)])
    tail = LayerState(WireKind.Full, identity=0xC0FFEE, layer=1, position=7, base=5,
                      seq_len=2, num_kv_heads=2, head_dim=4,
                      imp=np.array([1.0, 0.5], np.float32),
                      k=[rows(0.5, 2), np.zeros((0, 4), np.float32)],  # head 1 is dead
                      v=[rows(-0.5, 2), np.zeros((0, 4), np.float32)])
    linear = LayerState(WireKind.Linear, identity=0xC0FFEE, layer=0, position=9, base=0,
                        seq_len=9, num_kv_heads=1, head_dim=4,
                        linear_state=np.array([0.5, -0.25, 1.0, 3.5], np.float32))
    ring_k = rows(0.0, 6).reshape(2, 3, 4)
    ring_v = rows(-3.0, 6).reshape(2, 3, 4)
    ring_v[0, 0, 0] = 0.1  # rounds in f16: 0x2E66
    ring_v[1, 2, 3] = 1e5  # past f16 max: inf, 0x7C00
    bounded = LayerState(WireKind.Bounded, identity=7, layer=2, position=4, base=0,
                         seq_len=4, num_kv_heads=2, head_dim=4,
                         bounded=BoundedRecord(window=3, len=3, head=1, ring_k=ring_k, ring_v=ring_v))
    return {
        "full_f32": (full, False, False),
        "fulltail_f16": (tail, True, False),
        "linear_f16flag": (linear, True, False),
        "bounded_f16": (bounded, True, False),
        "legacy_f32": (full, False, True),
    }


def blob(name: str) -> bytes:
    state, f16, legacy = states()[name]
    return encode_full_body(state, f16=f16) if legacy else encode_layer(state, f16=f16)


def main() -> None:
    for name in states():
        (HERE / f"wire_{name}.bin").write_bytes(blob(name))


if __name__ == "__main__":
    main()
