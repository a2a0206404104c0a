"""Prefill/decode disaggregation on Ray: ``PrefillWorker``, ``DecodeWorker``, ``generate``.

.. code-block:: python

    import ray
    from kvreg.integrations.ray import DecodeWorker, PrefillWorker, generate

    ray.init()
    prefill = PrefillWorker.remote("smollm2-135m")
    decoders = [DecodeWorker.remote("smollm2-135m") for _ in range(2)]
    result = generate(prefill, decoders, "def fibonacci(n):", max_new_tokens=64, mode="q8", every=8)
    print(result.tokens, result.resumes)

How it works:

- A **prefill worker** (a Ray actor holding a transformers model) runs the
  prompt through the model with a :class:`~kvreg.integrations.transformers.KvregCache`
  in one forward, takes the greedy first token, and returns the sequence's
  state as two objects: a small :class:`SequenceMeta` (prompt length, the
  tokens generated so far, the stop rule, the cache options) and the wire
  blob, :meth:`KvregCache.export_wire` (every layer's ``KvCache`` container
  -- v2 records for F32, v3 storage records bit for bit for q8, f16, ... --
  plus every layer's ``seen`` column count, i.e. the model's positions).
- The blob travels through Ray's object store as a read-only ``numpy.uint8``
  array over the blob's bytes: pickle protocol 5 puts its buffer out of band,
  so the decode worker's ``ray.get`` maps the object-store pages without a
  copy and ``import_wire`` decodes straight from them (a ``bytes`` object is
  pickled in band and copied once more on the way out). The wire format is
  what travels, rather than kvreg's raw storage arrays, because the importer
  copies into its own growable storage anyway, and the wire is versioned,
  carries every storage mode exactly and is validated in full before
  anything changes (``docs/wire.md``).
- **Integrity**: the meta carries the blob's size and CRC-32, which the
  decode worker checks before it reads a byte; inside, every ``KVRC``
  container carries a CRC-32 per layer record. A state changed on its way
  is refused (:class:`~kvreg.errors.WireError`), never decoded from.
- A **decode worker** imports the state into a fresh ``KvregCache`` of the
  same options (:meth:`DecodeWorker.load`) and continues greedy decoding
  where prefill stopped (:meth:`DecodeWorker.decode`): it feeds the last
  token, which prefill chose but did not feed, at position ``seen``.
- **Checkpoints**: ``decode(request_id, k)`` decodes at most ``k`` tokens and
  returns the new state (meta + blob), so the decode worker ships its state
  every ``k`` tokens (:func:`generate`'s ``every``). The blobs are the
  methods' *return values*, owned by the caller (the driver), not objects a
  worker ``ray.put`` itself: an object is lost with its owner, a return
  value outlives the worker that computed it (on a single node; a dead
  node's object store goes with it).
- **Failure**: when a decode worker dies (``ray.kill``, a crash), the
  driver's :func:`generate` gets ``RayActorError`` for the pending call,
  loads the last checkpoint into the next live decode worker and carries on.
  The tokens the dead worker produced after that checkpoint were never
  delivered; the new worker recomputes them from the same state, so no token
  is lost or repeated and the final list is the single-process run's.
  Checkpoints are whole states (the blob's size grows with the context),
  not deltas: ``every`` trades shipped bytes against recomputed tokens.

Batches: :meth:`KvregCache.export_wire` carries every sequence of a batched
cache; the workers run one sequence (one request) per cache. The O(1) seal
is refused (its overlay is not part of the wire format). Only greedy
decoding (what makes a resumed run reproducible token for token).
"""

from __future__ import annotations

import os
import time
import uuid
import zlib
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import ConfigError, StateError, WireError

try:
    import ray
    from ray.exceptions import RayActorError
except ImportError as exc:   # pragma: no cover - exercised only without the extra
    raise ConfigError(f"kvreg.integrations.ray needs ray ({exc}); pip install 'kvreg[ray]'") from exc

__all__ = ["CACHE_OPTIONS", "DecodeWorker", "Engine", "GenerateResult", "PrefillWorker", "SequenceMeta", "generate",
           "wire_array", "wire_crc32"]

#: The ``KvregCache`` options a sequence state carries (the decode worker
#: builds its cache with the same ones).
CACHE_OPTIONS = ("mode", "q8_exact_rows", "policy", "budget", "sink")


