"""KV storage modes (`KvMode`) and their selection from the environment."""

from __future__ import annotations

import enum
import os

import numpy as np

from .errors import ConfigError

#: Positions stored before the per-channel q8 field (2f) freezes.
KV_COL_WARMUP = 64
#: Channels per K scale group under q8 (V has one scale per row).
KV_K_GROUP = 32

#: The largest |value| a q8 layer stores: the 2f field is a float32 RMS over
#: the first KV_COL_WARMUP (64) rows, Σ x² of which stays finite (64·1e36 <
#: 3.4e38), and a row divided by the smallest field (1e-6) stays finite too.
Q8_ABS_MAX = 1e18

#: Leading rows of each head a q8 layer also keeps in float32 and attends
#: exactly: the attention sink (KVQuant keeps the first token in full
#: precision; models whose sink spans several tokens want StreamingLLM's 4).
#: ``q8_exact_rows=0`` on a layer gives the seed's storage bit for bit.
Q8_EXACT_ROWS = 1

#: The newest rows of each head a q8 layer (``Q8``, ``Q8K``, ``Q8V``) keeps in
#: float16 instead of int8, on its quantized side(s); a row is quantized when
#: it leaves (research/kv_quant_study.py: 8 rows cut SmolLM2's KL 3x at the same
#: bytes; docs/formats.md).
Q8_WINDOW = 8

#: q4's tiers (measured with research/kv_quant_study.py, see docs/formats.md):
#: each head's newest ``Q4_WINDOW`` rows are float16; the next
#: ``Q4_INT8_ROWS`` older ones int8 (float16 scale per 32 channels); older
#: rows int4 (K: float16 scale per 32 channels, V: per 64). Rows are
#: Walsh-Hadamard rotated first, and the first ``Q4_SINK_ROWS`` rows of each
#: head are also kept in float32 (the attention sinks).
Q4_WINDOW = 16
Q4_INT8_ROWS = 112
Q4_SINK_ROWS = 4
Q4_K_GROUP = 32
Q4_V_GROUP = 64
Q4_INT8_GROUP = 32

#: q2 (after KIVI, arXiv 2402.02750): each head's newest rows are float16,
#: at least ``Q2_WINDOW`` of them once that many are stored and fewer than
#: ``Q2_WINDOW + Q2_GROUP``; older rows are 2-bit, asymmetric (a float16
#: scale and zero per group), leaving the window in whole blocks of
#: ``Q2_GROUP`` rows: K quantized per channel over its block (outlier
#: channels keep their own range), V per row in groups of ``Q2_V_GROUP``
#: channels. Rows are not rotated; each head's first ``Q2_SINK_ROWS`` rows
#: are also kept in float32 (the attention sinks).
Q2_WINDOW = 32
Q2_GROUP = 32
Q2_V_GROUP = 32
Q2_SINK_ROWS = 4

_ENV_VALUES = {
    "f32": "F32",
    "f16": "F16",
    "bf16": "BF16",
    "q8": "Q8",
    "q8k": "Q8K",
    "q8v": "Q8V",
    "q8_2f": "Q8_2F",
    "q8k_2f": "Q8K_2F",
    "q8v_2f": "Q8V_2F",
    "q4": "Q4",
    "q2": "Q2",
}


