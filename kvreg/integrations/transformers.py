"""kvreg inside a transformers model: ``KvregCache``.

.. code-block:: python

    from kvreg.integrations.transformers import KvregCache
    cache = KvregCache(model, mode="q8")   # refuses here a model it cannot serve exactly
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64, do_sample=False)

Which models: any causal LM whose layers attend through transformers'
attention interface with per-head keys and values: GQA, MQA and multi-head
attention (a config without ``num_key_value_heads``), sliding windows per
layer or per call, attention logit soft-capping (Gemma 2), learned sinks
(GPT-OSS), scaling multipliers, partial rotary and NoPE layers, fused QKV,
QK-norm, mixture-of-experts blocks, layers of different KV heads or head_dim
(:attr:`KvregCache.geometry`). The constructor runs a forward of a few
tokens through a recording cache (once per model) and reads what each layer
hands its cache and its attention function; it refuses, with the reason, a
model kvreg cannot serve exactly: latent attention (MLA: transformers caches
the compressed latent), cross-attention and encoder-decoder models, hybrid
models with recurrent or state-space layers, chunked attention, biases
added to the scores (ALiBi, relative positions), bidirectional attention,
keys shared across layers, attention computed outside the interface.
:data:`SUPPORTED` lists the families the tests measure against
``DynamicCache``.

How it fits transformers (5.x):

- ``KvregCache`` is a ``transformers.Cache`` with one layer object per model
  layer. transformers calls ``cache.update(k, v, layer_idx)`` with the
  post-RoPE (and post-QK-norm) keys, ``[batch, kv_heads, n, hd]``, then the
  attention function named by ``config._attn_implementation``, which is never
  handed the cache. So ``update`` only counts the new columns and returns the
  new keys tagged with where they belong; the attention function registered
  as ``"kvreg"`` (through ``AttentionInterface``) stores them in kvreg and
  attends there: ``attend_chunk`` for a prefill chunk, ``attend_layer`` for a
  decode step, on the selected backend. Masks for ``"kvreg"`` are registered
  too (``AttentionMaskInterface``, the SDPA boolean mask), so padding is seen.
- Per call: building a ``KvregCache`` leaves the model's configuration as it
  was. The model gets forward hooks (once); a forward handed a
  ``KvregCache`` reads ``"kvreg"`` as its attention implementation for its
  duration, every other forward (another cache, no cache) runs the
  implementation the model was configured with (eager, sdpa, ...), bit for
  bit. A forward of the same model in another thread meanwhile is handed on
  to the configured functions too (:mod:`kvreg.integrations._hf_route`).
- Soft-cap and sinks: the call's ``softcap`` and learned sinks (``s_aux``,
  one logit per query head, read from the model at each call) go to
  kvreg's decode kernels; a prefill chunk of such a layer is appended and
  attended a row at a time (``attend_chunk`` takes neither).
- Batches: one :class:`kvreg.KvCache` per sequence. Padded columns (the
  attention mask's all-false columns: left padding) are not stored, so each
  sequence's cache holds exactly its own tokens and answers as a batch-1 run.
  A decode step of a batch attends every sequence's layer in one
  :func:`kvreg.attend_batch` call (one kernel launch on numba and OpenCL).
- Positions: ``get_seq_length`` counts every column seen (pads included, as
  ``DynamicCache`` does) and never shrinks, whatever eviction, sliding trims
  or the seal drop: RoPE positions stay absolute.
- Sliding layers (Gemma 3): attended with kvreg's ``window`` and trimmed to
  the newest ``window - 1`` rows (what ``DynamicCache``'s sliding layers keep
  between steps) once they exceed that by ``window // 32`` rows
  (:func:`kvreg.eviction.sliding_trim`); a blocked mode (``q2``) trims whole
  blocks, so a trim requantizes nothing.
  Global layers keep everything unless a budget is set.
- Eviction at a budget (``budget=N``): after each step a global layer holding
  more than ``N`` rows keeps ``N``: ``EvictionPolicy.Born(sink)`` keeps the
  ``sink`` first rows, the ``N // 2`` newest and the rest by accumulated
  attention mass (kvreg's importance, accumulated by every attend);
  ``EvictionPolicy.Recent`` keeps the ``sink`` first rows (argument
  ``sink``, default 0) and the newest; ``EvictionPolicy.Snap`` chooses per
  KV group, by the prompt's last queries and then decode's mass, and holds
  ``N`` rows per group from the prompt's end on (it runs as the tiered
  seal with no far rows, below; :class:`kvreg.cache.Snap`).
- The O(1) seal (``o1=(m, w, sink)`` or ``(m, w, sink, heavy)``): every
  global layer is a self-sealing layer (``o1_begin(..., auto=True,
  far=o1_far)``): it seals itself at the first decode step once it holds
  enough rows (``w + sink + heavy + 1``); the cache just appends and attends.
  The default far field, ``o1_far="tiered"`` (:mod:`kvreg.tiered_seal`),
  keeps ``sink + w + heavy`` exact rows chosen by attention mass and the
  next rows in 4 bits, in the memory of ``m`` float32 rows;
  ``o1_far="nystrom"`` is the seed's landmark estimator. Every KV mode
  seals (from its rows as attention reads them); a layer whose seal cannot
  be made stays exact, with a warning.
- dtypes: float32, bfloat16 and float16 models all work. The cache stores
  the mode's format (F32: float32 rows; F16/BF16: 2-byte rows; q8 modes:
  int8 rows with float32 scales); with no ``mode`` and no ``KVREG_KV`` it
  stores the model's own dtype (a float16 model gets ``f16``, a bfloat16
  one ``bf16``: the bytes DynamicCache spends, not twice them). Keys, values
  and queries are converted to float32 on the way in, and the attention
  output is converted back to the model's dtype.

Unsupported (a :class:`~kvreg.errors.ConfigError` naming why): the models
above, tensors off the CPU, training (attention dropout), packed sequences,
beam search (``reorder_cache``), the O(1) seal on a model with soft-cap or
sinks, cropping a bounded, sealed, sliding or padded cache.
"""