@dataclass(frozen=True)
class SequenceMeta:
    """What a decode worker needs beside the KV blob to continue a sequence.

    ``tokens``: every token generated so far; the last one has been chosen but
    not fed (the cache holds ``prompt_len + len(tokens) - 1`` positions, the
    blob's ``seen``). ``max_new_tokens`` and ``eos_token_ids``: when the
    sequence is done (``eos`` included in ``tokens``, as ``generate`` does).
    ``cache_options``: the ``KvregCache`` options (:data:`CACHE_OPTIONS`).
    ``wire_bytes``: the blob's size; ``checkpoint``: how many states this
    sequence has shipped (0: prefill's); ``wire_crc32``: the blob's CRC-32,
    checked by the loading worker before it imports anything (None: not
    checked; the blob's own records and containers carry theirs)."""

    request_id: str
    prompt_len: int
    tokens: tuple
    max_new_tokens: int
    eos_token_ids: tuple = ()
    cache_options: dict = field(default_factory=dict)
    wire_bytes: int = 0
    checkpoint: int = 0
    wire_crc32: int | None = None

    @property
    def seen(self) -> int:
        """The positions the cache holds: the prompt and every token but the last."""
        return self.prompt_len + len(self.tokens) - 1

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or (bool(self.tokens) and self.tokens[-1] in self.eos_token_ids)


def wire_crc32(wire) -> int:
    """The CRC-32 (zlib's) of a shipped blob, ``bytes`` or :func:`wire_array`."""
    return zlib.crc32(memoryview(wire).cast("B"))


def wire_array(blob: bytes) -> np.ndarray:
    """``blob`` as the read-only ``uint8`` array that travels: made without a
    copy, copied once into the object store by Ray, mapped without a copy by
    the ``ray.get`` of the receiver (pickle 5 out-of-band buffer)."""
    return np.frombuffer(blob, dtype=np.uint8)


def _eos_ids(eos) -> tuple:
    if eos is None:
        return ()
    ids = (eos,) if isinstance(eos, (int, np.integer)) else tuple(eos)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ConfigError(f"eos_token_id must be a token id (int >= 0) or a list of them, got {eos!r}")
    return tuple(int(t) for t in ids)


def _check_options(options) -> dict:
    if not isinstance(options, dict) or set(options) - set(CACHE_OPTIONS):
        extra = sorted(set(options) - set(CACHE_OPTIONS)) if isinstance(options, dict) else options
        raise ConfigError(f"cache options must be a dict with keys among {', '.join(CACHE_OPTIONS)} (the O(1) "
                          f"seal, o1, does not travel); got {extra!r}")
    return dict(options)


