"""How a transformers model reaches kvreg one forward at a time, and what
its attention asks of a cache.

Routing. transformers picks the attention function and the mask function
by the name in ``config._attn_implementation``, read at every call. A
model handed to :class:`~kvreg.integrations.transformers.KvregCache` gets
forward hooks on itself and its inner ``PreTrainedModel`` modules: a
forward whose arguments hold a kvreg cache reads ``"kvreg"`` there for its
duration, every other forward reads the name the model was configured with
(``eager``, ``sdpa``, ...), untouched. While one thread runs a kvreg forward,
another thread's forward of the same model with another cache sees the
switched name, so the ``"kvreg"`` functions hand it on: its masks and its
(untagged) keys go to the functions of the configured implementation.

Probe. :func:`probe` runs a forward of a few tokens through a recording
cache and reads what each layer hands its cache and its attention
function: per-head K/V geometry, sliding windows, soft-cap, learned sinks,
masks, and any argument kvreg does not implement. A model kvreg cannot
serve exactly is refused there, with the reason, before a cache exists.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..errors import ConfigError

#: The name under which the attention and mask functions are registered.
ATTN_IMPLEMENTATION = "kvreg"

_local = threading.local()          # .stack: the modules of this thread's running kvreg forwards
_lock = threading.Lock()            # guards every router's switch (held for microseconds)
_SWITCHED: list = []                # the routers whose configs read "kvreg" now

#: Attention-function keywords kvreg reads or knows to be inert for a causal
#: decoder in eval mode. Any other keyword holding a tensor (a bias, indices
#: of a sparse pattern) or named in :data:`_REFUSED_KWARGS` is refused; other
#: values (flags the model threads through its layers) pass.
KNOWN_KWARGS = frozenset({
    "scaling", "dropout", "sliding_window", "softcap", "s_aux", "sinks", "is_causal", "position_ids",
    "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "use_cache",
    "cache_position", "position_embeddings", "output_hidden_states", "return_dict"})
_REFUSED_KWARGS = frozenset({"position_bias", "indices", "block_indices", "alibi", "head_mask", "attention_bias",
                             "relative_position_bias"})
#: Known keywords that must be None: packed sequences (kvreg stores one
#: sequence per batch row).
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

#: Layer types whose state is not per-head keys and values.
_STATEFUL_TYPES = {"linear_attention", "conv", "mamba", "mamba2", "hybrid", "hybrid_sliding", "recurrent",
                   "rwkv", "xlstm", "indexed_attention", "heavily_compressed_attention",
                   "compressed_sparse_attention"}


class RoutedCache(Cache):
    """A cache whose forwards the router switches to ``"kvreg"``; its
    ``_attend(layer_idx, query, key, value, mask, call)`` answers the layer."""


class _Tag:
    """What ``update`` hands the attention function: whose columns these are."""

    __slots__ = ("cache", "layer_idx", "value")

    def __init__(self, cache: RoutedCache, layer_idx: int, value):
        self.cache, self.layer_idx, self.value = cache, layer_idx, value


def tag(cache: RoutedCache, layer_idx: int, key, value):
    key._kvreg_tag = _Tag(cache, layer_idx, value)
    return key, value


@dataclass(slots=True)
class Call:
    """One attention call's arguments, as kvreg reads them."""

    scale: float | None
    window: int | None
    softcap: float
    sinks: torch.Tensor | None


def read_call(module, kwargs: dict) -> Call:
    """The arguments kvreg implements, after refusing any it does not."""
    extra = kwargs.keys() - KNOWN_KWARGS
    if extra:
        live = sorted(k for k in extra
                      if kwargs[k] is not None and (k in _REFUSED_KWARGS or _holds_tensor(kwargs[k])))
        if live:
            raise ConfigError(f"KvregCache: {type(module).__name__} passes {', '.join(live)} to its attention "
                              "function, which kvreg does not implement (relative position biases, sparse or "
                              "indexed attention)")
    if kwargs.get("dropout"):
        raise ConfigError(f"KvregCache: attention dropout {kwargs['dropout']} ({type(module).__name__} in training "
                          "mode); kvreg serves inference: call model.eval()")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ConfigError(f"KvregCache: {type(module).__name__} runs bidirectional attention (is_causal=False); "
                          "kvreg serves causal decoders")
    for k in _PACKED:
        if kwargs.get(k) is not None:
            raise ConfigError(f"KvregCache: packed sequences ({k}); give each sequence its own batch row")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    window = kwargs.get("sliding_window")
    scale = kwargs.get("scaling")
    return Call(None if scale is None else float(scale), None if window is None else int(window),
                float(kwargs.get("softcap") or 0.0), sinks)


def _holds_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, (tuple, list)) and any(isinstance(y, torch.Tensor) for y in x))


