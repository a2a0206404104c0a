#!/usr/bin/env python
"""Fast fake-quant KL study of KV storage formats on kvreg's two real models.

One teacher-forced forward of the text per scheme (instead of kvreg eval's
token-by-token decode). The model runs with its own attention replaced by an
eager attention (``"kvfq"``) that, before attending, quantizes->dequantizes the
layer's post-RoPE keys/values (``[b, kvh, n, hd]``) per head per token, exactly
as a cache that stores each row and then attends its stored rows (every query,
the token's own included, sees the stored form). The reference is the same
forward with no quantization (same attention code). KL(ref || scheme) and top-1
agreement are measured over the logits that predict tokens ``prefix..n-1``
(kvreg eval's scored positions: the logits at positions ``prefix-1..n-2``).

Rows that a real cache would hold exact for a while (a recent window, KIVI's
incomplete key group) are handled with a visibility mask: for query ``t`` and
row ``s`` the attention uses the exact row while it is still exact at ``t``,
the quantized one afterwards, as a token-by-token decode would.

Scheme grammar (``--schemes`` is a comma-separated list of presets or specs):

    spec  := field ('/' field)*
    field := k=Q | v=Q | kv=Q (both) | sink=N | win=N | mid=N:Q | xd=f32|f16
    Q     := f32 | f16 | bf16                 (storage cast, round to nearest even)
           | i<B>[opts]                       (B-bit integer codes)
    opts (any order after i<B>):
      g<N>  per-token groups of N channels (default: head_dim); one scale per group
      c<G>  KIVI: per-channel groups of G tokens (one scale [+min] per channel per
            G rows); the newest <G rows stay exact until their group fills
      a     asymmetric: scale=(max-min)/(2^B-1), codes 0..2^B-1, stores min too
      n     symmetric "-2^(B-1)..2^(B-1)-1": scale = x[argmax|x|] / -2^(B-1)
            (llama.cpp Q4_0 style); default symmetric is +-(2^(B-1)-1), scale=absmax/qmax
      h     orthonormal Walsh-Hadamard rotation per head before quantizing
            (Sylvester H_hd / sqrt(hd), applied as x @ H, undone as y @ H)
      e     round half to even (default: half away from zero, kvreg's rule)
      s16   scales (and mins) stored as float16 (codes computed with the stored scale)
    sink=N  the first N rows of every head kept exact (an extra copy, counted)
    win=N   the newest N rows of every head kept exact (row s exact for query t iff t-s<N)
    mid=N:Q the newest N rows (those older than the exact window) stored as Q
            (K and V) instead of k=/v=: a two-tier recent window (e.g. int8 over int4)
    xd      dtype of exact rows (sinks, window, KIVI residual), default f32

Bytes/element are counted at 2048 rows per head (``--bytes-rows``), K and V
elements together (as kvreg eval's bytes_per_element): codes + every scale/min,
sink rows as an extra exact copy, window rows at the exact dtype instead of
codes, KIVI's residual rows at the exact dtype on average ((G-1)/2 rows).

Example:

    OMP_NUM_THREADS=1 .venv/bin/python -m research.kv_quant_study --model smollm2-135m \\
        --text textwrap --schemes q8,q8v,f16,bf16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

# ── presets ────────────────────────────────────────────────────────────────

PRESETS = {
    "ref": "",                                            # the reference itself (KL 0)
    # kvreg's current q8 and its halves
    "q8": "k=i8g32/v=i8/sink=1",
    "q8k": "k=i8g32/sink=1",
    "q8v": "v=i8/sink=1",
    # plain float storage
    "f16": "kv=f16",
    "bf16": "kv=bf16",
    "kf16": "k=f16",
    "kbf16": "k=bf16",
    "vf16": "v=f16",
    "vbf16": "v=bf16",
}

DEFAULT_SCHEMES = "q8,q8v,f16,bf16"

# ── scheme parsing ──────────────────────────────────────────────────────────


@dataclass
class QSpec:
    kind: str = "f32"          # f32 | f16 | bf16 | int
    bits: int = 8
    group: int | None = None   # per-token channel group (None: head_dim)
    tok_group: int | None = None  # KIVI per-channel token group
    asym: bool = False
    neg: bool = False          # -2^(B-1)..2^(B-1)-1 symmetric
    had: bool = False
    even: bool = False
    s16: bool = False

    @property
    def identity(self) -> bool:
        return self.kind == "f32"


@dataclass
class Scheme:
    name: str
    spec: str
    k: QSpec = field(default_factory=QSpec)
    v: QSpec = field(default_factory=QSpec)
    sink: int = 0
    win: int = 0
    xd: str = "f32"
    mid: int = 0                 # newest `mid` rows (beyond `win`) stored as `mq`
    mq: QSpec = field(default_factory=QSpec)


_QRE = re.compile(r"^i(\d+)((?:g\d+|c\d+|a|n|h|e|s16)*)$")


def parse_q(text: str) -> QSpec:
    text = text.strip()
    if text in ("f32", "f16", "bf16"):
        return QSpec(kind=text)
    m = _QRE.match(text)
    if not m:
        raise SystemExit(f"bad quant spec {text!r} (see the module docstring)")
    q = QSpec(kind="int", bits=int(m.group(1)))
    for tok in re.findall(r"g\d+|c\d+|a|n|h|e|s16", m.group(2)):
        if tok.startswith("g"):
            q.group = int(tok[1:])
        elif tok.startswith("c"):
            q.tok_group = int(tok[1:])
        elif tok == "a":
            q.asym = True
        elif tok == "n":
            q.neg = True
        elif tok == "h":
            q.had = True
        elif tok == "e":
            q.even = True
        elif tok == "s16":
            q.s16 = True
    if q.asym and q.neg:
        raise SystemExit(f"{text!r}: 'a' and 'n' exclude each other")
    return q


def parse_scheme(name: str) -> Scheme:
    spec = PRESETS.get(name, name)
    s = Scheme(name=name, spec=spec or "(none)")
    for part in filter(None, spec.split("/")):
        key, _, val = part.partition("=")
        if key == "k":
            s.k = parse_q(val)
        elif key == "v":
            s.v = parse_q(val)
        elif key == "kv":
            s.k, s.v = parse_q(val), parse_q(val)
        elif key == "sink":
            s.sink = int(val)
        elif key == "win":
            s.win = int(val)
        elif key == "mid":
            n_, _, q_ = val.partition(":")
            s.mid, s.mq = int(n_), parse_q(q_)
        elif key == "xd":
            if val not in ("f32", "f16"):
                raise SystemExit(f"xd must be f32 or f16, got {val!r}")
            s.xd = val
        else:
            raise SystemExit(f"bad scheme field {part!r} in {spec!r}")
    return s


# ── bytes per element ───────────────────────────────────────────────────────

_FLOAT_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0}


def _plain_bytes(q: QSpec, hd: int) -> float:
    if q.kind != "int":
        return _FLOAT_BYTES[q.kind]
    return q.bits / 8 + (2 if q.asym else 1) * (2.0 if q.s16 else 4.0) / (q.group or hd)


def tensor_bytes_per_el(q: QSpec, hd: int, rows: int, sink: int, win: int, xd: str,
                        mid: int = 0, mq: QSpec | None = None) -> float:
    """Average bytes per element of one of K or V at ``rows`` rows per head."""
    xb = _FLOAT_BYTES[xd]
    if q.kind != "int":
        base = _FLOAT_BYTES[q.kind]
        return base + (sink * xb / rows if q.kind != "f32" and sink else 0.0)
    params = 2 if q.asym else 1
    sb = 2.0 if q.s16 else 4.0
    if q.tok_group:
        g = q.tok_group
        quant = q.bits / 8 + params * sb / g
        resid = (g - 1) / 2
    else:
        quant = q.bits / 8 + params * sb / (q.group or hd)
        resid = 0.0
    exact_rows = min(rows, max(win, resid))   # rows held at the exact dtype instead of codes
    mid_rows = max(0, min(rows, mid) - exact_rows) if mid else 0
    mb = _plain_bytes(mq, hd) if mid else 0.0
    per = ((rows - exact_rows - mid_rows) * quant + mid_rows * mb + exact_rows * xb) / rows
    return per + sink * xb / rows


def scheme_bytes(s: Scheme, hd: int, rows: int) -> tuple[float, float, float]:
    kb = tensor_bytes_per_el(s.k, hd, rows, s.sink, s.win, s.xd, s.mid, s.mq)
    vb = tensor_bytes_per_el(s.v, hd, rows, s.sink, s.win, s.xd, s.mid, s.mq)
    return (kb + vb) / 2, kb, vb


# ── fake quantization ───────────────────────────────────────────────────────

_HAD: dict[int, torch.Tensor] = {}


def hadamard(n: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix (symmetric, H @ H = I)."""
    if n not in _HAD:
        if n & (n - 1):
            raise SystemExit(f"Hadamard rotation needs a power-of-two head_dim, got {n}")
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HAD[n] = (h / math.sqrt(n)).to(torch.float32)
    return _HAD[n]


