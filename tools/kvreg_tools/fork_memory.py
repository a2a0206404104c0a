"""Memory of N sequences forked from one prompt, against N deep copies.

A :class:`kvreg.KvCache` of SmolLM2-135M's geometry (30 layers, 3 KV heads,
head_dim 64) prefills a ``--prompt``-row prompt; ``--forks`` sequences are
made from it with ``cache.fork()`` (or ``copy.deepcopy`` with ``--copies``)
and each decodes ``--steps`` rows (append + ``attend_layer`` per layer).
Printed: the process's memory growth (``RssAnon`` of this process plus the
system's ``Shmem``, where a fork's snapshot pages live; Linux only), kvreg's
own count (:func:`kvreg.resident_bytes`, shared rows once) and the sum of
every sequence's ``total_memory_bytes()`` (what they would hold apart).

Run it: ``python -m kvreg_tools.fork_memory`` (and ``--copies``).
"""

from __future__ import annotations

import argparse
import copy

import numpy as np

import kvreg

__all__ = ["fork_memory", "main"]


def _held_bytes() -> int:
    """This process's anonymous resident bytes plus the system's shared memory."""
    anon = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon"))
    shm = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("Shmem:"))
    return (anon + shm) * 1024


def fork_memory(prompt: int = 4096, forks: int = 8, steps: int = 64, copies: bool = False,
                backend: str | None = None, layers: int = 30, kv_heads: int = 3, head_dim: int = 64) -> dict:
    rng = np.random.default_rng(0)
    cache = kvreg.KvCache(layers, kv_heads, head_dim, max_seq_len=1 << 30, mode="f32", backend=backend)
    for lay in cache.layers:
        shape = (prompt, kv_heads, head_dim)
        lay.extend(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32),
                   layout="nhd")
    q = rng.standard_normal((3 * kv_heads, head_dim), dtype=np.float32)
    start = _held_bytes()
    seqs = [copy.deepcopy(cache) if copies else cache.fork() for _ in range(forks)]
    for seq in seqs:
        for _ in range(steps):
            for lay in seq.layers:
                row = rng.standard_normal(2 * kv_heads * head_dim, dtype=np.float32)
                lay.append(row[: kv_heads * head_dim], row[kv_heads * head_dim:])
                lay.attend_layer(q)
    return {
        "how": "deepcopy" if copies else "fork",
        "prompt_mib": cache.total_memory_bytes() / 2**20,
        "growth_mib": (_held_bytes() - start) / 2**20,
        "resident_mib": kvreg.resident_bytes(cache, seqs) / 2**20,
        "apart_mib": sum(s.total_memory_bytes() for s in [cache] + seqs) / 2**20,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvreg_tools.fork_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--copies", action="store_true", help="deep copies instead of forks")
    ap.add_argument("--backend", default=None)
    a = ap.parse_args(argv)
    r = fork_memory(a.prompt, a.forks, a.steps, a.copies, a.backend)
    print(f"{a.forks} sequences by {r['how']} of a {a.prompt}-row prompt ({r['prompt_mib']:.1f} MiB), "
          f"{a.steps} decode steps each:")
    print(f"  memory growth (RssAnon + Shmem): {r['growth_mib']:.1f} MiB")
    print(f"  kvreg.resident_bytes (prompt and forks, shared rows once): {r['resident_mib']:.1f} MiB")
    print(f"  sum of total_memory_bytes (held apart): {r['apart_mib']:.1f} MiB")


if __name__ == "__main__":
    main()