from __future__ import annotations

import copy
import os

import numpy as np

from .. import _validate as V
from ..batch import attend_batch
from ..cache import Born, KvCache, Snap, check_policy, resident_bytes
from ..errors import ConfigError, ShapeError
from ..eviction import sliding_slack, sliding_trim
from ..layer import LayerKvCache
from ..lifecycle import Lifecycle
from ..modes import Q8_EXACT_ROWS, KvMode
from ..seal import FAR_FIELDS
from ..threads import _model
from ..tiered_seal import FAR_FORMATS

try:
    import torch
    from transformers.cache_utils import CacheLayerMixin

    from . import _hf_route as R
    from ._hf_route import ATTN_IMPLEMENTATION
except ImportError as exc:   # pragma: no cover - exercised only without the extra
    raise ConfigError(f"kvreg.integrations.transformers needs torch and transformers ({exc}); "
                      "pip install 'kvreg[hf]'") from exc

__all__ = ["ATTN_IMPLEMENTATION", "KvregCache", "SUPPORTED", "kvreg_attention_forward", "sliding_slack"]

#: The storage a model of each dtype gets when no mode is asked for.
_DTYPE_MODES = {"torch.float16": KvMode.F16, "torch.bfloat16": KvMode.BF16}

#: model_type -> what its tests cover: the families measured against
#: ``DynamicCache`` (tests/test_transformers_*.py). Other families are
#: served by capability (the module docstring), not by name.
SUPPORTED = {
    "llama": "Llama family (SmolLM2, Llama 2/3): GQA, RoPE",
    "gemma3_text": "Gemma 3: sliding-window and global layers, QK-norm",
    "mistral": "Mistral: a sliding window on every layer",
    "qwen2": "Qwen2 / Qwen2.5: QKV biases, per-layer sliding windows",
    "qwen3": "Qwen3: QK-norm",
    "phi3": "Phi-3: fused QKV",
    "gemma2": "Gemma 2: attention logit soft-capping, alternating sliding layers",
    "olmo2": "OLMo 2: QK-norm over all heads",
    "gpt_oss": "GPT-OSS: learned attention sinks, mixture of experts, sliding layers",
    "gpt_neox": "GPT-NeoX / Pythia: multi-head attention, partial rotary, fused QKV",
    "mixtral": "Mixtral: mixture of experts",
    "mimo_v2_flash": "MiMo-V2-Flash: KV heads per layer, sinks on the sliding layers only",
    "bert": "BERT run as a decoder (is_decoder=True): absolute positions, post-norm",
    "phimoe": "Phi-3.5-MoE: a sliding window its masks apply",
}