def round_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, exactly (kvreg.quant.round_half_away)."""
    t = torch.trunc(x)
    return t + torch.where((x - t).abs() >= 0.5, torch.sign(x), torch.zeros_like(x))


def _store_scale(s: torch.Tensor, s16: bool) -> torch.Tensor:
    if s16:
        s = s.to(torch.float16).to(torch.float32)
    return s


def _quant_groups(x: torch.Tensor, q: QSpec, dim: int) -> torch.Tensor:
    """Quantize->dequantize ``x`` with one scale (+min) per slice along ``dim``."""
    rnd = torch.round if q.even else round_away
    if q.asym:
        lo = x.amin(dim=dim, keepdim=True)
        hi = x.amax(dim=dim, keepdim=True)
        levels = 2 ** q.bits - 1
        s = _store_scale(torch.clamp((hi - lo) / levels, min=1e-12), q.s16)
        lo = _store_scale(lo, q.s16)
        s = torch.clamp(s, min=2.0 ** -24)
        c = torch.clamp(rnd((x - lo) / s), 0, levels)
        return c * s + lo
    if q.neg:
        half = 2 ** (q.bits - 1)
        idx = x.abs().argmax(dim=dim, keepdim=True)
        mx = torch.gather(x, dim, idx)
        s = mx / -half
        s = torch.where(s.abs() < 1e-12, torch.full_like(s, 1e-12), s)
        s = _store_scale(s, q.s16)
        s = torch.where(s == 0, torch.full_like(s, 2.0 ** -24), s)
        c = torch.clamp(rnd(x / s), -half, half - 1)
        return c * s
    qmax = 2 ** (q.bits - 1) - 1
    s = torch.clamp(x.abs().amax(dim=dim, keepdim=True) / qmax, min=1e-12)
    s = torch.clamp(_store_scale(s, q.s16), min=2.0 ** -24)
    c = torch.clamp(rnd(x / s), -qmax, qmax)
    return c * s


def fake_quant(x: torch.Tensor, q: QSpec, sink: int) -> torch.Tensor:
    """The stored-then-read form of rows ``x [b, h, n, hd]`` (float32)."""
    if q.kind == "f32":
        return x
    if q.kind == "f16":
        return x.to(torch.float16).to(torch.float32)
    if q.kind == "bf16":
        return x.to(torch.bfloat16).to(torch.float32)
    b, h, n, hd = x.shape
    y = x @ hadamard(hd) if q.had else x
    if q.tok_group:
        g = q.tok_group
        body = y[:, :, sink:]
        full = (body.shape[2] // g) * g
        out = body.clone()
        if full:
            blk = body[:, :, :full].reshape(b, h, full // g, g, hd)
            out[:, :, :full] = _quant_groups(blk, q, dim=3).reshape(b, h, full, hd)
        y = torch.cat([y[:, :, :sink], out], dim=2)
    else:
        grp = q.group or hd
        if hd % grp:
            raise SystemExit(f"group {grp} does not divide head_dim {hd}")
        y = _quant_groups(y.reshape(b, h, n, hd // grp, grp), q, dim=4).reshape(b, h, n, hd)
    if q.had:
        y = y @ hadamard(hd)
    if sink:
        y = torch.cat([x[:, :, :sink], y[:, :, sink:]], dim=2)
    return y


def exact_mask(q: QSpec, n: int, sink: int, win: int) -> torch.Tensor | None:
    """``[n, n]`` bool, True where query t still reads row s exact (window or
    KIVI's incomplete group), or None when every row is read quantized."""
    if q.kind == "f32":
        return None
    t = torch.arange(n)[:, None]
    s = torch.arange(n)[None, :]
    m = torch.zeros(n, n, dtype=torch.bool)
    if win:
        m |= (t - s) < win
    if q.kind == "int" and q.tok_group:
        g = q.tok_group
        end = sink + ((s - sink) // g + 1) * g - 1     # the row that completes s's group
        m |= (s >= sink) & (end > t)
    return m if bool(m.any()) else None


# ── the attention function ──────────────────────────────────────────────────

ATTN = "kvfq"
CURRENT: Scheme | None = None     # the scheme the next forward applies


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def kvfq_attention(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    """Eager attention over fake-quantized K/V (``CURRENT``); [b, n, nh, hd] out."""
    s = CURRENT
    b, nh, n, hd = query.shape
    rep = nh // key.shape[1]
    scale = hd ** -0.5 if scaling is None else float(scaling)
    k32, v32 = key.float(), value.float()
    kq = fake_quant(k32, s.k, s.sink) if s else k32
    vq = fake_quant(v32, s.v, s.sink) if s else v32
    nk = key.shape[2]
    mk = exact_mask(s.k, nk, s.sink, s.win) if s else None
    mv = exact_mask(s.v, nk, s.sink, s.win) if s else None
    if s and s.xd == "f16":   # exact rows held as float16
        ke, ve = k32.half().float(), v32.half().float()
        if s.sink:
            if s.k.kind == "int":
                kq = torch.cat([ke[:, :, :s.sink], kq[:, :, s.sink:]], 2)
            if s.v.kind == "int":
                vq = torch.cat([ve[:, :, :s.sink], vq[:, :, s.sink:]], 2)
    else:
        ke, ve = k32, v32
    q = query.float()
    scores = torch.matmul(q, _repeat(kq, rep).transpose(-1, -2)) * scale
    mm = None
    if s and s.mid:   # the two-tier window: rows with t-s < mid read as mq
        t_ = torch.arange(nk)
        mm = (t_[:, None] - t_[None, :]) < s.mid
        km, vm = fake_quant(k32, s.mq, s.sink), fake_quant(v32, s.mq, s.sink)
        if s.k.kind != "f32":
            scores = torch.where(mm, torch.matmul(q, _repeat(km, rep).transpose(-1, -2)) * scale, scores)
    if mk is not None:
        se = torch.matmul(q, _repeat(ke, rep).transpose(-1, -2)) * scale
        scores = torch.where(mk, se, scores)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        allowed = torch.ones(n, nk, dtype=torch.bool).tril(nk - n)
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if mm is not None and s.v.kind != "f32":
        mv = torch.zeros_like(mm) if mv is None else mv
        mid_v = mm & ~mv
        out = (torch.matmul(p * mv, _repeat(ve, rep)) + torch.matmul(p * mid_v, _repeat(vm, rep))
               + torch.matmul(p * ~(mv | mm), _repeat(vq, rep)))
    elif mv is not None:
        out = torch.matmul(p * mv, _repeat(ve, rep)) + torch.matmul(p * ~mv, _repeat(vq, rep))
    else:
        out = torch.matmul(p, _repeat(vq, rep))
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _mask_fn(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register(model) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN, kvfq_attention)
    AttentionMaskInterface.register(ATTN, _mask_fn)
    model.set_attn_implementation(ATTN)


# ── measurement ─────────────────────────────────────────────────────────────


def text_path(name: str) -> Path:
    lib = Path(sysconfig.get_paths()["stdlib"])
    cands = {"textwrap": [lib / "textwrap.py"], "license": [lib / "LICENSE.txt", lib.parent / "LICENSE.txt"]}
    for p in cands.get(name.lower(), [Path(name)]):
        if p.exists():
            return p
    raise SystemExit(f"text {name!r} not found")


def forward_logp(model, ids: torch.Tensor, prefix: int, scheme: Scheme | None) -> torch.Tensor:
    """log-softmax (float32) of the logits predicting tokens prefix..n-1."""
    global CURRENT
    CURRENT = scheme
    n = ids.shape[1]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, logits_to_keep=n - prefix + 1)
    CURRENT = None
    logits = out.logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1).float()


def compare(ref: torch.Tensor, cand: torch.Tensor, chunk: int = 64) -> tuple[float, float, float]:
    """(mean KL(ref||cand), p99 KL, top-1 agreement) over rows."""
    kls = []
    for i in range(0, ref.shape[0], chunk):
        r = ref[i:i + chunk].double()
        c = cand[i:i + chunk].double()
        kls.append((r.exp() * (r - c)).sum(-1))
    kl = torch.cat(kls)
    top = (ref.argmax(-1) == cand.argmax(-1)).double().mean()
    return float(kl.mean()), float(torch.quantile(kl, 0.99)), float(top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m, gemma3-270m or all")
    ap.add_argument("--text", default="textwrap", help="textwrap, license, all, or a file path (comma list)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES,
                    help=f"comma list of presets ({', '.join(PRESETS)}) or specs")
    ap.add_argument("--bytes-rows", type=int, default=2048, help="rows per head at which bytes/el are counted")
    ap.add_argument("--check-sdpa", action="store_true",
                    help="also report the stock SDPA forward against this harness's reference")
    ap.add_argument("--json", help="append results (one JSON object per line) to this file")
    args = ap.parse_args(argv)

    from kvreg.models import load

    models = ["smollm2-135m", "gemma3-270m"] if args.model == "all" else args.model.split(",")
    texts = ["textwrap", "license"] if args.text == "all" else args.text.split(",")
    schemes = [parse_scheme(x) for x in args.schemes.split(",") if x.strip()]
    for mname in models:
        model, tok = load(mname)
        cfg = model.config.get_text_config(decoder=True)
        hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        for tname in texts:
            path = text_path(tname)
            ids = tok(path.read_text(encoding="utf-8", errors="replace"), return_tensors="pt").input_ids
            ids = ids[:, :args.tokens]
            n = ids.shape[1]
            if n <= args.prefix + 1:
                raise SystemExit(f"{path}: {n} tokens, need more than prefix+1")
            t0 = time.perf_counter()
            if args.check_sdpa:
                model.set_attn_implementation("sdpa")
                sd = forward_logp(model, ids, args.prefix, None)
            register(model)
            ref = forward_logp(model, ids, args.prefix, None)
            print(f"\n{mname}, {path.name}: {n} tokens, prefix {args.prefix}, {n - args.prefix} scored "
                  f"(reference forward {time.perf_counter() - t0:.1f}s)\n", flush=True)
            top2 = ref.topk(2, dim=-1).values
            gap = top2[:, 0] - top2[:, 1]
            print("reference top-1/top-2 log-prob gap: " + ", ".join(
                f"{int((gap < g).sum())} positions < {g}" for g in (0.01, 0.05, 0.1, 0.25)) + "\n", flush=True)
            if args.check_sdpa:
                kl, p99, top = compare(ref, sd)
                print(f"stock SDPA vs harness reference: KL {kl:.2e}, top-1 {100 * top:.2f}%\n", flush=True)
            print(f"| scheme | spec | bytes/el @{args.bytes_rows:d} (K, V) | mean KL | p99 KL | top-1 | s |")
            print("|---|---|---:|---:|---:|---:|---:|", flush=True)
            for s in schemes:
                t1 = time.perf_counter()
                cand = forward_logp(model, ids, args.prefix, s)
                kl, p99, top = compare(ref, cand)
                per, kb, vb = scheme_bytes(s, hd, args.bytes_rows)
                dt = time.perf_counter() - t1
                print(f"| {s.name} | `{s.spec}` | {per:.4f} ({kb:.4f}, {vb:.4f}) | {kl:.3e} | {p99:.2e} | "
                      f"{100 * top:.2f}% | {dt:.0f} |", flush=True)
                if args.json:
                    with open(args.json, "a") as fh:
                        fh.write(json.dumps({"model": mname, "text": path.name, "tokens": n, "prefix": args.prefix,
                                             "scheme": s.name, "spec": s.spec, "bytes_per_el": per, "k_bytes": kb,
                                             "v_bytes": vb, "kl_mean": kl, "kl_p99": p99, "top1": top}) + "\n")
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