class KvMode(enum.Enum):
    """How a layer stores K and V.

    ``F32`` keeps both in float32. ``F16`` and ``BF16`` keep both in two
    bytes (IEEE binary16, bfloat16), converted with round to nearest, ties
    to even; kernels read the 2-byte rows and compute in float32. The q8 modes keep int8 rows with float32
    scales (K: one per 32 channels, V: one per row) and each head's first
    rows also in float32 (``q8_exact_rows``): ``Q8`` quantizes K and V,
    ``Q8K`` only K, ``Q8V`` only V. The ``_2F`` modes are the seed's storage
    (``Q8 { k, v }``), bit for bit: rows are first divided by a per-channel
    field that freezes at :data:`KV_COL_WARMUP` rows. ``Q4`` keeps about
    0.59 bytes per element at 2k rows: each row is Walsh-Hadamard rotated and
    ages through float16 (the newest 16), int8 (the next 112) and int4 (every
    older row), with each head's first 4 rows also in float32. ``Q2`` (KIVI's
    scheme) keeps about 0.44 bytes per element at 1k rows (head_dim 64): 2-bit
    K quantized per channel over blocks of 32 rows, 2-bit V per row, the
    newest 32 to 63 rows float16, each head's first 4 rows also in float32.

    Why q8 has no field: on real models the field, frozen over the first 64
    rows, misfits later keys (5-7% of key channels grow past 2x their early
    RMS, up to 41x), so those channels quantize coarser than with no field.
    Measured with ``kvreg eval`` (the README's tables): the field costs 3x
    (SmolLM2-135M) to 26x (Gemma-3-270M) the KL of the field-free format.
    """

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8 = "q8"
    Q8K = "q8k"
    Q8V = "q8v"
    Q8_2F = "q8_2f"
    Q8K_2F = "q8k_2f"
    Q8V_2F = "q8v_2f"
    Q4 = "q4"
    Q2 = "q2"

    @property
    def quant_k(self) -> bool:
        return self in (KvMode.Q8, KvMode.Q8K, KvMode.Q8_2F, KvMode.Q8K_2F, KvMode.Q4, KvMode.Q2)

    @property
    def quant_v(self) -> bool:
        return self in (KvMode.Q8, KvMode.Q8V, KvMode.Q8_2F, KvMode.Q8V_2F, KvMode.Q4, KvMode.Q2)

    @property
    def window(self) -> int:
        """How many newest rows per head the quantized side(s) hold in float16
        (q2: at most; rows leave its window in blocks of :data:`Q2_GROUP`)."""
        if self is KvMode.Q4:
            return Q4_WINDOW
        if self is KvMode.Q2:
            return Q2_WINDOW + Q2_GROUP - 1
        return Q8_WINDOW if self in (KvMode.Q8, KvMode.Q8K, KvMode.Q8V) else 0

    @property
    def rotates_k(self) -> bool:
        """Whether K rows are stored Walsh-Hadamard rotated (q8, q8k, q4; for a
        power-of-two head_dim): rotation spreads outlier channels over all."""
        return self in (KvMode.Q8, KvMode.Q8K, KvMode.Q4)

    @property
    def rotates_v(self) -> bool:
        """Whether V rows are stored rotated (q8, q8v, q4): the output is
        rotated back, ``H Σ p Hv = Σ p v``."""
        return self in (KvMode.Q8, KvMode.Q8V, KvMode.Q4)

    @property
    def tiered(self) -> bool:
        """Whether rows change format as they age: ``Q4`` (float16, then int8,
        then int4, each row rotated) and ``Q2`` (float16, then 2-bit in blocks).
        Their kernels are the reference's on every backend (a row's form
        depends on its tier; see :mod:`kvreg.storage`)."""
        return self in (KvMode.Q4, KvMode.Q2)

    @property
    def field(self) -> bool:
        """Whether the seed's per-channel 2f field freezes on this storage."""
        return self in (KvMode.Q8_2F, KvMode.Q8K_2F, KvMode.Q8V_2F)

    @property
    def quantized(self) -> bool:
        """Whether K or V is stored as integer codes with scales (q8 modes, q4, q2)."""
        return self.quant_k or self.quant_v

    @property
    def half(self) -> bool:
        """Whether K and V are stored as 2-byte floats (``F16``, ``BF16``)."""
        return self in (KvMode.F16, KvMode.BF16)

    @property
    def float_dtype(self) -> np.dtype:
        """The dtype of an unquantized K/V block: float32, float16, or uint16
        holding bfloat16 bit patterns (numpy has no bfloat16)."""
        return np.dtype({KvMode.F16: np.float16, KvMode.BF16: np.uint16}.get(self, np.float32))

    @classmethod
    def parse(cls, value: str | KvMode) -> KvMode:
        """A mode from its name as ``KVREG_KV`` spells it (case-insensitive)."""
        if isinstance(value, KvMode):
            return value
        key = str(value).strip().lower()
        if key not in _ENV_VALUES:
            accepted = ", ".join(sorted(_ENV_VALUES))
            raise ConfigError(f"KVREG_KV={value!r} is not a KV mode; accepted: {accepted} (unset = f32)")
        return cls[_ENV_VALUES[key]]

    @classmethod
    def from_env(cls) -> KvMode:
        """``KVREG_KV``: unset or ``f32``; ``f16``, ``bf16``; ``q4``; ``q2``; ``q8``, ``q8k``, ``q8v``; the seed's
        ``q8_2f``, ``q8k_2f``, ``q8v_2f``.

        Unlike the seed (which silently fell back to F32), an unknown value is
        a :class:`~kvreg.errors.ConfigError` listing the accepted ones.
        """
        raw = os.environ.get("KVREG_KV")
        if raw is None or raw.strip() == "":
            return cls.F32
        return cls.parse(raw)
