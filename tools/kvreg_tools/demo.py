"""``kvreg demo``: a small GPT-style decoder in NumPy driving :class:`KvCache`.

What a host engine does with kvreg, end to end: seeded random weights
(pre-norm blocks with RMSNorm, RoPE, grouped-query attention, a gated MLP, a
tied embedding), a prompt prefilled in chunks (append the chunk's rows, then
``attend_chunk``), then greedy decoding one token at a time (append, then
``attend_layer``) on the backend ``KVREG_BACKEND`` selects. The output is
meaningless text from a random model, but every cache code path is the one a
real model takes, and greedy decoding turns any numerical difference in the
cache into a different token — which is what the hand-off proof relies on.

Options: ``--kv q8`` (quantized cache), ``--budget N`` (Born eviction once a
layer holds N rows), ``--o1`` (the O(1) Nyström seal after the prompt:
queries are traced during prefill, ``o1_seal`` converts, ``o1_step`` decodes),
``--handoff`` (one OS process prefills and ships ``export_wire()`` bytes
through a file; another imports them and decodes; the demo also runs the
whole thing in one process and checks the tokens are the same).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np

from kvreg.bounded import BoundedRope
from kvreg.cache import EvictionPolicy, KvCache
from kvreg.errors import ConfigError
from kvreg.modes import KvMode
from kvreg.registry import get_backend

__all__ = ["DemoConfig", "TinyGPT", "Session", "run_demo", "main"]


def _rope(rope: BoundedRope, x: np.ndarray, positions) -> np.ndarray:
    """``x [rows, heads, hd]`` rotated with kvreg's RoPE, row ``i`` at ``positions[i]``."""
    return np.ascontiguousarray(rope.apply(x.swapaxes(0, 1), positions).swapaxes(0, 1))


@dataclass(frozen=True)
class DemoConfig:
    layers: int = 8
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 64
    d_model: int = 512
    d_ff: int = 1024
    vocab: int = 512
    rope_theta: float = 10000.0
    seed: int = 0
    # O(1) seal geometry (the seal waits for w + sink + m + 1 rows)
    o1_m: int = 16
    o1_w: int = 64
    o1_sink: int = 4


def _rmsnorm(x, g):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-6)) * g


class TinyGPT:
    """Seeded random weights; the same seed gives the same model in any process."""

    def __init__(self, cfg: DemoConfig):
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(f"num_heads={cfg.num_heads} must be a multiple of num_kv_heads={cfg.num_kv_heads}")
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        d, nh, nkv, hd, ff = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_ff

        def w(fan_in, fan_out):
            return (rng.standard_normal((fan_in, fan_out), dtype=np.float32) / np.float32(np.sqrt(fan_in)))

        self.emb = rng.standard_normal((cfg.vocab, d), dtype=np.float32)
        self.blocks = []
        for _ in range(cfg.layers):
            self.blocks.append(dict(
                g1=np.ones(d, np.float32), wq=w(d, nh * hd), wk=w(d, nkv * hd), wv=w(d, nkv * hd),
                wo=w(nh * hd, d), g2=np.ones(d, np.float32), wg=w(d, ff), wu=w(d, ff), wd=w(ff, d)))
        self.g_out = np.ones(d, np.float32)
        # Untied head: with a tied one the residual stream's own embedding
        # wins every argmax and the greedy output repeats its first token,
        # which would make the hand-off proof blind to the cache.
        self.head = w(d, cfg.vocab) * np.float32(4.0)

    def forward(self, tokens, positions, session: Session, *, prefill: bool) -> np.ndarray:
        """Run ``tokens`` (at absolute ``positions``) through every layer,
        storing their K/V in ``session.cache``; returns the last row's logits."""
        cfg = self.cfg
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b = len(tokens)
        rope = BoundedRope(theta=cfg.rope_theta)
        x = self.emb[np.asarray(tokens)]
        for li, blk in enumerate(self.blocks):
            h = _rmsnorm(x, blk["g1"])
            q = _rope(rope, (h @ blk["wq"]).reshape(b, nh, hd), positions)
            k = _rope(rope, (h @ blk["wk"]).reshape(b, nkv, hd), positions)
            v = (h @ blk["wv"]).reshape(b, nkv, hd)
            att = session.attend(li, q, k, v, prefill=prefill)
            x = x + att.reshape(b, nh * hd) @ blk["wo"]
            h = _rmsnorm(x, blk["g2"])
            gate = h @ blk["wg"]
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ blk["wu"])) @ blk["wd"]
        return _rmsnorm(x[-1], self.g_out) @ self.head


