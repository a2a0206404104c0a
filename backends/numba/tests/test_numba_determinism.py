"""The same inputs give the same bits on the numba backend whatever the
thread count, the compile-cache state (cold, partly warm, warm: each its own
process) and the call history (a fresh compile and a cached one once
differed by up to 2.4e-7, enough to flip a greedy token).

Each process runs ``_determinism_probe.py`` against one fresh
``NUMBA_CACHE_DIR``. The default tier compiles the F32 decode cold, then
loads it warm on another thread count. The full tier's three processes:
the first compiles the F32 decode only (cold), the second compiles the q8,
f16/bf16 and chunk kernels fresh against callees already cached (partly
warm), the third loads everything (warm).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("_determinism_probe.py")


def probe(cache_dir, which, threads):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), NUMBA_NUM_THREADS=str(threads),
               KVREG_NUMBA_CACHE="1", OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, str(PROBE), which], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cold_compile_and_a_warm_load_give_the_same_decode_bits(tmp_path):
    cold = probe(tmp_path, "f32", 2)
    warm = probe(tmp_path, "f32", 1)
    assert any(tmp_path.rglob("*.nbi")), "the probe did not use the on-disk cache"
    assert cold == warm, f"cold and warm decodes differ: {cold} vs {warm}"


@pytest.mark.cold_jit
def test_bits_do_not_depend_on_threads_cache_state_or_call_history(tmp_path):
    cold = probe(tmp_path, "f32", 2)
    partly_warm = probe(tmp_path, "all", 1)
    warm = probe(tmp_path, "all", 2)
    assert any(tmp_path.rglob("*.nbi")), "the probe did not use the on-disk cache"
    runs = {"cold": cold, "partly warm": partly_warm, "warm": warm}
    for kernel in ("f32", "q8", "q8w", "f16", "bf16", "chunk"):
        seen = {f"{name}, {key}": digest for name, run in runs.items() for key, digest in run.items()
                if key.startswith(kernel + " ")}
        assert len(set(seen.values())) == 1, f"{kernel}: bits differ between runs: {seen}"
    assert cold["f32 threads=1"] == warm["f32 after other calls"]