class Engine:
    """The model and the greedy loop a worker runs (usable without Ray: the
    workers are thin actors around it). ``model``: a :data:`kvreg.models.MODELS`
    name or a callable returning ``(model, tokenizer)``. ``threads``: torch's
    and kvreg's thread count in this process (None: leave them)."""

    def __init__(self, model="smollm2-135m", *, threads: int | None = None, backend=None):
        import torch

        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ConfigError(f"threads must be a positive int or None, got {threads!r}")
            import kvreg

            torch.set_num_threads(threads)
            kvreg.set_num_threads(threads)
        if isinstance(model, str):
            from ..models import load

            self.model, self.tokenizer = load(model)
        elif callable(model):
            self.model, self.tokenizer = model()
        else:
            raise ConfigError(f"model must be a kvreg.models name or a callable returning (model, tokenizer), "
                              f"got {type(model).__name__}")
        self.model_name = model if isinstance(model, str) else getattr(model, "__name__", "model")
        self.backend = backend
        self.torch = torch
        self._seqs: dict[str, tuple] = {}   # request_id -> (cache, meta)

    def _cache(self, options: dict):
        from .transformers import KvregCache

        return KvregCache(self.model, backend=self.backend, **options)

    def _prompt_ids(self, prompt) -> list:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a text prompt needs a tokenizer; pass token ids")
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = prompt
        try:
            ids = [int(t) for t in ids]
        except (TypeError, ValueError):
            raise ConfigError(f"prompt must be a string or a flat list of token ids, got {prompt!r:.80}") from None
        vocab = int(self.model.config.get_text_config(decoder=True).vocab_size)
        if not ids or any(t < 0 or t >= vocab for t in ids):
            raise ConfigError(f"prompt must hold 1 or more token ids in [0, {vocab}), got {ids[:8]}...")
        return ids

    def _next(self, cache, ids: list) -> int:
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits
        return int(logits[0, -1].argmax())

    def prefill(self, prompt, *, max_new_tokens: int, eos_token_id=None, request_id: str | None = None,
                **cache_options) -> tuple:
        """Run ``prompt`` (text or token ids), choose the first token; returns
        ``(SequenceMeta, wire array)``. ``cache_options``: :data:`CACHE_OPTIONS`."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        options = _check_options(cache_options)
        eos = _eos_ids(eos_token_id)
        ids = self._prompt_ids(prompt)
        cache = self._cache(options)
        # The options as resolved here (mode from KVREG_KV or the dtype, the
        # budget's default policy): the decode worker builds the same cache.
        options = {"mode": cache.mode.value, "q8_exact_rows": cache.q8_exact_rows, "policy": cache.policy,
                   "budget": cache.budget, "sink": cache.sink}
        first = self._next(cache, ids)
        blob = cache.export_wire()
        meta = SequenceMeta(request_id or uuid.uuid4().hex, len(ids), (first,), max_new_tokens, eos,
                            options, len(blob), 0, wire_crc32(blob))
        return meta, wire_array(blob)

    def load(self, meta: SequenceMeta, wire) -> int:
        """Import a shipped state; returns the positions it holds. Every
        check runs before the engine takes it (a refused state changes nothing)."""
        if not isinstance(meta, SequenceMeta):
            raise ConfigError(f"expected a SequenceMeta (from PrefillWorker.prefill or DecodeWorker.decode), "
                              f"got {type(meta).__name__}")
        if not meta.tokens or meta.prompt_len < 1:
            raise ConfigError(f"expected a state with a prompt and at least one chosen token, got prompt_len "
                              f"{meta.prompt_len} and {len(meta.tokens)} token(s)")
        if isinstance(wire, np.ndarray) and wire.dtype != np.uint8:
            raise WireError(f"expected the wire blob as a uint8 array (wire_array) or bytes, got a {wire.dtype} array")
        if meta.wire_crc32 is not None:
            # The whole blob, its KvregCache header included, before any of
            # it is read: a state changed on its way is refused as such.
            try:
                got, size = wire_crc32(wire), memoryview(wire).nbytes
            except TypeError:
                raise WireError(f"expected the wire blob as a uint8 array (wire_array) or bytes, got "
                                f"{type(wire).__name__}") from None
            if (got, size) != (meta.wire_crc32, meta.wire_bytes):
                raise WireError(f"the blob of request {meta.request_id} (checkpoint {meta.checkpoint}) is not the "
                                f"one its meta describes: {size} bytes of CRC-32 {got:08x}, expected "
                                f"{meta.wire_bytes} bytes of CRC-32 {meta.wire_crc32:08x}; it was changed in transit")
        options = _check_options(meta.cache_options)
        cache = self._cache(options)
        cache.import_wire(wire)
        seen = sorted({layer.seen for layer in cache.layers})
        if seen != [meta.seen]:
            # One sequence: every layer has seen every position.
            raise WireError(f"the blob holds {', '.join(map(str, seen))} positions per layer; expected {meta.seen} "
                            f"for request {meta.request_id} (prompt {meta.prompt_len} + {len(meta.tokens)} tokens "
                            "- 1) in every layer")
        self._seqs[meta.request_id] = (cache, meta)
        return meta.seen

    def decode(self, request_id: str, k: int, *, on_token=None) -> tuple:
        """Decode at most ``k`` tokens of a loaded sequence (fewer when it is
        done); returns the new ``(SequenceMeta, wire array)``: the checkpoint."""
        if request_id not in self._seqs:
            raise StateError(f"request {request_id!r} is not loaded here (load it first); loaded: "
                             f"{sorted(self._seqs)}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be an int >= 1 (tokens per checkpoint), got {k!r}")
        cache, meta = self._seqs[request_id]
        tokens = list(meta.tokens)
        for _ in range(k):
            if replace(meta, tokens=tokens).done:
                break
            tokens.append(self._next(cache, [tokens[-1]]))
            if on_token is not None:
                on_token(len(tokens))
        blob = cache.export_wire()
        meta = replace(meta, tokens=tuple(tokens), wire_bytes=len(blob), checkpoint=meta.checkpoint + 1,
                       wire_crc32=wire_crc32(blob))
        self._seqs[request_id] = (cache, meta)
        return meta, wire_array(blob)

    def release(self, request_id: str) -> bool:
        return self._seqs.pop(request_id, None) is not None


@ray.remote
class PrefillWorker:
    """A Ray actor that prefills prompts (see :class:`Engine` for the arguments)."""

    def __init__(self, model="smollm2-135m", *, threads: int | None = 1, backend=None):
        self.engine = Engine(model, threads=threads, backend=backend)

    def ready(self) -> int:
        return os.getpid()

    # ray's overloads of method() spell positional parameters only, not keyword-only ones.
    @ray.method(num_returns=2)  # type: ignore[arg-type]
    def prefill(self, prompt, *, max_new_tokens: int, eos_token_id=None, request_id=None, **cache_options):
        """``(SequenceMeta, wire array)``: two objects, so a driver can read the
        meta without fetching the blob."""
        return self.engine.prefill(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                   request_id=request_id, **cache_options)


@ray.remote
class DecodeWorker:
    """A Ray actor that continues shipped sequences (see :class:`Engine`).

    ``exit_after``: for failure tests, the process exits (``os._exit``) as
    soon as it has decoded this many tokens in all, mid-call."""

    def __init__(self, model="smollm2-135m", *, threads: int | None = 1, backend=None, exit_after: int | None = None):
        self.engine = Engine(model, threads=threads, backend=backend)
        self.exit_after = exit_after
        self.decoded = 0

    def ready(self) -> int:
        return os.getpid()

    def load(self, meta: SequenceMeta, wire) -> int:
        """Import a state (``wire``: pass the ObjectRef, Ray hands the array over)."""
        return self.engine.load(meta, wire)

    def _count(self, _n: int) -> None:
        self.decoded += 1
        if self.exit_after is not None and self.decoded >= self.exit_after:
            os._exit(1)

    @ray.method(num_returns=2)
    def decode(self, request_id: str, k: int):
        """Decode at most ``k`` tokens; returns the checkpoint ``(SequenceMeta, wire array)``."""
        return self.engine.decode(request_id, k, on_token=self._count)

    def release(self, request_id: str) -> bool:
        return self.engine.release(request_id)


@dataclass
class GenerateResult:
    """What :func:`generate` returns: the tokens, and how they were made."""

    tokens: list
    meta: SequenceMeta
    checkpoints: int = 0
    resumes: int = 0                                 # times a sequence moved to another decode worker
    failures: list = field(default_factory=list)     # (worker index, error text)
    seconds: dict = field(default_factory=dict)      # prefill, handoff (first load), decode


def generate(prefill, decoders, prompt, *, max_new_tokens: int, every: int = 8, eos_token_id=None,
             request_id: str | None = None, on_checkpoint=None, **cache_options) -> GenerateResult:
    """Prefill ``prompt`` on ``prefill`` (a :class:`PrefillWorker` handle),
    then decode on ``decoders`` (a list of :class:`DecodeWorker` handles, used
    in order: the next one takes over when one dies), checkpointing every
    ``every`` tokens. ``on_checkpoint(meta, worker_index)``: called with each
    shipped state's meta (tests kill workers from it). The driver holds only
    the meta and the newest blob's ObjectRef; the blob moves between workers
    through the object store. Raises :class:`~kvreg.errors.StateError` when
    every decode worker has died (the last state is ``err.meta`` / ``err.wire``)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"every must be an int >= 1 (tokens per checkpoint), got {every!r}")
    if not decoders:
        raise ConfigError("generate needs at least one DecodeWorker")
    t0 = time.perf_counter()
    meta_ref, wire_ref = prefill.prefill.remote(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                                request_id=request_id, **cache_options)
    meta = ray.get(meta_ref)
    result = GenerateResult(tokens=list(meta.tokens), meta=meta)
    result.seconds["prefill"] = time.perf_counter() - t0
    alive = list(range(len(decoders)))
    current, loaded, loads = None, False, 0
    t1 = time.perf_counter()
    while not meta.done:
        if current is None:
            if not alive:
                err = StateError(f"every decode worker died; request {meta.request_id} stopped after "
                                 f"{len(meta.tokens)} token(s) (its last state: err.meta, err.wire)")
                err.meta, err.wire = meta, wire_ref  # type: ignore[attr-defined]
                raise err
            current, loaded = alive[0], False
        worker = decoders[current]
        try:
            if not loaded:
                th = time.perf_counter()
                ray.get(worker.load.remote(meta, wire_ref))
                result.seconds.setdefault("handoff", time.perf_counter() - th)
                loads += 1
                result.resumes = loads - 1
                loaded = True
            new_meta, new_wire = worker.decode.remote(meta.request_id, every)
            new_meta = ray.get(new_meta)
        except RayActorError as exc:
            result.failures.append((current, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"))
            alive.remove(current)
            current = None
            continue
        meta, wire_ref = new_meta, new_wire      # the previous blob is released with its last ref
        result.checkpoints += 1
        if on_checkpoint is not None:
            on_checkpoint(meta, current)
    result.seconds["decode"] = time.perf_counter() - t1
    if current is not None:
        try:
            decoders[current].release.remote(meta.request_id)
        except RayActorError:   # pragma: no cover - best effort
            pass
    result.tokens, result.meta = list(meta.tokens), meta
    return result
