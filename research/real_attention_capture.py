"""Train a small byte-level decoder on this machine's text, capture its real Q/K/V.

No pretrained decoder weights can be fetched where kvreg is developed (no
model hub; no PyPI or Debian package ships any), so this script trains one,
on CPU, from text every Debian Python machine has: the Python standard
library's own sources (``/usr/lib/python3.X/**/*.py``). The files are split
by a CRC of their path into training (~97%) and held-out (~3%) sets; the
captured sequence comes from a held-out file the model never trained on.

Model: byte-level (vocab 256), pre-norm (RMSNorm) decoder, ``--layers``
layers, ``--heads`` query heads sharing ``--kv-heads`` KV heads (GQA, head
``h`` reads KV head ``h // (heads / kv_heads)``, kvreg's convention), head
dim ``--head-dim``, rotate-half RoPE at theta ``--rope-theta`` on queries and
keys (the convention of :func:`kvreg_conformance.oracle.rope64`;
checked against it at capture), SwiGLU MLP, tied embeddings, no biases, logit
scale ``1/sqrt(head_dim)``. Trained with AdamW, warmup + cosine decay, first
on short sequences, then on ``--context``-byte sequences so that attention
learns to use the whole context.

Capture: one forward pass over ``--context`` held-out bytes; per layer the
post-RoPE queries ``q [rows, heads, hd]``, post-RoPE keys ``k [rows, kv_heads,
hd]`` and values ``v [rows, kv_heads, hd]`` -- exactly what a KV cache holds,
and the queries that read it -- stored float16 in one compressed ``.npz`` with
the metadata as a JSON string (``meta``). :mod:`research.real_attention`
loads it.

    python research/real_attention_capture.py --out research/data/real_qkv.npz

Stored: layers 1 and 3 by default (``--capture-layers``; all four layers at
2048 rows would be ~5.6 MB, over the ~3 MB kept in the repository);
``--also-all PATH`` writes every layer from the same run as well.

Needs torch (CPU is enough; not a kvreg dependency). Everything is seeded
(torch, numpy; one torch thread). Schedule: 400 steps of 4 x 512 bytes, then
200 steps of 1 x 2048 bytes (1.23 M training bytes), AdamW lr 4e-3; the stored
file's run took 619 s of training on a shared 2-core machine (held-out 2.61
bits/byte; a uniform byte guess is 8). ``--max-minutes`` (13.5) caps the
training wall time: on a busy machine a phase stops early, which the metadata
records (``train_phases``), and the run is then no longer step-for-step
reproducible.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time
import zlib

import numpy as np


def corpus_files(root: str) -> list[str]:
    """Every ``.py`` file under ``root``, sorted (a deterministic order)."""
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    skip = ("site-packages", "dist-packages")  # third-party code, not the stdlib
    return [f for f in files if os.path.isfile(f) and not os.path.islink(f)
            and not any(part in skip for part in os.path.relpath(f, root).split(os.sep))]


def split_files(files: list[str], root: str, heldout_mod: int = 32):
    """(train, heldout): a file is held out when crc32(its relative path) % mod == 0."""
    train, held = [], []
    for f in files:
        rel = os.path.relpath(f, root).encode()
        (held if zlib.crc32(rel) % heldout_mod == 0 else train).append(f)
    return train, held


def read_bytes(files: list[str]) -> np.ndarray:
    chunks = []
    for f in files:
        with open(f, "rb") as fh:
            chunks.append(fh.read())
    return np.frombuffer(b"\n\n".join(chunks), dtype=np.uint8)


def build_model(torch, layers, d_model, heads, kv_heads, head_dim, rope_theta, mlp_mult=3):
    nn = torch.nn
    F = torch.nn.functional

    def rope(x, cos, sin):
        # x [B, H, T, hd]; rotate-half: channel i pairs with i + hd/2
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1 = RMSNorm(d_model)
            self.wq = nn.Linear(d_model, heads * head_dim, bias=False)
            self.wk = nn.Linear(d_model, kv_heads * head_dim, bias=False)
            self.wv = nn.Linear(d_model, kv_heads * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, d_model, bias=False)
            self.n2 = RMSNorm(d_model)
            hidden = mlp_mult * d_model
            self.w1 = nn.Linear(d_model, hidden, bias=False)
            self.w3 = nn.Linear(d_model, hidden, bias=False)
            self.w2 = nn.Linear(hidden, d_model, bias=False)

        def forward(self, x, cos, sin, capture=None):
            B, T, _ = x.shape
            h = self.n1(x)
            q = self.wq(h).view(B, T, heads, head_dim).transpose(1, 2)
            k = self.wk(h).view(B, T, kv_heads, head_dim).transpose(1, 2)
            v = self.wv(h).view(B, T, kv_heads, head_dim).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            if capture is not None:
                capture.append((q[0].transpose(0, 1).detach().clone(),
                                k[0].transpose(0, 1).detach().clone(),
                                v[0].transpose(0, 1).detach().clone()))
            rep = heads // kv_heads
            # head h reads KV head h // rep (kvreg's GQA grouping)
            kk = k.repeat_interleave(rep, dim=1)
            vv = v.repeat_interleave(rep, dim=1)
            a = F.scaled_dot_product_attention(q, kk, vv, is_causal=True,
                                               scale=1.0 / math.sqrt(head_dim))
            x = x + self.wo(a.transpose(1, 2).reshape(B, T, heads * head_dim))
            h = self.n2(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RMSNorm(d_model)
            half = head_dim // 2
            inv = rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / head_dim)
            self.register_buffer("inv_freq", inv, persistent=False)
            nn.init.normal_(self.emb.weight, std=0.02)
            for blk in self.blocks:
                for lin in (blk.wq, blk.wk, blk.wv, blk.w1, blk.w3):
                    nn.init.normal_(lin.weight, std=0.02)
                for lin in (blk.wo, blk.w2):
                    nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * layers))

        def rope_tables(self, T):
            ang = torch.arange(T, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
            return torch.cos(ang).float(), torch.sin(ang).float()

        def forward(self, idx, capture=None):
            cos, sin = self.rope_tables(idx.shape[1])
            x = self.emb(idx)
            for blk in self.blocks:
                x = blk(x, cos, sin, capture)
            return self.norm(x) @ self.emb.weight.T  # tied embeddings

    return Decoder()


def batches(data: np.ndarray, rng: np.random.Generator, batch: int, seq: int):
    starts = rng.integers(0, data.size - seq - 1, size=batch)
    x = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64)
    return x[:, :-1], x[:, 1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="research/data/real_qkv.npz")
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"],
                    help="a folder of .py files (default: this Python's standard library)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--context", type=int, default=2048, help="long-phase length = captured rows")
    ap.add_argument("--short", type=int, default=512, help="short-phase sequence length")
    ap.add_argument("--short-steps", type=int, default=400)
    ap.add_argument("--long-steps", type=int, default=200)
    ap.add_argument("--short-batch", type=int, default=4)
    ap.add_argument("--long-batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--max-minutes", type=float, default=13.5,
                    help="wall-clock cap on training (a busy machine stops a phase early)")
    ap.add_argument("--short-share", type=float, default=0.55,
                    help="fraction of --max-minutes the short phase may use")
    ap.add_argument("--capture-layers", default="1,3",
                    help="comma-separated layer indices to store, or 'all' (the default two "
                         "layers keep the file under ~3 MB at 2048 rows; all four: ~5.3 MB)")
    ap.add_argument("--also-all", default=None, metavar="PATH",
                    help="also write every layer's capture to PATH (same run)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine, 2 OpenMP threads ran "
                         "~7x slower per step whenever another process held a core)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bench", action="store_true", help="time a few steps of each phase and exit")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    if args.heads % args.kv_heads or args.head_dim % 2:
        ap.error("heads must be a multiple of kv-heads, head-dim even")

    root = os.path.realpath(args.corpus)
    train_f, held_f = split_files(corpus_files(root), root)
    train = read_bytes(train_f)
    held = read_bytes(held_f)
    print(f"corpus {root}: {len(train_f)} train files ({train.size / 1e6:.1f} MB), "
          f"{len(held_f)} held-out files ({held.size / 1e6:.2f} MB)", flush=True)

    model = build_model(torch, args.layers, args.d_model, args.heads, args.kv_heads,
                        args.head_dim, args.rope_theta)
    nparam = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} layers, d {args.d_model}, {args.heads} q / {args.kv_heads} kv heads,"
          f" hd {args.head_dim}, {nparam / 1e6:.2f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    phases = [(args.short, args.short_batch, args.short_steps),
              (args.context, args.long_batch, args.long_steps)]
    total = args.short_steps + args.long_steps
    warmup = max(1, min(50, total // 10))
    budget_s = 60.0 * args.max_minutes
    # a phase ends at its step count or at its share of the wall-clock cap,
    # whichever comes first: deterministic on an idle machine, bounded on a
    # busy one (the metadata records the steps actually run)
    phase_end_s = [args.short_share * budget_s, budget_s]

    def lr_at(progress):
        if progress < warmup / total:
            return args.lr * max(progress * total, 1.0) / warmup
        frac = (progress - warmup / total) / (1 - warmup / total)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def loss_of(x, y):
        logits = model(torch.from_numpy(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), torch.from_numpy(y).reshape(-1))

    if args.bench:
        for seq, bs, _ in phases:
            x, y = batches(train, rng, bs, seq)
            for i in range(5):
                if i == 1:
                    t0 = time.perf_counter()
                loss = loss_of(x, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            dt = (time.perf_counter() - t0) / 4
            print(f"seq {seq} batch {bs}: {dt:.3f} s/step, {bs * seq / dt:.0f} tok/s")
        return 0

    t_start = time.perf_counter()
    step = 0
    log = []
    recent = []
    done = []
    model.train()
    for pi, (seq, bs, nsteps) in enumerate(phases):
        n = 0
        p0 = sum(ph[2] for ph in phases[:pi]) / total  # progress at the phase start
        t0 = time.perf_counter() - t_start
        while n < nsteps:
            el = time.perf_counter() - t_start
            if el >= phase_end_s[pi]:
                break
            # progress: by steps, or by the phase's time share if that is ahead
            by_time = (el - t0) / max(phase_end_s[pi] - t0, 1e-9)
            progress = p0 + max(n / nsteps, by_time) * nsteps / total
            for g in opt.param_groups:
                g["lr"] = lr_at(progress)
            x, y = batches(train, rng, bs, seq)
            loss = loss_of(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            recent = (recent + [loss.item()])[-20:]
            step += 1
            n += 1
            if step % 10 == 0:
                mean = float(np.mean(recent)) / math.log(2)
                log.append([step, seq, round(mean, 4), round(time.perf_counter() - t_start, 1)])
                print(f"step {step} (phase {pi}: {n}/{nsteps}) seq {seq} loss {mean:.3f} bits/byte "
                      f"(mean of last {len(recent)}) lr {lr_at(progress):.2e} "
                      f"{time.perf_counter() - t_start:.0f} s", flush=True)
        done.append(n)
    train_s = time.perf_counter() - t_start
    final_bpb = float(np.mean(recent)) / math.log(2)
    print(f"trained {train_s:.0f} s, steps per phase {done}, last-20 train loss "
          f"{final_bpb:.3f} bits/byte", flush=True)

    # held-out bits/byte at the full context
    model.eval()
    erng = np.random.default_rng(args.seed + 1)
    with torch.no_grad():
        ev = [loss_of(*batches(held, erng, 2, args.context)).item() for _ in range(8)]
    held_bpb = float(np.mean(ev)) / math.log(2)
    print(f"held-out: {held_bpb:.3f} bits/byte at context {args.context}", flush=True)

    # the captured sequence: the first `context` bytes of the first held-out
    # file (sorted order) long enough to fill the context on its own
    cap_file = None
    for f in held_f:
        if os.path.getsize(f) >= args.context:
            cap_file = f
            break
    if cap_file is None:
        raise SystemExit("no held-out file is as long as the context")
    with open(cap_file, "rb") as fh:
        seq_bytes = np.frombuffer(fh.read(args.context + 1), dtype=np.uint8).astype(np.int64)
    x = torch.from_numpy(seq_bytes[None, :args.context])
    cap = []
    with torch.no_grad():
        logits = model(x, capture=cap)
        cap_loss = torch.nn.functional.cross_entropy(
            logits[0, :-1], torch.from_numpy(seq_bytes[1:args.context])).item()
    cap_bpb = cap_loss / math.log(2)
    print(f"captured sequence {os.path.relpath(cap_file, root)}: {cap_bpb:.3f} bits/byte", flush=True)

    layers = list(range(args.layers)) if args.capture_layers == "all" else [
        int(s) for s in args.capture_layers.split(",")]

    # self-check: the captured keys are the raw keys under kvreg's RoPE
    from kvreg_conformance.oracle import rope64

    with torch.no_grad():
        blk = model.blocks[0]
        h = blk.n1(model.emb(x))
        k_raw = blk.wk(h).view(args.context, args.kv_heads, args.head_dim).numpy()
    k_ref = rope64(k_raw.astype(np.float64), np.arange(args.context), args.rope_theta)
    err = np.abs(k_ref - cap[0][1].numpy()).max() / np.abs(k_ref).max()
    if err > 1e-5:
        raise SystemExit(f"RoPE convention mismatch with kvreg_conformance.oracle.rope64: {err:.2e}")

    def write(path, layers):
        arrays = {}
        for li in layers:
            q, k, v = (t.numpy().astype(np.float16) for t in cap[li])
            arrays[f"q{li}"], arrays[f"k{li}"], arrays[f"v{li}"] = q, k, v
        meta = dict(
            format=1,
            layers=layers,
            num_layers=args.layers,
            rows=args.context,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            d_model=args.d_model,
            rope_theta=args.rope_theta,
            rope="rotate-half (channel i pairs with i + hd/2), positions 0..rows-1, "
                 "applied to q and k (stored post-RoPE)",
            gqa="query head h reads KV head h // (num_heads / num_kv_heads)",
            scale=1.0 / math.sqrt(args.head_dim),
            parameters=int(nparam),
            train_phases=[dict(seq=s, batch=b, planned_steps=n, steps=d)
                          for (s, b, n), d in zip(phases, done)],
            train_tokens=int(sum(s * b * d for (s, b, _), d in zip(phases, done))),
            lr=args.lr,
            max_minutes=args.max_minutes,
            train_seconds=round(train_s, 1),
            train_threads=args.threads,
            final_train_bits_per_byte=round(final_bpb, 4),
            heldout_bits_per_byte=round(held_bpb, 4),
            captured_bits_per_byte=round(cap_bpb, 4),
            loss_log=log,
            corpus=f"Python {sys.version_info.major}.{sys.version_info.minor} standard library "
                   f"sources (*.py under {root}, site-packages excluded); {len(train_f)} files / "
                   f"{train.size} bytes train, {len(held_f)} files held out "
                   "(crc32(relative path) % 32 == 0)",
            captured_text=os.path.relpath(cap_file, root),
            captured_first_bytes=bytes(seq_bytes[:64].astype(np.uint8)).decode("utf-8", "replace"),
            dtype="float16",
            seed=args.seed,
            torch_version=torch.__version__,
            numpy_version=np.__version__,
            generator="research/real_attention_capture.py",
        )
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        np.savez_compressed(path, meta=np.array(json.dumps(meta)), **arrays)
        print(f"wrote {path}: {os.path.getsize(path) / 1e6:.2f} MB, layers {layers}, "
              f"rows {args.context}", flush=True)

    write(args.out, layers)
    if args.also_all:
        write(args.also_all, list(range(args.layers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