def kvreg_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The ``"kvreg"`` attention: keys tagged by a :class:`KvregCache` are
    stored and attended in kvreg; untagged keys (another cache's forward)
    go to the implementation the model was configured with."""
    tag = getattr(key, "_kvreg_tag", None)
    if tag is None or tag.value is not value:
        return R.untagged_attention(module, query, key, value, attention_mask, **kwargs)
    call = R.read_call(module, kwargs)
    # kvreg runs inside the model's forward for this call: its decode may use
    # torch's spinning OpenMP workers (kvreg.threads.set_torch_model; the
    # thread-local read and written directly, a frame costs µs in a model)
    prev = getattr(_model, "on", False)
    _model.on = True
    try:
        return tag.cache._attend(tag.layer_idx, query, key, value, attention_mask, call)
    finally:
        _model.on = prev


def _register() -> None:
    R.register(kvreg_attention_forward)


class KvregLayer(CacheLayerMixin):
    """One model layer of a :class:`KvregCache` (the rows live in the
    per-sequence :class:`kvreg.KvCache` objects; this counts columns)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: KvregCache, index: int, sliding_window: int | None):
        super().__init__()
        self.owner = owner
        self.index = index
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.owner._router.depth:
            raise ConfigError("KvregCache: update outside a forward of the model the cache was built for (call "
                              "the model, or a PreTrainedModel inside it, with the cache)")
        self.owner._check_states(self.index, key_states, value_states)
        self.seen += int(key_states.shape[-2])
        return R.tag(self.owner, self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Absolute columns from 0: the mask's last `query_length` columns are
        # the new tokens; padding shows as all-false columns.
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0
        self.owner._reset_layer(self.index)

    def crop(self, tokens_to_remove: int) -> None:
        raise ConfigError("crop a KvregCache as a whole (cache.crop): its layers roll back together")

    def reorder_cache(self, beam_idx) -> None:
        raise ConfigError("KvregCache does not support beam search (reorder_cache); use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ConfigError("KvregCache does not support batch_repeat_interleave (beam search, contrastive search)")

    def batch_select_indices(self, indices) -> None:
        raise ConfigError("KvregCache does not support batch_select_indices (beam search, contrastive search)")


class KvregCache(R.RoutedCache):
    """A ``transformers.Cache`` whose rows and attention live in kvreg.

    ``model``: a transformers causal LM on the CPU whose attention kvreg
    can serve exactly (the module docstring; anything else is refused
    here, with the reason). The model's forwards handed this cache run
    kvreg's attention; its forwards with any other cache run as configured.
    ``mode``: a :class:`kvreg.KvMode` or its name (None: ``KVREG_KV``, else the
    model's dtype). ``backend``: a kvreg backend name or instance (None:
    ``KVREG_BACKEND``). ``policy`` / ``budget`` / ``sink``: eviction of the
    global layers at ``budget`` rows (a budget alone: ``Born(sink=4)``).
    ``o1=(m, w, sink[, heavy])``: the O(1) seal on the global layers, far
    field ``o1_far`` (``"tiered"`` or ``"nystrom"``); the tiered one keeps
    far rows as ``o1_far_format`` (``"int4"``, ``"int2"``, ``"int8"``), with
    ``o1_observe=n`` chooses rows by the prompt's last ``n`` queries, and
    with ``o1_sliding=True`` seals the sliding layers within their window.
    """
    layers: list[KvregLayer]  # type: ignore[assignment]  # Cache's type names its own layer kinds

    def __init__(self, model, mode: KvMode | str | None = None, backend=None, policy=None, *,
                 budget: int | None = None, sink: int = 0, o1: tuple[int, ...] | None = None,
                 o1_far: str = "tiered", o1_far_format: str = "int4", o1_observe: int = 0,
                 o1_sliding: bool = False, q8_exact_rows: int = Q8_EXACT_ROWS):
        if not (hasattr(model, "config") and hasattr(model.config, "get_text_config")
                and isinstance(model, torch.nn.Module)):
            raise ConfigError(f"KvregCache expects a transformers causal LM, got {type(model).__name__}")
        device = next(model.parameters()).device
        if device.type != "cpu":
            raise ConfigError(f"KvregCache runs on the CPU (kvreg's backends take host arrays); the model is on "
                              f"{device}. Move it with model.to('cpu')")
        if mode is None:
            mode = os.environ.get("KVREG_KV", "").strip() or _DTYPE_MODES.get(str(model.dtype), KvMode.F32)
        self.mode = KvMode.parse(mode)
        if budget is not None:
            V.positive_int("budget", budget)
            budget = int(budget)
            policy = Born(4) if policy is None else policy
        elif policy is not None:
            raise ConfigError("an eviction policy needs budget=N (rows kept per global layer)")
        if policy is not None:
            check_policy(policy)
        self.sink = int(V.nonneg_int("sink", sink))
        if isinstance(policy, Snap):
            if o1 is not None:
                raise ConfigError("o1 and budget both bound the cache; pass one of them")
            heavy = budget - policy.sink - policy.recent  # type: ignore[operator]  # a policy comes with a budget
            if heavy < 0:
                raise ConfigError(f"EvictionPolicy.Snap keeps sink + recent = {policy.sink + policy.recent} rows; "
                                  f"budget={budget} is smaller")
            # Snap is the tiered seal without far rows (kvreg.cache.Snap).
            o1, o1_observe, budget = (0, policy.recent, policy.sink, heavy), policy.observe, None
        if o1 is not None:
            if budget is not None:
                raise ConfigError("o1 and budget both bound the cache; pass one of them")
            if not (isinstance(o1, (tuple, list)) and len(o1) in (3, 4)):
                raise ConfigError(f"o1 must be (m, w, sink) or (m, w, sink, heavy), got {o1!r}")
            for name, x in zip(("o1 m", "o1 w", "o1 sink", "o1 heavy"), o1):
                V.nonneg_int(name, x)
            o1 = tuple(int(x) for x in o1)
        if o1_far not in FAR_FIELDS:
            raise ConfigError(f"o1_far must be one of {', '.join(map(repr, FAR_FIELDS))}, got {o1_far!r}")
        if o1_far_format not in FAR_FORMATS:
            raise ConfigError(f"o1_far_format must be one of {', '.join(map(repr, FAR_FORMATS))}, "
                              f"got {o1_far_format!r}")
        o1_observe = int(V.nonneg_int("o1_observe", o1_observe))
        o1_sliding = V.flag("o1_sliding", o1_sliding)
        if o1_far != "tiered" and (o1_observe or o1_far_format != "int4" or o1_sliding):
            raise ConfigError("o1_observe, o1_far_format and o1_sliding are the tiered far field's "
                              "(o1_far='tiered')")
        shape = R.probe(model)
        if o1 is not None and (shape.softcap or shape.sinks):
            raise ConfigError("o1: the sealed far field has no attention soft-cap or learned sinks, which this "
                              "model's attention uses; use a plain cache or a budget")
        self.policy, self.budget, self.o1, self.o1_far = policy, budget, o1, o1_far
        self.o1_far_format, self.o1_observe, self.o1_sliding = o1_far_format, o1_observe, o1_sliding
        self.backend = backend
        self.q8_exact_rows = q8_exact_rows
        self.num_layers = shape.num_layers
        # The first attending layer's geometry; a layer may have its own
        # (self.geometry: KV heads and head_dim per layer).
        self.num_heads = shape.heads
        self.num_kv_heads = shape.kv_heads
        self.head_dim = shape.head_dim
        self.geometry = list(shape.geometry)
        self.windows = list(shape.windows)
        self._router = R.router_for(model)
        self._sinks: dict = {}   # layer index -> the model's sink logits, float32, as last read
        # One sequence now: a bad mode, backend or geometry fails here, not at
        # the first token. The first forward sizes the list to its batch.
        self._seqs: list[KvCache] = [self._new_sequence()]
        self._mask_memo: tuple[object, bool] | None = None   # (mask, whether its new column is attended): _new_column
        self._masks_checked: list = []   # (mask, window) pairs _check_mask passed, newest first
        self._steps: dict = {}   # layer index -> its decode step and output: _decode_step
        super().__init__(layers=[KvregLayer(self, i, w) for i, w in enumerate(self.windows)])
        _register()

    # ── the per-sequence kvreg caches ──

    def _new_sequence(self) -> KvCache:
        seq = KvCache(self.num_layers, self.num_kv_heads, self.head_dim, max_seq_len=2**62, mode=self.mode,
                      backend=self.backend, q8_exact_rows=self.q8_exact_rows)
        for i, (kvh, hd) in enumerate(self.geometry):
            if (kvh, hd) != (self.num_kv_heads, self.head_dim):
                seq.layers[i] = LayerKvCache(kvh, hd, self.mode, self.backend, layer=i,
                                             q8_exact_rows=self.q8_exact_rows)
        return seq

    @property
    def backend_name(self) -> str:
        """The kvreg backend every layer runs on."""
        return self._seqs[0].layers[0].backend.name

    @property
    def sequences(self) -> list[KvCache]:
        """One :class:`kvreg.KvCache` per batch row (empty before the first forward)."""
        return list(self._seqs)

    def fork(self) -> KvregCache:
        """A cache that continues from this one's state as a copy would,
        every sequence's rows shared copy-on-write (:meth:`kvreg.KvCache.fork`):
        prefill a shared prompt once, fork it per request, and the prompt's
        rows are held once while each fork decodes on."""
        new = copy.copy(self)
        new._seqs = [seq.fork() for seq in self._seqs]
        new._steps = {}   # a fork may decode in another thread: steps and buffers of its own
        new.layers = []
        for layer in self.layers:
            twin = KvregLayer(new, layer.index, layer.sliding_window)
            twin.seen, twin.is_initialized = layer.seen, layer.is_initialized
            new.layers.append(twin)
        return new

    def memory_bytes(self) -> int:
        """Bytes of KV state held, every sequence and layer (kvreg's count;
        rows shared with forks counted once: :func:`kvreg.resident_bytes`)."""
        return resident_bytes(self._seqs)

    # ── moving the whole cache between processes (kvreg.integrations.ray) ──

    #: ``export_wire``'s container: magic, then version.
    WIRE_MAGIC = b"KVRT"
    WIRE_VERSION = 1

    def export_wire(self) -> bytes:
        """Every sequence's KV state and every layer's ``seen`` column count
        (the model's positions), as one blob for :meth:`import_wire`.

        Layout (little-endian): magic ``KVRT``, u32 version 1, u32 sequences
        ``S``, u32 layers ``L``, u32 KV heads, u32 head_dim, u32 mode-name
        length + the ASCII name (``KvMode.value``), u32 ``q8_exact_rows``,
        ``L`` x u32 sliding window (0: a global layer), ``L`` x u64 ``seen``,
        then per sequence a u64 length and its ``KvCache.export_wire()``
        container (``KVRC``: v2 records for F32, v3 storage records, bit for
        bit, for every other mode, each record with its CRC-32; docs/wire.md).
        The ``KVRT`` header carries no checksum of its own: an import checks
        every field of it against this cache. A cache with the O(1) seal
        (``o1=...`` or ``EvictionPolicy.Snap``) is refused (its tiers are not
        part of the wire format)."""
        import struct

        if self.o1 is not None:
            raise ConfigError("KvregCache.export_wire: a cache with the O(1) seal (o1=... or EvictionPolicy.Snap) "
                              "cannot be exported (its tiers are not part of the wire format); use a plain, Born or "
                              "Recent budget, or sliding cache")
        mode = self.mode.value.encode("ascii")
        head = [self.WIRE_MAGIC, struct.pack("<6I", self.WIRE_VERSION, len(self._seqs), self.num_layers,
                                             self.num_kv_heads, self.head_dim, len(mode)), mode,
                struct.pack("<I", self.q8_exact_rows),
                struct.pack(f"<{self.num_layers}I", *(w or 0 for w in self.windows)),
                struct.pack(f"<{self.num_layers}Q", *(layer.seen for layer in self.layers))]
        parts = []
        for seq in self._seqs:
            blob = seq.export_wire()
            parts += [struct.pack("<Q", len(blob)), blob]
        return b"".join(head + parts)

    def import_wire(self, blob) -> None:
        """Install a blob written by :meth:`export_wire` (this process or
        another): every sequence and every layer's ``seen`` count are
        replaced, so the next forward continues where the exporter stopped.
        The exporter's model geometry (layers, KV heads, head_dim, sliding
        windows), mode and ``q8_exact_rows`` must be this cache's. Every
        check (the container, each sequence's records, positions against
        ``seen``) runs before anything changes: a refused blob leaves the
        cache as it was (:class:`~kvreg.errors.WireError` naming what was
        expected; :class:`~kvreg.errors.ConfigError` for a sealed cache)."""
        import struct

        from ..errors import WireError

        if self.o1 is not None:
            raise ConfigError("KvregCache.import_wire: a cache with the O(1) seal (o1=... or EvictionPolicy.Snap) "
                              "cannot import (its tiers are not part of the wire format); build it without them")
        try:
            mv = memoryview(blob).cast("B")
        except TypeError:
            raise WireError("KvregCache.import_wire expects a bytes-like KvregCache.export_wire() blob, "
                            f"got {type(blob).__name__}") from None
        at = 0

        def take(n: int, what: str) -> memoryview:
            nonlocal at
            if len(mv) - at < n:
                raise WireError(f"KvregCache wire: truncated {what}: needs {n} byte(s), {len(mv) - at} left "
                                f"(at byte {at})")
            at += n
            return mv[at - n:at]

        magic = bytes(take(4, "magic"))
        if magic != self.WIRE_MAGIC:
            hint = " (a KvCache container: import it with KvCache.import_wire)" if magic == b"KVRC" else ""
            raise WireError(f"KvregCache wire: expected magic {self.WIRE_MAGIC!r} (a KvregCache.export_wire() "
                            f"blob), got {magic!r}{hint} (at byte 0)")
        version, nseq, nlayers, kvh, hd, mlen = struct.unpack("<6I", take(24, "header"))
        if version != self.WIRE_VERSION:
            raise WireError(f"KvregCache wire: expected version {self.WIRE_VERSION}, got {version} (at byte 4)")
        if nlayers != self.num_layers or kvh != self.num_kv_heads or hd != self.head_dim:
            raise WireError(f"KvregCache wire: the blob holds {nlayers} layers x {kvh} KV heads x head_dim {hd}; "
                            f"expected this model's {self.num_layers} x {self.num_kv_heads} x {self.head_dim} "
                            "(at byte 12)")
        if not 1 <= nseq <= 2**20:
            raise WireError(f"KvregCache wire: expected 1 to 2**20 sequences, got {nseq} (at byte 8)")
        if not 1 <= mlen <= 32:
            raise WireError(f"KvregCache wire: expected a mode name of 1..32 bytes, got length {mlen} (at byte 24)")
        mode = bytes(take(mlen, "mode name")).decode("ascii", "replace")
        if mode != self.mode.value:
            raise WireError(f"KvregCache wire: the blob stores {mode!r} rows, this cache stores "
                            f"{self.mode.value!r}: build the importing cache with mode={mode!r} (at byte 28)")
        (exact,) = struct.unpack("<I", take(4, "q8_exact_rows"))
        if exact != self.q8_exact_rows:
            raise WireError(f"KvregCache wire: the exporter kept q8_exact_rows={exact}, this cache "
                            f"{self.q8_exact_rows}: build it with q8_exact_rows={exact} (at byte {at - 4})")
        windows = struct.unpack(f"<{nlayers}I", take(4 * nlayers, "sliding windows"))
        if list(windows) != [w or 0 for w in self.windows]:
            raise WireError(f"KvregCache wire: the exporter's sliding windows per layer (0: global) are "
                            f"{list(windows)}, expected this model's {[w or 0 for w in self.windows]} "
                            f"(at byte {at - 4 * nlayers})")
        seen = struct.unpack(f"<{nlayers}Q", take(8 * nlayers, "seen counts"))
        if any(s > 2**53 for s in seen):
            raise WireError(f"KvregCache wire: expected seen counts up to 2**53, got {max(seen)} "
                            f"(at byte {at - 8 * nlayers})")
        seqs = []
        for i in range(nseq):
            (n,) = struct.unpack("<Q", take(8, f"length of sequence {i}"))
            start = at
            body = take(n, f"sequence {i}")
            seq = self._new_sequence()
            try:
                seq.import_wire(body)
            except WireError as exc:
                raise WireError(f"KvregCache wire: sequence {i} (at byte {start}): {exc}") from exc
            for j, (layer, s) in enumerate(zip(seq.layers, seen)):
                if layer.pos_len > s:
                    raise WireError(f"KvregCache wire: sequence {i} layer {j} holds position {layer.pos_len}, "
                                    f"past the layer's seen count {s}: expected at most {s} positions")
            seqs.append(seq)
        if at != len(mv):
            raise WireError(f"KvregCache wire: {len(mv) - at} trailing byte(s) after {nseq} sequence(s); "
                            f"expected the blob to end (at byte {at})")
        # Everything checked: install.
        self._seqs = seqs
        for hf_layer, s in zip(self.layers, seen):
            hf_layer.seen = int(s)
            hf_layer.is_initialized = True

    def _check_states(self, layer_idx: int, key, value) -> None:
        ks = key.shape
        kvh, hd = self.geometry[layer_idx]
        if (ks == value.shape and len(ks) == 4 and ks[1] == kvh and ks[3] == hd
                and ks[0] == len(self._seqs) and key.is_cpu and value.is_cpu):
            return   # every decode step of every layer: nothing to refuse, no sequence to make
        for name, t in (("key_states", key), ("value_states", value)):
            if t.device.type != "cpu":
                raise ConfigError(f"KvregCache runs on the CPU; {name} of layer {layer_idx} is on {t.device}")
            if t.ndim != 4 or t.shape[1] != kvh or t.shape[3] != hd:
                raise ShapeError(f"{name} of layer {layer_idx} has shape {tuple(t.shape)}; expected "
                                 f"[batch, {kvh}, n, {hd}]")
        if key.shape != value.shape:
            raise ShapeError(f"key_states {tuple(key.shape)} and value_states {tuple(value.shape)} differ")
        b = int(key.shape[0])
        if not any(layer.seen for layer in self.layers):
            if len(self._seqs) != b:
                self._seqs = [self._new_sequence() for _ in range(b)]
        elif b != len(self._seqs):
            raise ShapeError(f"batch of {b} sequences for a cache holding {len(self._seqs)}; reset() it first")

    def _reset_layer(self, layer_idx: int) -> None:
        for seq in self._seqs:
            seq.layers[layer_idx].clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens from every layer,
        as ``DynamicCache.crop`` does: 0 removes nothing, a count past the
        tokens held empties the cache, a positive count is refused (a
        :class:`ConfigError`, a ``ValueError`` as transformers raises).
        Plain caches only; every refusal comes before any layer changes."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)):
            raise ConfigError(f"KvregCache.crop expects an integer count (negative: tokens to remove), got "
                              f"{tokens_to_remove!r}")
        if tokens_to_remove > 0:
            raise ConfigError(f"KvregCache.crop({tokens_to_remove}): a positive count is not supported, as in "
                              "DynamicCache; pass -N to remove the newest N tokens")
        seen = self.layers[0].seen if self.layers else 0
        n = min(-int(tokens_to_remove), seen)
        if n == 0:
            return
        if self.budget is not None or self.o1 is not None or any(w is not None for w in self.windows):
            raise ConfigError("KvregCache.crop works on plain caches only (no budget, no seal, no sliding layers)")
        for i, layer in enumerate(self.layers):
            if layer.seen < n or any(seq.layers[i].seq_len != layer.seen for seq in self._seqs):
                raise ConfigError("KvregCache.crop: every sequence must hold every column (no padded batch)")
        for i, layer in enumerate(self.layers):
            for seq in self._seqs:
                seq.layers[i].truncate_last(n)
            layer.seen -= n

    # ── attention ──

    def _attend(self, layer_idx: int, query, key, value, mask, call: R.Call):
        bsz, nh, q_len, hd = query.shape
        if nh % self.geometry[layer_idx][0]:
            raise ShapeError(f"{nh} query heads are not a multiple of {self.geometry[layer_idx][0]} KV heads")
        window = self.windows[layer_idx] if call.window is None else call.window
        scale, softcap = call.scale, call.softcap
        if call.sinks is not None:
            self._set_sinks(layer_idx, call.sinks)
        if q_len == 1 and bsz == 1 and self._new_column(mask):
            # A decode step of one sequence (every layer, every token): numpy
            # views of the states, no mask ops past the first layer's, and
            # for a plain layer its prepared decode step
            # (LayerKvCache.decode_step), which writes into the layer's own
            # output buffer (each torch, numpy or Python call here costs
            # several µs inside the model).
            layer = self._seqs[0].layers[layer_idx]
            if layer.lifecycle is Lifecycle.PLAIN and self.o1 is None and not isinstance(self.policy, Born):
                got = self._steps.get(layer_idx)
                if got is None or got[1].layer is not layer or got[2] != (scale, window, softcap):
                    got = self._steps[layer_idx] = _decode_step(layer, nh, scale, window, softcap)
                got[1](_host(key)[0, :, 0], _host(value)[0, :, 0], _host(query)[0, :, 0])
                self._bound(layer, window)
                return (got[0] if query.dtype == torch.float32 else got[0].to(query.dtype)), None
            out = torch.from_numpy(self._attend_sequence(layer, _host(query)[0].transpose(1, 0, 2), _host(key)[0],
                                                         _host(value)[0], scale, window, softcap)[None])
            return (out if query.dtype == torch.float32 else out.to(query.dtype)), None
        self._check_mask(mask, layer_idx, window, q_len)
        with torch.no_grad():
            q = query.detach().to(torch.float32).transpose(1, 2)   # [b, n, nh, hd]
            # K/V stay head-major [b, kvh, n, hd], the storage's layout: a
            # float32 model's states are stored without another copy.
            k = key.detach().to(torch.float32)
            v = value.detach().to(torch.float32)
            shape = (bsz, q_len, nh, hd)
            if q_len == 1 and bsz > 1:
                step_out = np.zeros(shape, dtype=np.float32)
                self._decode_batch(layer_idx, q, k, v, mask, scale, window, softcap, step_out)
                return torch.from_numpy(step_out).to(query.dtype), None
            buf = None
            for b in range(bsz):
                cols = _new_columns(mask, b, q_len)
                qb, kb, vb = (q[b], k[b], v[b]) if cols is None else (q[b, cols], k[b][:, cols], v[b][:, cols])
                if qb.shape[0] == 0:
                    continue
                res = self._attend_sequence(self._seqs[b].layers[layer_idx], qb.numpy(), kb.numpy(), vb.numpy(),
                                            scale, window, softcap)
                if bsz == 1 and cols is None:
                    # One unpadded sequence (a prefill): its answer is the
                    # output, without a zeroed [n, nh, hd] buffer and a copy
                    # into it (~2 ms of a 4k SmolLM2 layer's ~95).
                    return torch.from_numpy(res[None]).to(query.dtype), None
                if buf is None:
                    buf = np.zeros(shape, dtype=np.float32)
                if cols is None:
                    buf[b] = res
                else:
                    buf[b, cols.numpy()] = res
            return torch.from_numpy(np.zeros(shape, dtype=np.float32) if buf is None else buf).to(query.dtype), None

    def _check_mask(self, mask, layer_idx: int, window: int | None, q_len: int) -> None:
        """Refuse a mask that asks for other columns than kvreg attends,
        before this layer stores anything: each real query row must see
        every position its sequence stored so far, newest ``window`` only
        (a chunked or bidirectional pattern, padding between tokens under a
        window, a window other than the layer's). Once per mask and window
        (the layers of a forward share their masks). A budget or the seal
        drops rows where a layer's ``pos_len`` no longer counts its
        sequence's tokens: not checked there."""
        if self.budget is not None or self.o1 is not None:
            return
        if mask is None:
            # no mask: full causal attention (SDPA's skip), which a window
            # kvreg applies past its length would not be
            if window is not None and q_len > 1 and any(seq.layers[layer_idx].pos_len + q_len > window
                                                        for seq in self._seqs):
                raise ConfigError(f"KvregCache: layer {layer_idx} has no mask for a {q_len}-token step past its "
                                  f"window of {window}: its attention covers every token, kvreg's the newest "
                                  f"{window}")
            return
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.ndim != 4:
            return
        if any(m is mask and w == window for m, w in self._masks_checked):
            return
        m = mask[:, 0]
        new = m[..., -q_len:].any(dim=1)                      # [B, q]: the real tokens among the new columns
        before = torch.tensor([seq.layers[layer_idx].pos_len for seq in self._seqs])
        want = before[:, None] + new.cumsum(-1)
        if window is not None:
            want = want.clamp(max=window)
        got = m.sum(-1)
        bad = new & (got != want)
        if bool(bad.any()):
            b, i = (int(x) for x in torch.nonzero(bad)[0])
            span = f"the newest {window}" if window is not None else "every one"
            raise ConfigError(f"KvregCache: layer {layer_idx}'s mask lets token {i} of sequence {b} see "
                              f"{int(got[b, i])} positions where kvreg attends {int(want[b, i])} ({span} its "
                              "sequence stored): a chunked or bidirectional pattern, padding between tokens "
                              "under a window, or a window other than the layer's")
        self._masks_checked = [(mask, window)] + self._masks_checked[:3]

    def _set_sinks(self, layer_idx: int, sinks) -> None:
        """The model's learned sink logits (one per query head) as every
        sequence's layer's ``sinks``, which each attend reads. Compared by
        value at each call: an edit through ``param.data`` leaves the
        parameter's version counter as it was."""
        cur = sinks.detach()
        cur = (cur if cur.dtype == torch.float32 else cur.to(torch.float32)).reshape(-1).numpy()
        logits = self._sinks.get(layer_idx)
        if logits is None or not np.array_equal(logits, cur):
            logits = self._sinks[layer_idx] = cur.copy()
        for seq in self._seqs:
            layer = seq.layers[layer_idx]
            if layer.sinks is not logits:
                layer.sinks = logits

    def _attend_sequence(self, layer, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale, window,
                         softcap: float = 0.0) -> np.ndarray:
        """Store ``n`` new rows of one sequence and attend its ``n`` queries
        (``q [n, nh, hd]``, ``k``/``v`` head-major ``[kvh, n, hd]``); returns ``[n, nh, hd]``."""
        n, nh = q.shape[0], q.shape[1]
        if (self.o1 is not None and (window is None or self.o1_sliding) and layer.seq_len == 0
                and layer.lifecycle is Lifecycle.PLAIN):
            m, w, sink, *heavy = self.o1
            # a sliding layer's first rows leave its window: it keeps no sinks
            layer.o1_begin(m, w, sink if window is None else 0, scale=scale, auto=True, far=self.o1_far,
                           heavy=heavy[0] if heavy else None, far_format=self.o1_far_format,
                           observe=self.o1_observe, window=window)
        born = isinstance(self.policy, Born)
        if layer.lifecycle is Lifecycle.SEALED:
            # A sealed layer takes a position at a time (a multi-token step: one by one).
            outs = []
            for i in range(n):
                layer.append(k[:, i], v[:, i])
                outs.append(layer.attend_layer(q[i], sinks=None))
            return np.stack(outs)
        s0 = layer.seq_len
        if n == 1:
            layer.append(k[:, 0], v[:, 0])  # the seal's boundary, while collecting
            sealed = layer.lifecycle is Lifecycle.SEALED
            out = layer.attend_layer(q[0], scale=scale, window=window, softcap=softcap,
                                     sinks=None if sealed else "layer", importance=born and not sealed)[None]
        elif softcap or layer.sinks is not None:
            # attend_chunk has no soft-cap or sinks: the chunk's rows are
            # appended and attended one at a time, each attend_layer call
            # seeing exactly the rows before it (causal), with both.
            out = np.empty((n, nh, layer.head_dim), np.float32)
            for i in range(n):
                layer.append(k[:, i], v[:, i])
                out[i] = layer.attend_layer(q[i], scale=scale, window=window, softcap=softcap, importance=born)
        else:
            layer.extend(k, v, layout="hnd")
            # Importance is read by Born eviction and the tiered seal only: a
            # plain cache skips its column sums (2 % of a 4k prefill).
            out = layer.attend_chunk(q, b=n, s0=s0, heads_per_kv=nh // layer.num_kv_heads, scale=scale, window=window,
                                     importance=born or self.o1 is not None)
        if layer.lifecycle is Lifecycle.COLLECTING:
            layer.seal.seal_if_ready()   # at the prompt's end: its rows are not held past this forward
        self._bound(layer, window)
        return out

    def _decode_batch(self, layer_idx: int, q, k, v, mask, scale, window, softcap, out: np.ndarray) -> None:
        """A decode step of a batch: each sequence with a new column stores
        its row, then one :func:`kvreg.attend_batch` call attends them all
        (bit for bit what one ``attend_layer`` per sequence answers)."""
        rows = [b for b in range(q.shape[0]) if (c := _new_columns(mask, b, 1)) is None or c.numel()]
        layers = [self._seqs[b].layers[layer_idx] for b in rows]
        kn, vn = k[:, :, 0].numpy(), v[:, :, 0].numpy()      # [b, kvh, hd]
        for b, layer in zip(rows, layers):
            layer.append(kn[b], vn[b])                        # a self-sealing layer seals here
        if layers:
            out[rows, 0] = attend_batch(q[rows, 0].numpy(), layers, scale=scale, window=window, softcap=softcap,
                                        importance=isinstance(self.policy, Born))
        for layer in layers:
            self._bound(layer, window)

    def _new_column(self, mask) -> bool:
        """Whether the one sequence of a one-token step attends its new
        column (it is not padding). The layers of a forward share two masks
        (sliding, global): each is read once, at its first layer."""
        if mask is None:
            return True
        memo = self._mask_memo
        if memo is not None and memo[0] is mask:
            return memo[1]
        new = _new_columns(mask, 0, 1) is None
        self._mask_memo = (mask, new)   # holding the mask: its id is not reused while memoized
        return new

    def _bound(self, layer, window: int | None) -> None:
        rows = layer.seq_len
        if window is not None:
            drop = sliding_trim(rows, window, layer.storage.drop_align)
            if drop:
                layer.evict(rows - drop)
        elif self.budget is not None and rows > self.budget:
            keep = self.budget
            if isinstance(self.policy, Born):
                layer.evict_born(keep, self.policy.sink, max(keep // 2, 1))
            elif self.sink:
                layer.evict_born(keep, self.sink, max(keep - self.sink, 0))
            else:
                layer.evict(keep)


def _decode_step(layer, nh: int, scale, window, softcap: float) -> tuple:
    """A layer's decode output ``[1, 1, nh, hd]`` float32 tensor, the
    layer's :class:`kvreg.DecodeStep` that writes it (through its numpy view
    ``[nh, hd]``) and the ``(scale, window, softcap)`` it was made for: one per
    layer, reused every token (the model reads the output before the
    layer's next step; a tensor from ``torch.from_numpy`` per call costs
    ~10-20 µs inside a model)."""
    t = torch.empty((1, 1, nh, layer.head_dim), dtype=torch.float32)
    step = layer.decode_step(nh, scale=scale, window=window, softcap=softcap, importance=False,
                             out=t.numpy().reshape(nh, -1))
    return t, step, (scale, window, softcap)


def _host(t) -> np.ndarray:
    """A CPU tensor's float32 values as numpy: a view of a float32 one (no
    ``detach`` call under ``no_grad``: each torch call costs inside a model)."""
    if t.requires_grad:
        t = t.detach()
    return (t if t.dtype == torch.float32 else t.to(torch.float32)).numpy()


def _new_columns(mask, b: int, q_len: int):
    """Indices of the new columns that sequence ``b`` attends (None: all).

    A padded column is false for every query row; a real token's column is
    true at least on its own row (causal masks include the diagonal).
    """
    if mask is None or not isinstance(mask, torch.Tensor) or mask.ndim != 4:
        return None
    m = mask[b if mask.shape[0] > 1 else 0, 0, :, -q_len:]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    valid = m.any(dim=0)
    if bool(valid.all()):
        return None
    return torch.nonzero(valid).flatten()


# Importing the module registers the attention; it is inert until a model
# is switched to it.
_register()
