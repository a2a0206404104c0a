"""KV storage modes (`KvMode`) and their selection from the environment."""

from __future__ import annotations

import enum
import os

from .errors import ConfigError

#: Positions stored before the per-channel q8 field (2f) freezes.
KV_COL_WARMUP = 64
#: Channels per K scale group under q8 (V has one scale per row).
KV_K_GROUP = 32

#: Leading rows of each head a q8 layer also keeps in float32 and attends
#: exactly: the attention sink (KVQuant keeps the first token in full
#: precision; models whose sink spans several tokens want StreamingLLM's 4).
#: ``q8_exact_rows=0`` on a layer gives the seed's storage bit for bit.
Q8_EXACT_ROWS = 1

_ENV_VALUES = {
    "f32": "F32",
    "q8": "Q8",
    "q8_2f": "Q8",
    "q8k": "Q8K",
    "q8v": "Q8V",
}


class KvMode(enum.Enum):
    """How a layer stores K and V.

    ``F32`` keeps both in float32. The q8_2f modes (the seed's ``Q8 { k, v }``)
    keep int8 rows with float32 scales after dividing by a per-channel field
    that freezes at :data:`KV_COL_WARMUP` rows: ``Q8`` quantizes K and V,
    ``Q8K`` only K, ``Q8V`` only V.
    """

    F32 = "f32"
    Q8 = "q8"
    Q8K = "q8k"
    Q8V = "q8v"

    @property
    def quant_k(self) -> bool:
        return self in (KvMode.Q8, KvMode.Q8K)

    @property
    def quant_v(self) -> bool:
        return self in (KvMode.Q8, KvMode.Q8V)

    @property
    def quantized(self) -> bool:
        return self is not KvMode.F32

    @classmethod
    def parse(cls, value: "str | KvMode") -> "KvMode":
        """A mode from its name as ``KVREG_KV`` spells it (case-insensitive)."""
        if isinstance(value, KvMode):
            return value
        key = str(value).strip().lower()
        if key not in _ENV_VALUES:
            accepted = ", ".join(sorted(_ENV_VALUES))
            raise ConfigError(f"KVREG_KV={value!r} is not a KV mode; accepted: {accepted} (unset = f32)")
        return cls[_ENV_VALUES[key]]

    @classmethod
    def from_env(cls) -> "KvMode":
        """``KVREG_KV``: unset or ``f32``; ``q8``/``q8_2f``; ``q8k``; ``q8v``.

        Unlike the seed (which silently fell back to F32), an unknown value is
        a :class:`~kvreg.errors.ConfigError` listing the accepted ones.
        """
        raw = os.environ.get("KVREG_KV")
        if raw is None or raw.strip() == "":
            return cls.F32
        return cls.parse(raw)