class Session:
    """The cache side of one conversation: what a host engine writes around kvreg."""

    def __init__(self, cfg: DemoConfig, *, kv=None, budget=None, o1=False, backend=None):
        self.cfg = cfg
        self.budget = budget
        self.o1 = o1
        max_seq = budget if budget else 1 << 30
        self.cache = KvCache(cfg.layers, cfg.num_kv_heads, cfg.head_dim, max_seq,
                             EvictionPolicy.Born(sink=4), mode=kv, backend=backend)
        if o1 and self.cache[0].mode is not KvMode.F32:
            raise ConfigError("--o1 needs F32 KV storage (the seal summarizes f32 rows); drop --kv")
        if o1:
            for layer in self.cache.layers:
                layer.o1_begin(cfg.o1_m, cfg.o1_w, cfg.o1_sink)
        self.evictions = 0

    def make_room(self, n: int) -> None:
        """Born eviction before ``n`` new rows would pass the budget."""
        if not self.budget:
            return
        rows = max(layer.seq_len for layer in self.cache.layers)
        if self.cache.needs_eviction() or rows + n > self.budget:
            self.cache.evict(max(self.budget * 3 // 4 - n, 1))
            self.evictions += 1

    def attend(self, li, q, k, v, *, prefill):
        layer = self.cache[li]
        nh = self.cfg.num_heads
        hpk = nh // self.cfg.num_kv_heads
        if layer.o1_sealed():
            return layer.o1_step(q[0], k[0], v[0], nh)[None]
        s0 = layer.seq_len
        for i in range(q.shape[0]):
            layer.append(k[i], v[i])
            layer.o1_push_q(q[i])          # no-op unless collecting
        if prefill:
            return layer.attend_chunk(q, q.shape[0], s0, hpk)
        return layer.attend_layer(q[0])[None]

    def seal(self) -> bool:
        """Seal every collecting layer (deferred until the boundary is reached)."""
        if not self.o1:
            return False
        return all(layer.o1_seal(self.cfg.num_heads) for layer in self.cache.layers)


def prompt_tokens(cfg: DemoConfig, n: int) -> list[int]:
    return np.random.default_rng(cfg.seed + 1).integers(0, cfg.vocab, size=n).tolist()


def prefill(model: TinyGPT, sess: Session, prompt: list[int], chunk: int) -> int:
    """Prefill in chunks; returns the first generated token (greedy)."""
    pos = 0
    logits = None
    while pos < len(prompt):
        toks = prompt[pos:pos + chunk]
        sess.make_room(len(toks))
        logits = model.forward(toks, np.arange(pos, pos + len(toks)), sess, prefill=True)
        pos += len(toks)
    sess.seal()
    return int(np.argmax(logits))


def decode(model: TinyGPT, sess: Session, first: int, start_pos: int, n: int) -> list[int]:
    """Greedy decode: ``first`` is already chosen; returns ``n`` tokens."""
    out = [first]
    tok, pos = first, start_pos
    while len(out) < n:
        sess.make_room(1)
        logits = model.forward([tok], np.array([pos]), sess, prefill=False)
        if sess.o1 and not sess.cache[0].o1_sealed():
            sess.seal()      # a deferred boundary crossed during decode
        tok = int(np.argmax(logits))
        out.append(tok)
        pos += 1
    return out


# ── the hand-off: two OS processes ──

def _prefill_proc(cfg, prompt, chunk, kv, budget, backend, path, conn):
    try:
        model = TinyGPT(cfg)
        sess = Session(cfg, kv=kv, budget=budget, backend=backend)
        first = prefill(model, sess, prompt, chunk)
        blob = sess.cache.export_wire()
        with open(path, "wb") as fh:
            fh.write(blob)
        conn.send(("ok", os.getpid(), first, len(blob)))
    except BaseException as exc:  # report, do not hang the parent
        conn.send(("error", os.getpid(), f"{type(exc).__name__}: {exc}", 0))
    finally:
        conn.close()


def _decode_proc(cfg, first, start_pos, n, budget, backend, path, conn):
    try:
        model = TinyGPT(cfg)
        sess = Session(cfg, budget=budget, backend=backend)
        with open(path, "rb") as fh:
            sess.cache.import_wire(fh.read())
        t0 = time.perf_counter()
        toks = decode(model, sess, first, start_pos, n)
        conn.send(("ok", os.getpid(), toks, time.perf_counter() - t0))
    except BaseException as exc:
        conn.send(("error", os.getpid(), f"{type(exc).__name__}: {exc}", 0.0))
    finally:
        conn.close()


def _run_child(ctx, target, args, timeout=600):
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, child))
    p.start()
    child.close()
    if not parent.poll(timeout):
        p.terminate()
        raise RuntimeError(f"{target.__name__} gave no answer in {timeout} s")
    status, pid, payload, extra = parent.recv()
    p.join()
    if status != "ok":
        raise RuntimeError(f"{target.__name__} (pid {pid}) failed: {payload}")
    return pid, payload, extra