# ── the switch ──


class Router:
    """Switches the configs a model's attention reads to ``"kvreg"`` for the
    forwards handed a :class:`RoutedCache` (plain data, so a deep copy of
    the model gets a router of its own configs)."""

    def __init__(self, configs: list):
        self.configs = configs
        self.depth = 0
        self.saved: list = []
        self.shape: ModelShape | None = None   # the probe's answer, once asked

    def pre(self, module, args, kwargs):
        if any(isinstance(x, RoutedCache) for x in kwargs.values()) or any(isinstance(x, RoutedCache) for x in args):
            self.enter(module)

    def post(self, module, args, kwargs, output):
        stack = getattr(_local, "stack", None)
        if stack and stack[-1] == (id(self), id(module)):
            self.exit()

    def enter(self, module=None) -> None:
        with _lock:
            if self.depth == 0:
                self.saved = [c._attn_implementation for c in self.configs]
                for c in self.configs:
                    c._attn_implementation = ATTN_IMPLEMENTATION
                _SWITCHED.append(self)
            self.depth += 1
        if not hasattr(_local, "stack"):
            _local.stack = []
        _local.stack.append((id(self), id(module)))

    @contextmanager
    def routed(self):
        """This thread's calls read ``"kvreg"`` inside the block (a forward's
        pieces called by hand)."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def exit(self) -> None:
        _local.stack.pop()
        with _lock:
            self.depth -= 1
            if self.depth == 0:
                for c, name in zip(self.configs, self.saved):
                    c._attn_implementation = name
                self.saved = []
                _SWITCHED.remove(self)


def router_for(model) -> Router:
    """The model's router, made (and its hooks installed) on first use."""
    router = model.__dict__.get("_kvreg_router")
    if router is None:
        # The decoder's config only: a vision tower keeps its own. A layer
        # reading another config object would attend a kvreg cache's keys
        # with another implementation; the probe sees it stored keys it
        # never attended through kvreg, and refuses the model.
        router = Router([model.config.get_text_config(decoder=True)])
        for m in [model] + [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel)]:
            m.register_forward_pre_hook(router.pre, with_kwargs=True)
            m.register_forward_hook(router.post, with_kwargs=True, always_call=True)
        model.__dict__["_kvreg_router"] = router
    return router


def in_kvreg_forward() -> bool:
    return bool(getattr(_local, "stack", None))


def original_name(config) -> str | None:
    """What ``config`` was configured with, whether or not a kvreg forward
    (another thread's) has it switched now."""
    name = config._attn_implementation
    if name != ATTN_IMPLEMENTATION:
        return name
    with _lock:
        for router in _SWITCHED:
            for c, saved in zip(router.configs, router.saved):
                if c is config:
                    name = saved
    # a model switched to "kvreg" by hand: SDPA answered its other caches
    return "sdpa" if name == ATTN_IMPLEMENTATION else name


def untagged_attention(module, query, key, value, attention_mask, **kwargs):
    """Keys no kvreg cache handed out: another cache's forward (the
    configured implementation answers it), or, inside a kvreg forward, a
    layer reading keys its cache never stored (refused)."""
    if in_kvreg_forward():
        raise ConfigError(f"KvregCache: {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) attends "
                          "keys and values its cache did not hand it (shared across layers, or computed from a "
                          "compressed latent); kvreg stores per-head keys and values of each layer")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = original_name(module.config)
    if name in (None, "eager"):
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ConfigError(f"KvregCache: cannot find the eager attention of {type(module).__name__} to answer "
                              "a forward without a kvreg cache while another thread runs one; set the model's "
                              "attention to 'sdpa'")
        return fn(module, query, key, value, attention_mask, **kwargs)
    return ALL_ATTENTION_FUNCTIONS[name](module, query, key, value, attention_mask, **kwargs)


def kvreg_mask(*args, **kwargs):
    """The ``"kvreg"`` mask: SDPA's boolean mask inside a kvreg forward (its
    all-false columns are the padding kvreg does not store); the configured
    implementation's mask for any other forward."""
    if in_kvreg_forward():
        seen = getattr(_local, "mask_windows", None)
        if seen is not None:                      # the probe's forward: which windows its masks slide
            seen.add(kwargs.get("local_size"))
        return sdpa_mask(*args, **kwargs)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = kwargs.get("config")
    name = "sdpa" if config is None else original_name(config)
    fn = None if name is None else ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name)
    # transformers' mapping holds mask functions of several signatures (its type is their join)
    return None if fn is None else cast(Callable[..., Any], fn)(*args, **kwargs)


def register(attention) -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvreg_mask)


# ── the probe ──


