"""`KvCache`: every layer of a model, with the cache-wide eviction policy."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

from . import _validate as V
from .errors import ConfigError, WireError
from .layer import LayerKvCache
from .modes import Q8_EXACT_ROWS, KvMode
from .wire import decode_cache, decode_layer, encode_cache

#: The most layers a cache builds (models have at most a few hundred).
MAX_LAYERS = 2**16


@dataclass(frozen=True)
class Recent:
    """Sliding window: keep only the most recent positions."""


@dataclass(frozen=True)
class Born:
    """Mass-based: ``sink`` earliest + recents + top accumulated attention mass."""

    sink: int = 4


@dataclass(frozen=True)
class Snap:
    """Per-KV-group eviction at a fixed budget. At the prompt's end each
    group keeps its ``sink`` first rows, its ``recent`` newest and the rows
    its heads' last ``observe`` queries attend most (SnapKV's observation
    window, pooled over neighbouring rows); then at every step, per group,
    the row of least mass (the window's plus everything decode gave it:
    H2O's accumulation) outside the sinks and the recent rows leaves. It
    runs as the O(1) seal with no far tier (``o1_begin(0, recent, sink,
    heavy=budget - sink - recent, observe=observe, auto=True)``), so its
    memory is fixed whatever the context, in every KV mode."""

    sink: int = 4
    recent: int = 32
    observe: int = 32


def check_policy(policy) -> None:
    """A :class:`ConfigError` unless ``policy`` is one of :class:`EvictionPolicy`'s."""
    if isinstance(policy, Born):
        V.nonneg_int("Born.sink", policy.sink)
    elif isinstance(policy, Snap):
        V.nonneg_int("Snap.sink", policy.sink)
        V.positive_int("Snap.recent", policy.recent)
        V.positive_int("Snap.observe", policy.observe)
    elif not isinstance(policy, Recent):
        raise ConfigError("policy must be EvictionPolicy.Recent, EvictionPolicy.Born(sink) or "
                          f"EvictionPolicy.Snap(sink, recent, observe), got {policy!r}")


def resident_bytes(*caches) -> int:
    """Bytes of KV state the given sequences hold together (each a
    :class:`KvCache`, a :class:`LayerKvCache` or an iterable of them), rows
    shared between forks counted once: what the process holds for them."""
    total, seen = 0, set()
    stack = list(caches)
    while stack:
        c = stack.pop()
        if isinstance(c, LayerKvCache):
            total += c.memory_bytes() - c.shared_bytes()
            shared = c.storage.shared_rows()
            if shared is not None and id(shared[0]) not in seen:
                seen.add(id(shared[0]))
                total += shared[1]
        elif isinstance(c, KvCache):
            stack.extend(c.layers)
        elif hasattr(c, "__iter__") and not isinstance(c, (str, bytes)):
            stack.extend(c)
        else:
            raise ConfigError("resident_bytes takes KvCache, LayerKvCache or iterables of them, "
                              f"got {type(c).__name__}")
    return total


class EvictionPolicy:
    """``EvictionPolicy.Recent`` / ``EvictionPolicy.Born(sink=4)`` (the seed's
    enum), and ``EvictionPolicy.Snap(sink=4, recent=32, observe=32)``."""

    Recent = Recent()
    Born = Born
    Snap = Snap


class KvCache:
    """The KV cache of a whole model: ``num_layers`` :class:`LayerKvCache`.

    ``policy`` defaults to ``EvictionPolicy.Born(sink=4)`` (the seed's
    default); ``mode``, ``backend`` and ``q8_exact_rows`` are passed to every
    layer.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 policy=None, *, mode: KvMode | str | None = None, backend=None,
                 q8_exact_rows: int = Q8_EXACT_ROWS):
        # A layer object each: a count past any model is a mistake, not a model.
        num_layers = V.positive_int("num_layers", num_layers, hi=MAX_LAYERS)
        max_seq_len = V.positive_int("max_seq_len", max_seq_len)
        self.policy = Born(4) if policy is None else policy
        self._check_policy(self.policy)
        self.max_seq_len = int(max_seq_len)
        mode = KvMode.from_env() if mode is None else KvMode.parse(mode)
        self.layers = [LayerKvCache(num_kv_heads, head_dim, mode, backend, layer=i,
                                   q8_exact_rows=q8_exact_rows) for i in range(num_layers)]

    @staticmethod
    def _check_policy(policy) -> None:
        check_policy(policy)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerKvCache:
        return self.layers[i]

    def clear(self) -> None:
        with self._all_layers_locked():
            for layer in self.layers:
                layer.clear()

    def total_memory_bytes(self) -> int:
        """Bytes of state this sequence holds (rows shared with a fork included:
        :func:`resident_bytes` counts them once across sequences)."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def fork(self) -> KvCache:
        """A new sequence holding this one's rows copy-on-write, every layer
        :meth:`LayerKvCache.fork`: ``N`` forks of a prompt hold its rows
        once while each decodes on (:func:`resident_bytes`)."""
        with self._all_layers_locked():
            new = object.__new__(KvCache)
            new.__dict__.update(self.__dict__)
            new.layers = [layer.fork() for layer in self.layers]
            return new

    def recurrent_state_bytes(self) -> int:
        """Bytes of linear-core recurrent state (scratch included)."""
        return sum((layer.linear_state.size + layer.linear_scratch.size) * 4 for layer in self.layers)

    def attention_state_bytes(self) -> int:
        """Attention KV (or sealed O(1) state) bytes: total minus recurrent."""
        return max(self.total_memory_bytes() - self.recurrent_state_bytes(), 0)

    def bounded_state_bytes(self) -> int:
        """Bytes of bounded-anchor rings (constant in context)."""
        return sum(layer.bounded_state_bytes() for layer in self.layers)

    def reserved_bytes(self) -> int:
        """Capacity held by the row storage of every layer."""
        return sum(layer.reserved_bytes() for layer in self.layers)

    @property
    def seq_len(self) -> int:
        """Absolute depth: max over layers of ``pos_len``."""
        return max((layer.pos_len for layer in self.layers), default=0)

    def needs_eviction(self) -> bool:
        """True when a layer with per-position storage reached the cap (bounded
        rings and sliding tails bound themselves and are not counted)."""
        rows = [layer.seq_len for layer in self.layers if layer.bounded is None and layer.tail_window is None]
        return max(rows, default=0) >= self.max_seq_len

    def evict(self, keep_last: int) -> None:
        """Evict every layer down to ``keep_last`` rows according to the policy."""
        keep_last = V.nonneg_int("keep_last", keep_last)
        self._check_policy(self.policy)
        if isinstance(self.policy, Snap):
            raise ConfigError("EvictionPolicy.Snap bounds the layers as they seal, from the prompt's last queries: "
                              "arm each layer before the prompt with o1_begin(0, recent, sink, heavy=keep_last - "
                              "sink - recent, observe=observe, auto=True) (KvregCache(policy=..., budget=N) does)")
        with self._all_layers_locked():
            if isinstance(self.policy, Recent):
                for layer in self.layers:
                    layer.evict(keep_last)
            else:
                recent = max(keep_last // 2, 1)
                for layer in self.layers:
                    layer.evict_born(keep_last, self.policy.sink, recent)

    def export_wire(self, f16: bool = False) -> bytes:
        """Every layer's record (v2, or v3 for non-F32 storage) in a ``KVRC``
        container, a CRC-32 per record (docs/wire.md)."""
        with self._all_layers_locked():
            return encode_cache([layer.export_wire(f16) for layer in self.layers])

    def import_wire(self, buf) -> None:
        """Install a container exported by :meth:`export_wire`: every layer
        blob's CRC-32 is checked, and every record decoded, checked and made
        ready to install, before any layer changes."""
        blobs = decode_cache(buf)
        if len(blobs) != len(self.layers):
            raise WireError(f"kv import: container holds {len(blobs)} layers, this cache has {len(self.layers)}")
        with self._all_layers_locked():
            self._import_blobs(blobs)

    def _all_layers_locked(self) -> ExitStack:
        """Every layer's lock, in layer order (a layer call holds only its
        own): no thread sees the cache between two layers of an import."""
        stack = ExitStack()
        for layer in self.layers:
            stack.enter_context(layer._lock)
        return stack

    def _import_blobs(self, blobs) -> None:
        records = [decode_layer(blob, layer.wire.expect()) for layer, blob in zip(self.layers, blobs)]
        # Everything an install could refuse is refused, and everything it
        # allocates is allocated, before the first layer changes: a bad
        # record after good ones changes nothing.
        plans = [layer.wire.prepare(rec) for layer, rec in zip(self.layers, records)]
        for layer, plan in zip(self.layers, plans):
            layer.wire.install(plan)