def handoff(cfg, prompt, chunk, n, *, kv=None, budget=None, backend=None) -> dict:
    """Prefill in one spawned process, decode in another, wire bytes between."""
    mode = KvMode.from_env() if kv is None else KvMode.parse(kv)
    if mode is not KvMode.F32:
        raise ConfigError("--handoff ships export_wire() bytes, which refuse a q8 cache; drop --kv")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvreg-demo-") as d:
        path = os.path.join(d, "prefill.kvrc")
        ppid, first, nbytes = _run_child(ctx, _prefill_proc, (cfg, prompt, chunk, kv, budget, backend, path))
        dpid, toks, secs = _run_child(ctx, _decode_proc, (cfg, first, len(prompt), n, budget, backend, path))
    return dict(prefill_pid=ppid, decode_pid=dpid, wire_bytes=nbytes, tokens=toks, decode_seconds=secs)


# ── the command ──

def run_demo(cfg: DemoConfig, *, tokens=32, prompt=256, chunk=64, kv=None, budget=None, o1=False,
             handoff_=False, backend=None, out=print) -> dict:
    """Run the demo, printing as it goes; returns the figures (and tokens)."""
    if tokens < 1 or prompt < 1 or chunk < 1:
        raise ConfigError("--tokens, --prompt and --chunk must be >= 1")
    if budget is not None and budget <= chunk:
        raise ConfigError(f"--budget {budget} must exceed --chunk {chunk} (a chunk must fit after eviction)")
    if handoff_ and o1:
        raise ConfigError("--handoff and --o1: the wire refuses a layer with an O(1) overlay")
    be = get_backend(backend)
    model = TinyGPT(cfg)
    sess = Session(cfg, kv=kv, budget=budget, o1=o1, backend=be)
    ptoks = prompt_tokens(cfg, prompt)
    out(f"model: {cfg.layers} layers, {cfg.num_heads} Q / {cfg.num_kv_heads} KV heads, hd {cfg.head_dim}, "
        f"d_model {cfg.d_model}, vocab {cfg.vocab} (seeded random weights)")
    out(f"cache: backend {be.describe()}, KV {sess.cache[0].mode.value}"
        + (f", Born eviction at {budget} rows" if budget else "") + (", O(1) seal after the prompt" if o1 else ""))
    t0 = time.perf_counter()
    first = prefill(model, sess, ptoks, chunk)
    t1 = time.perf_counter()
    toks = decode(model, sess, first, prompt, tokens)
    t2 = time.perf_counter()
    res = dict(tokens=toks, prefill_tok_s=prompt / (t1 - t0),
               decode_tok_s=(tokens - 1) / (t2 - t1) if tokens > 1 else 0.0,
               total_memory_bytes=sess.cache.total_memory_bytes(), reserved_bytes=sess.cache.reserved_bytes(),
               seq_len=sess.cache.seq_len, evictions=sess.evictions,
               sealed=bool(o1 and sess.cache[0].o1_sealed()))
    out(f"prefill: {prompt} tokens in chunks of {chunk}: {res['prefill_tok_s']:.1f} tok/s")
    out(f"decode: {tokens} tokens: {res['decode_tok_s']:.1f} tok/s  "
        f"(first: {toks[:12]}{' ...' if tokens > 12 else ''})")
    out(f"KV memory: {res['total_memory_bytes'] / 2**20:.2f} MiB stored (total_memory_bytes), "
        f"{res['reserved_bytes'] / 2**20:.2f} MiB reserved; depth {res['seq_len']}"
        + (f", {sess.evictions} evictions" if budget else "") + (", sealed" if res["sealed"] else ""))
    if handoff_:
        h = handoff(cfg, ptoks, chunk, tokens, kv=kv, budget=budget, backend=be.name)
        same = h["tokens"] == toks
        res.update(handoff=h, handoff_same=same)
        n_eq = sum(a == b for a, b in zip(h["tokens"], toks))
        out(f"handoff: prefill pid {h['prefill_pid']} -> {h['wire_bytes']} bytes of export_wire() "
            f"-> decode pid {h['decode_pid']} (parent pid {os.getpid()})")
        out(f"handoff proof: {'SAME' if same else 'DIFFERENT'} tokens as the single-process run "
            f"({n_eq}/{tokens} equal)")
    return res


def main(args) -> int:
    """``kvreg demo`` (arguments: see :mod:`kvreg.cli`)."""
    cfg = getattr(args, "config", None) or DemoConfig(layers=args.layers)
    if getattr(args, "config", None) is None and args.layers != cfg.layers:
        cfg = replace(cfg, layers=args.layers)
    try:
        res = run_demo(cfg, tokens=args.tokens, prompt=args.prompt, chunk=args.chunk, kv=args.kv,
                       budget=args.budget, o1=args.o1, handoff_=args.handoff)
    except ConfigError as exc:
        print(f"kvreg demo: {exc}", file=sys.stderr)
        return 2
    return 0 if res.get("handoff_same", True) else 1