@dataclass(frozen=True)
class LayerShape:
    """What one layer's attention asked in the probe."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    softcap: float
    sinks: bool


@dataclass
class ModelShape:
    """A model's attention, as kvreg will serve it."""

    num_layers: int
    heads: int                                      # of the first attending layer
    kv_heads: int
    head_dim: int
    windows: list = field(default_factory=list)     # per layer: sliding window or None
    geometry: list = field(default_factory=list)    # per layer: (KV heads, head_dim)
    softcap: bool = False
    sinks: bool = False


class _ProbeCache(RoutedCache):
    """Records what each layer hands its cache and its attention function;
    answers zeros (the probe reads the calls, not the text)."""

    def __init__(self):
        super().__init__(layer_class_to_replicate=DynamicLayer)
        self.updates: dict = {}      # layer -> [(key shape, value shape)]
        self.calls: dict = {}        # layer -> [(query shape, Call, mask dtype or None)]
        self.bidirectional: set = set()   # layers whose mask lets a token see later ones
        self.mask_windows: set = set()    # the windows the forward's masks slide (None: unwindowed)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.updates.setdefault(layer_idx, []).append((tuple(key_states.shape), tuple(value_states.shape)))
        k, v = super().update(key_states, value_states, layer_idx)
        return tag(self, layer_idx, k, v)

    def _attend(self, layer_idx, query, key, value, mask, call: Call):
        self.calls.setdefault(layer_idx, []).append((tuple(query.shape), call, None if mask is None else mask.dtype))
        if mask is not None and mask.dtype == torch.bool and mask.ndim == 4 and query.shape[2] > 1:
            # a query row that sees a column after its own: bidirectional
            q = query.shape[2]
            later = torch.ones(q, q, dtype=torch.bool).triu(1)
            if bool((mask[..., -q:] & later).any()):
                self.bidirectional.add(layer_idx)
        b, nh, n, _ = query.shape
        return query.new_zeros((b, n, nh, value.shape[-1])), None


def cache_keyword(model) -> str:
    """The forward's name for the cache (``cache``; ``past_key_values`` before it)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _refuse(model, why: str):
    return ConfigError(f"KvregCache cannot serve {type(model).__name__} exactly: {why}")


def _attr(config, name: str):
    """A config value, or None (a per-layer attribute read globally raises
    in some configs: the probe reads those layers as they run)."""
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def _static_refusals(model, text) -> None:
    config = model.config
    if _attr(config, "is_encoder_decoder"):
        raise _refuse(model, "an encoder-decoder model (its cross-attention keys come from the encoder, not a "
                             "per-token cache); kvreg serves decoder-only causal LMs")
    if _attr(text, "add_cross_attention") or _attr(text, "cross_attention_layers"):
        raise _refuse(model, "its layers have cross-attention; kvreg serves decoder-only causal LMs")
    if _attr(text, "kv_lora_rank"):
        raise _refuse(model, "multi-head latent attention (MLA): transformers caches the compressed latent, not "
                             "per-head keys and values")
    types = set(_attr(text, "layer_types") or ())
    if "chunked_attention" in types or _attr(text, "attention_chunk_size"):
        raise _refuse(model, "chunked attention (each token sees its own chunk); kvreg's windows slide")
    stateful = sorted(types & _STATEFUL_TYPES)
    if stateful:
        what = "a recurrent or state-space model" if types <= _STATEFUL_TYPES else "a hybrid model"
        raise _refuse(model, f"{what}: layers of type {', '.join(stateful)} keep a state that is not "
                             "per-head keys and values")


def probe(model) -> ModelShape:
    """What the model's attention asks of a cache (memoized on the model's
    router), or a :class:`ConfigError` naming why kvreg cannot serve it."""
    router = router_for(model)
    if router.shape is not None:
        return router.shape
    text = model.config.get_text_config(decoder=True)
    _static_refusals(model, text)
    if not isinstance(model, PreTrainedModel):
        raise _refuse(model, "not a transformers PreTrainedModel")
    vocab = int(_attr(text, "vocab_size") or _attr(model.config, "vocab_size") or 2)
    ids = (torch.arange(5) * 7 + 3).remainder(vocab)[None]
    cache = _ProbeCache()
    kw = cache_keyword(model)
    _local.mask_windows = cache.mask_windows
    try:
        with torch.no_grad():
            # an attention mask, as generate passes one: the masks the layers
            # get are materialized, so a bidirectional one shows
            ones = torch.ones_like(ids)
            model(input_ids=ids[:, :4], attention_mask=ones[:, :4], use_cache=True, **{kw: cache})
            model(input_ids=ids[:, 4:], attention_mask=ones, use_cache=True, **{kw: cache})
    except ConfigError as exc:
        raise _refuse(model, str(exc).removeprefix("KvregCache: ")) from exc
    except Exception as exc:
        # The probe's two forwards run the model the way generate will with
        # this cache; whatever stops them (state the cache does not keep, a
        # mask the model reshapes itself) would stop generate too.
        raise _refuse(model, f"its forward failed on a two-step probe through a per-head key/value cache "
                             f"({type(exc).__name__}: {exc})") from exc
    finally:
        _local.mask_windows = None
    router.shape = _read_probe(model, text, cache)
    return router.shape


def _cached_windows(text, n: int) -> list:
    """Per layer, the window transformers' own ``DynamicCache`` keeps for
    this config (None: every key), which a model whose attention call names
    no window applies through its masks."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        types, kwargs = get_layer_types_and_kwargs(text)
    except Exception:
        types, kwargs = [], []
    windows = [kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(types, kwargs)]
    return (windows + [None] * n)[:n]


def _read_probe(model, text, cache: _ProbeCache) -> ModelShape:
    if not cache.calls:
        raise _refuse(model, "no layer attended through transformers' attention interface with this cache "
                             "(a recurrent or state-space model, or attention computed inside the model)")
    if cache.bidirectional:
        raise _refuse(model, f"layer {min(cache.bidirectional)}'s mask lets a token see later tokens "
                             "(bidirectional attention); kvreg serves causal decoders")
    unattended = sorted(set(cache.updates) - set(cache.calls))
    if unattended:
        raise _refuse(model, f"layer {unattended[0]} stores keys it does not attend through transformers' "
                             "attention interface (attention computed inside the layer, or read through another "
                             "configuration)")
    layers = {}
    for i, calls in sorted(cache.calls.items()):
        updates = cache.updates.get(i, [])
        if len(calls) > len(updates):
            raise _refuse(model, f"layers attend the keys layer {i} stored (keys shared across layers); each "
                                 "layer of a KvregCache attends its own keys")
        if len(updates) != 2 or len(calls) != 2:
            raise _refuse(model, f"layer {i} stored {len(updates)} and attended {len(calls)} times in two "
                                 "forwards; kvreg serves one cache update and one attention per layer and forward")
        (qs, call, mask), (ks, vs) = calls[0], updates[0]
        if len(ks) != 4 or ks[:2] + ks[3:] != vs[:2] + vs[3:] or qs[3] != ks[3]:
            raise _refuse(model, f"layer {i} stores keys {list(ks)} and values {list(vs)} for queries {list(qs)}; "
                                 "kvreg stores per-head keys and values as wide as the queries")
        if qs[1] % ks[1]:
            raise _refuse(model, f"layer {i} has {qs[1]} query heads for {ks[1]} KV heads (not a multiple)")
        if mask is not None and mask != torch.bool:
            raise _refuse(model, f"layer {i} adds a bias to its attention scores through the mask ({mask}: ALiBi "
                                 "or relative positions); kvreg attends masked, unbiased scores")
        if call.sinks is not None and tuple(call.sinks.shape) != (qs[1],):
            raise _refuse(model, f"layer {i}'s attention sinks have shape {list(call.sinks.shape)}; kvreg takes "
                                 f"one learned sink logit per query head ({qs[1]})")
        layers[i] = LayerShape(qs[1], ks[1], ks[3], call.window, call.softcap, call.sinks is not None)
    first = layers[min(layers)]
    heads, kv_heads, head_dim = first.heads, first.kv_heads, first.head_dim
    n = max(int(_attr(text, "num_hidden_layers") or 0), max(layers) + 1)
    geometry = [(layers[i].kv_heads, layers[i].head_dim) if i in layers else (kv_heads, head_dim) for i in range(n)]
    types = _attr(text, "layer_types") or []
    cached = _cached_windows(text, n)
    windows = []
    for i in range(n):
        called = layers[i].window if i in layers else None
        if called is not None and cached[i] is not None and called != cached[i]:
            raise _refuse(model, f"layer {i} attends a window of {called} where its config makes transformers' "
                                 f"caches keep {cached[i]}; kvreg will not pick one")
        if called is None and cached[i] is not None and cached[i] not in cache.mask_windows:
            raise _refuse(model, f"its config makes transformers' caches keep a window of {cached[i]} on layer {i}, "
                                 "whose attention and masks run unwindowed; kvreg will not pick one")
        window = called if called is not None else cached[i]
        if window is None and i < len(types) and types[i] == "sliding_attention":
            raise _refuse(model, f"layer {i} is a sliding layer whose window neither its attention call nor its "
                                 "config states")
        windows.append(None if window is None else int(window))
    return ModelShape(n, heads, kv_heads, head_dim, windows, geometry, softcap=any(s.softcap for s in layers.values()),
                      sinks=any(s.sinks for s in layers.values()))
