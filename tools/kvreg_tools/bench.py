"""``kvreg bench``: throughput measured against the machine's own limits.

One run measures, side by side and in the same process: the machine's
streaming-read bandwidth, numpy's float32 matmul FLOP/s, every installed
backend, the NumPy reference, and ``torch`` SDPA when torch is importable.
Every speed is printed next to the ratio that makes it readable on any
machine (a decode GB/s over the bandwidth, a prefill FLOP/s over matmul, an
append over a memcpy of the row, a decode beside a busy process over the
same decode quiet), because absolute times on a shared, noisy machine say
little.

``what``: ``all`` (decode, q8, busy, small call, prefill, append, wire) or
``decode`` (decode, q8, busy and small call only). The layers are filled by
:mod:`kvreg_conformance.fill` (the ``bench`` extra installs it).
:func:`run` returns every figure as a JSON-able dict; :func:`main` is the CLI.
Tests pass a tiny :class:`Sizes` through ``args.sizes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["Sizes", "FULL", "QUICK", "TINY", "time_call", "stream_read_bandwidth", "matmul_flops",
           "time_beside_probe", "last_level_cache_bytes", "ColdRing", "SmallModelCall", "busy_process",
           "quiet_and_busy", "run", "format_report", "plot_decode", "main"]


@dataclass(frozen=True)
class Sizes:
    """What one bench run measures, and how long each measurement may take."""

    decode_rows: tuple = (1024, 4096, 16384, 65536)
    q8_rows: tuple = (4096, 16384)
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    # Prefill: 8 Q / 2 KV heads (GQA 4); the fraction of matmul peak does not
    # depend on the head count, the run time does.
    prefill_s0: int = 8192
    prefill_b: int = 512
    prefill_heads: tuple = (8, 2)
    wire_rows: int = 16384
    repeats: int = 5
    min_time: float = 0.1
    max_time: float = 4.0
    bandwidth_bytes: int = 256 << 20
    matmul_n: int = 2048
    #: At most this many copies of a decode layer (:class:`ColdRing`).
    cold_copies: int = 16
    #: Rows of the decode timed quiet and beside a busy process.
    busy_rows: int = 4096
    #: The small model's decode call (:class:`SmallModelCall`): rows and layers.
    small_rows: int = 1024
    small_layers: int = 30


FULL = Sizes()
QUICK = Sizes(decode_rows=(1024, 4096, 16384), q8_rows=(4096,), prefill_s0=2048, prefill_b=256,
              wire_rows=4096, repeats=3, min_time=0.03, max_time=1.0, bandwidth_bytes=128 << 20,
              matmul_n=1024)
TINY = Sizes(decode_rows=(64, 128), q8_rows=(128,), num_heads=4, num_kv_heads=2, head_dim=32,
             prefill_s0=64, prefill_b=16, prefill_heads=(4, 2), wire_rows=128, repeats=1, min_time=0.0,
             max_time=0.05, bandwidth_bytes=1 << 20, matmul_n=64, cold_copies=2, busy_rows=128,
             small_rows=64, small_layers=2)


# ── timing and the machine's references ──

def time_call(fn, *, min_time: float = 0.05, repeats: int = 3, max_time: float = 2.0) -> float:
    """Best seconds per call over ``repeats`` repeats, each running ``fn`` for
    at least ``min_time``; stops early once ``max_time`` is spent (one repeat
    always runs). Time-boxed so a slow backend cannot stall the run."""
    best = float("inf")
    start = time.perf_counter()
    for _ in range(max(int(repeats), 1)):
        n = 0
        t0 = time.perf_counter()
        while True:
            fn()
            n += 1
            el = time.perf_counter() - t0
            if el >= min_time:
                break
        best = min(best, el / n)
        if time.perf_counter() - start >= max_time:
            break
    return best


def stream_read_bandwidth(nbytes: int | None = None, *, quick: bool = False) -> tuple[float, str]:
    """(GB/s, source): ``kvreg_numba.bandwidth.stream_read_bandwidth`` when
    importable (a parallel reduction, read the way the decode kernels read),
    else a numpy fallback: float32 matrix-vector products, which read the
    matrix once through the multi-threaded BLAS."""
    nbytes = int(nbytes or (QUICK if quick else FULL).bandwidth_bytes)
    try:
        from kvreg_numba.bandwidth import stream_read_bandwidth as numba_bw
    except Exception as exc:  # not installed, or numba cannot start here
        why = "kvreg-numba not installed" if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
    else:
        try:
            return float(numba_bw(nbytes)), "kvreg_numba.bandwidth (numba parallel sum)"
        except Exception as exc:
            why = f"kvreg_numba.bandwidth failed: {type(exc).__name__}: {exc}"
    cols = 4096
    a = np.ones((max(nbytes // 4 // cols, 1), cols), dtype=np.float32)
    x = np.ones(cols, dtype=np.float32)
    a @ x
    t = time_call(lambda: a @ x, min_time=0.0, repeats=5, max_time=2.0)
    return a.nbytes / t / 1e9, f"numpy sgemv fallback ({why})"


def time_beside_probe(measure, nbytes: int) -> tuple[float, float]:
    """``(measure(), GB/s)``: the stream probe (:func:`stream_read_bandwidth`
    of ``nbytes``) run right before and right after the timing, averaged. On
    a shared machine the probe moves with the neighbours (30-36 GB/s beside
    them, 55-58 when they paused, minutes apart on this repository's Zen
    4), so a fraction of bandwidth compares a call with the probe around it,
    not with one taken at the start of the run."""
    before = stream_read_bandwidth(nbytes)[0]
    t = measure()
    return t, (before + stream_read_bandwidth(nbytes)[0]) / 2


_SPIN = "import time\nprint(flush=True)\nt = time.time() + 600\nwhile time.time() < t:\n    pass\n"


@contextlib.contextmanager
def busy_process():
    """Another process spinning on a core while inside (the competing
    process: a host's neighbour, a second model, a build), killed on the way
    out; it gives up by itself after 10 minutes. Entered once it spins, so a
    timing inside never samples the interpreter still starting. Yields the
    process."""
    busy = subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.PIPE)
    try:
        busy.stdout.readline()
        yield busy
    finally:
        busy.kill()
        busy.wait()
        busy.stdout.close()


def matmul_flops(n: int | None = None, *, quick: bool = False) -> float:
    """numpy float32 ``n x n`` matmul FLOP/s (best of a few)."""
    n = int(n or (QUICK if quick else FULL).matmul_n)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    t = time_call(lambda: a @ b, min_time=0.05 if n >= 512 else 0.0, repeats=3, max_time=2.0)
    return 2.0 * n ** 3 / t


def chunk_flops(s0: int, b: int, num_heads: int, head_dim: int) -> float:
    """Useful FLOPs of a causal prefill chunk (QKᵀ and PV over visible keys)."""
    keys = b * s0 + b * (b + 1) / 2
    return 4.0 * num_heads * head_dim * keys


# ── progress ──

class _Progress:
    """One status line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        line = f"[{self.done:>2}/{self.total}] {time.perf_counter() - self.t0:6.1f}s  {what}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


# ── the measurements ──

def _rows_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _backends(names) -> tuple[list, list]:
    """(started backends, [(name, why)] that could not start). The reference
    always runs: it is the peer every other backend is read against.
    ``KVREG_DEVICE`` goes to the backends that take devices; the CPU-only
    ones run beside them on the CPU."""
    from kvreg import registry
    from kvreg.errors import BackendError

    found = registry.backends()
    wanted = list(found) if not names else list(dict.fromkeys(["reference", *names]))
    started, failed = [], []
    for name in wanted:
        cpu_only = name in found and not registry.takes_devices(found[name])
        try:
            started.append(registry.get_backend(name, "cpu" if cpu_only else None))
        except BackendError as exc:
            failed.append((name, str(exc)))
    for name, err in registry.load_errors().items():
        failed.append((name, f"plugin failed to load: {err}"))
    started.sort(key=lambda b: b.name != "reference")
    return started, failed


def _torch_sdpa():
    """``(torch, sdpa)`` or ``(None, why)``."""
    try:
        import torch
        from torch.nn.functional import scaled_dot_product_attention
    except Exception as exc:
        return None, f"torch not importable ({type(exc).__name__})"
    return torch, scaled_dot_product_attention


def last_level_cache_bytes() -> int:
    """The largest CPU cache of cpu0 in bytes (Linux sysfs), or 64 MiB when
    sysfs does not say."""
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * unit)
        except (OSError, ValueError):
            continue
    return best or 64 << 20


class ColdRing:
    """Copies of one workload (``make()``, ``nbytes(item)`` bytes each) taken
    in turn, enough of them to span twice the last-level cache: each use
    then reads its rows from memory, as a model's decode reads each layer's
    cache once a token with every other layer's in between. Timing one
    layer over and over instead can keep part of a 4k-row layer (32 MiB of
    F32) in a 32 MiB L3, a read "faster than memory"."""

    def __init__(self, make, nbytes, *, max_copies: int = 16):
        self.items = [make()]
        size = max(int(nbytes(self.items[0])), 1)
        count = max(min(-(-2 * last_level_cache_bytes() // size), max_copies), 1)
        self.items += [make() for _ in range(count - 1)]
        self._at = 0

    @classmethod
    def of_layers(cls, make, q, *, max_copies: int = 16) -> ColdRing:
        """A ring of ``make()`` layers, each having attended ``q`` once (JIT
        compile, device upload) so that no timing pays for it."""
        ring = cls(make, lambda lay: lay.memory_bytes(), max_copies=max_copies)
        for lay in ring.items:
            lay.attend_layer(q)
        return ring

    def next(self):
        """The next copy (round-robin)."""
        self._at = (self._at + 1) % len(self.items)
        return self.items[self._at]


class SmallModelCall:
    """A small model's decode call: one token appended to a layer and
    attended, at SmolLM2-135M's geometry (9 Q / 3 KV heads, hd 64), going
    round ``layers`` layers of ``rows`` rows as a decode step does (30 layers
    of 1.5 MiB at 1k rows, so each call reads its rows from where a model
    finds them). Issue 17's bound: at most 1.5x the time of reading the
    layer's bytes at the stream bandwidth plus 10 µs. Three spellings of the
    same call: ``append`` + ``attend_layer``, ``append_attend`` and the
    layer's prepared :class:`kvreg.DecodeStep`."""

    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
    CALLS = ("append + attend_layer", "append_attend", "decode_step")

    def __init__(self, backend, rows: int = 1024, layers: int = 30):
        from kvreg_conformance.fill import filled_layer

        rng = np.random.default_rng(5)
        self.q = rng.standard_normal((self.NUM_HEADS, self.HEAD_DIM)).astype(np.float32)
        self.kv = rng.standard_normal((self.NUM_KV_HEADS, self.HEAD_DIM)).astype(np.float32)
        self.layers = ColdRing.of_layers(
            lambda: filled_layer(rows, self.NUM_KV_HEADS, self.HEAD_DIM, backend=backend),
            self.q, max_copies=layers)
        self._steps = {id(lay): lay.decode_step(self.NUM_HEADS) for lay in self.layers.items}
        for call in self.CALLS:    # every path compiled and warm
            for _ in self.layers.items:
                self.call(call)
            self._drop(1)

    def call(self, name: str):
        """One decode call on the next layer, spelt as ``name`` (one of
        :data:`CALLS`); returns the layer."""
        layer = self.layers.next()
        if name == "decode_step":
            self._steps[id(layer)](self.kv, self.kv, self.q)
        elif name == "append_attend":
            layer.append_attend(self.kv, self.kv, self.q)
        else:
            layer.append(self.kv, self.kv)
            layer.attend_layer(self.q)
        return layer

    def _drop(self, n: int) -> None:
        for lay in self.layers.items:
            lay.truncate_last(n)

    def seconds(self, name: str, repeats: int = 15) -> tuple[float, float]:
        """Best seconds per call over ``repeats`` rounds of two calls per
        layer, and the mean rows those calls read. The layers grow through
        the rounds, as in a model's decode (cutting them back between rounds
        would make a prepared :class:`kvreg.DecodeStep` prepare again), and
        are cut back to ``rows`` after them, outside the clock."""
        n = 2 * len(self.layers.items)
        start = self.layers.items[0].seq_len
        best, rows = float("inf"), start
        for r in range(max(int(repeats), 1)):
            t0 = time.perf_counter()
            for _ in range(n):
                self.call(name)
            t = (time.perf_counter() - t0) / n
            if t < best:   # this round's calls read start + 2r + 1 and + 2r + 2 rows
                best, rows = t, start + 2 * r + 1.5
        self._drop(2 * max(int(repeats), 1))
        return best, rows

    def vs_bytes_plus_10us(self, name: str, *, repeats: int = 15, bandwidth_bytes: int | None = None) -> dict:
        """``name``'s best time per call over its bytes read at the stream
        probe run around it (:func:`time_beside_probe`) plus 10 µs."""
        (t, rows), bw = time_beside_probe(lambda: self.seconds(name, repeats),
                                          bandwidth_bytes or QUICK.bandwidth_bytes)
        nbytes = self.layers.items[0].memory_bytes() * rows / self.layers.items[0].seq_len
        return dict(seconds=t, probe_gbps=bw, ratio=t / (nbytes / (bw * 1e9) + 10e-6))


def _small(res, backends, sz, prog):
    """:class:`SmallModelCall` per backend, its three spellings."""
    for be in backends:
        prog.step(f"small model's decode call, {be.name}")
        small = SmallModelCall(be, sz.small_rows, sz.small_layers)
        for call in SmallModelCall.CALLS:
            res["small"].append(dict(backend=be.name, call=call, rows=sz.small_rows,
                                     layers=len(small.layers.items), **small.vs_bytes_plus_10us(
                                         call, repeats=sz.repeats * 3, bandwidth_bytes=sz.bandwidth_bytes)))
        del small


def _timer(sz: Sizes):
    return lambda fn: time_call(fn, min_time=sz.min_time, repeats=sz.repeats, max_time=sz.max_time)


def _decode(res, backends, sz, prog):
    """Decode and q8 figures, each layer timed cold (:class:`ColdRing`) and
    read against the probe around it (:func:`time_beside_probe`); then one
    decode per backend and of SDPA quiet and beside a busy process."""
    from kvreg_conformance.fill import filled_layer, kv_rows

    timeit = _timer(sz)
    nh, nkv, hd = sz.num_heads, sz.num_kv_heads, sz.head_dim
    q = np.random.default_rng(1).standard_normal((nh, hd), dtype=np.float32)

    def probed(fn):
        return time_beside_probe(lambda: timeit(fn), sz.bandwidth_bytes)

    def layers(be, rows, mode):
        return ColdRing.of_layers(lambda: filled_layer(rows, nkv, hd, mode=mode, backend=be), q,
                                  max_copies=sz.cold_copies)

    torch, sdpa = _torch_sdpa()
    if torch is not None:
        tq = torch.from_numpy(q.copy()).reshape(1, nh, 1, hd)

    def sdpa_ring(rows):
        """A ring of SDPA's K/V tensors and a decode on the next of them."""
        k, v = kv_rows(rows, nkv, hd)
        copy = lambda a: torch.from_numpy(np.array(a)).unsqueeze(0)  # noqa: E731
        ring = ColdRing(lambda: (copy(k), copy(v)), lambda kv: 2 * k.nbytes, max_copies=sz.cold_copies)
        with torch.no_grad():
            sdpa(tq, *ring.items[0], enable_gqa=True)
        return ring, lambda: sdpa(tq, *ring.next(), enable_gqa=True)

    f32_seconds = {}
    for be in backends:
        for rows in sz.decode_rows:
            prog.step(f"decode {be.name} {_rows_label(rows)} rows")
            ring = layers(be, rows, "f32")
            t, bw = probed(lambda ring=ring: ring.next().attend_layer(q))
            nbytes = ring.items[0].memory_bytes()
            f32_seconds[(be.name, rows)] = t
            res["decode"].append(dict(backend=be.name, kv="f32", rows=rows, seconds=t, bytes=nbytes,
                                      copies=len(ring.items), probe_gbps=bw, gbps=nbytes / t / 1e9,
                                      fraction=nbytes / t / 1e9 / bw))
            del ring
    sdpa_ok = torch is not None
    if not sdpa_ok:
        res["peers"]["torch-sdpa"] = sdpa
    else:
        res["peers"]["torch-sdpa"] = f"torch {torch.__version__}"
        for rows in sz.decode_rows:
            prog.step(f"decode torch-sdpa {_rows_label(rows)} rows")
            nbytes = 2 * rows * nkv * hd * 4
            try:
                ring, step = sdpa_ring(rows)
                with torch.no_grad():
                    t, bw = probed(step)
            except Exception as exc:  # an older torch without enable_gqa
                res["peers"]["torch-sdpa"] = f"torch {torch.__version__}: SDPA failed: {exc}"
                sdpa_ok = False
                break
            res["decode"].append(dict(backend="torch-sdpa", kv="f32", rows=rows, seconds=t, bytes=nbytes,
                                      copies=len(ring.items), probe_gbps=bw, gbps=nbytes / t / 1e9,
                                      fraction=nbytes / t / 1e9 / bw))
            del ring, step
    for be in backends:
        for rows in sz.q8_rows:
            prog.step(f"q8 decode {be.name} {_rows_label(rows)} rows")
            ring = layers(be, rows, "q8")
            tq8, bw = probed(lambda ring=ring: ring.next().attend_layer(q))
            nbytes = ring.items[0].memory_bytes()
            del ring
            tf = f32_seconds.get((be.name, rows))
            if tf is None:
                ring = layers(be, rows, "f32")
                tf = timeit(lambda ring=ring: ring.next().attend_layer(q))
                del ring
            res["q8"].append(dict(backend=be.name, rows=rows, q8_seconds=tq8, f32_seconds=tf, ratio=tq8 / tf,
                                  probe_gbps=bw, q8_gbps=nbytes / tq8 / 1e9, q8_fraction=nbytes / tq8 / 1e9 / bw))

    rows = sz.busy_rows
    for be in backends:
        prog.step(f"decode {be.name} {_rows_label(rows)} rows, quiet and beside a busy process")
        ring = layers(be, rows, "f32")
        res["busy"].append(dict(backend=be.name, rows=rows, **quiet_and_busy(
            lambda ring=ring: ring.next().attend_layer(q), timeit)))
        del ring
    if sdpa_ok:
        prog.step(f"decode torch-sdpa {_rows_label(rows)} rows, quiet and beside a busy process")
        ring, step = sdpa_ring(rows)
        with torch.no_grad():
            res["busy"].append(dict(backend="torch-sdpa", rows=rows, **quiet_and_busy(step, timeit)))
        del ring, step


def quiet_and_busy(fn, timeit) -> dict:
    """``fn`` timed quiet, beside :func:`busy_process`, then quiet again:
    the quiet time is the mean of the two, so a neighbour's drift during
    the measurement shows in neither ratio's favour."""
    before = timeit(fn)
    with busy_process():
        busy = timeit(fn)
    quiet = (before + timeit(fn)) / 2
    return dict(quiet_seconds=quiet, busy_seconds=busy, ratio=busy / quiet)


def _prefill(res, backends, sz, peak, prog):
    from kvreg_conformance.fill import filled_layer

    nh, nkv = sz.prefill_heads
    hd, s0, b = sz.head_dim, sz.prefill_s0, sz.prefill_b
    q = np.random.default_rng(2).standard_normal((b, nh, hd), dtype=np.float32)
    flops = chunk_flops(s0, b, nh, hd)
    for be in backends:
        prog.step(f"prefill {be.name} b={b} after {_rows_label(s0)}")
        layer = filled_layer(s0 + b, nkv, hd, backend=be)
        layer.attend_chunk(q, b, s0, nh // nkv)
        t = time_call(lambda layer=layer: layer.attend_chunk(q, b, s0, nh // nkv), min_time=0.0,
                      repeats=sz.repeats, max_time=sz.max_time)
        res["prefill"].append(dict(backend=be.name, s0=s0, b=b, num_heads=nh, num_kv_heads=nkv, seconds=t,
                                   gflops=flops / t / 1e9, fraction=flops / t / peak))


def _append(res, backends, sz, prog):
    from kvreg import LayerKvCache

    nkv, hd = sz.num_kv_heads, sz.head_dim
    rows = np.random.default_rng(3).standard_normal((256, nkv, hd), dtype=np.float32)
    dk, dv = np.empty((nkv, hd), np.float32), np.empty((nkv, hd), np.float32)

    def memcpy():
        np.copyto(dk, rows[0])
        np.copyto(dv, rows[1])

    tm = time_call(memcpy, min_time=max(sz.min_time, 0.01), repeats=3, max_time=1.0)
    for be in backends:
        for kv in ("f32", "q8"):
            prog.step(f"append {be.name} {kv}")
            layer = LayerKvCache(nkv, hd, kv, be)
            for i in range(80):      # past the q8 freeze: steady state
                layer.append(rows[i & 255], rows[i & 255])
            it = iter(range(1 << 62))

            def one(it=it, layer=layer):
                r = rows[next(it) & 255]
                layer.append(r, r)

            t = time_call(one, min_time=max(sz.min_time, 0.01), repeats=sz.repeats, max_time=sz.max_time)
            res["append"].append(dict(backend=be.name, kv=kv, us_per_token=t * 1e6, memcpy_us=tm * 1e6,
                                      ratio=t / tm))


def _wire(res, sz, bw, prog):
    from kvreg import LayerKvCache
    from kvreg_conformance.fill import filled_layer

    nkv, hd, rows = sz.num_kv_heads, sz.head_dim, sz.wire_rows
    src = filled_layer(rows, nkv, hd, backend="reference")
    dst = LayerKvCache(nkv, hd, "f32", "reference")
    payload = 2 * rows * nkv * hd * 4     # the f32 K and V the layer holds
    timeit = _timer(sz)
    for f16 in (False, True):
        prog.step(f"wire {'f16' if f16 else 'f32'} {_rows_label(rows)} rows")
        blob = src.export_wire(f16)
        te = timeit(lambda f16=f16: src.export_wire(f16))
        ti = timeit(lambda blob=blob: dst.import_wire(blob))
        res["wire"].append(dict(payload="f16" if f16 else "f32", rows=rows, blob_bytes=len(blob),
                                export_gbps=payload / te / 1e9, import_gbps=payload / ti / 1e9,
                                export_fraction=payload / te / 1e9 / bw, import_fraction=payload / ti / 1e9 / bw))


def run(what: str = "all", backend_names=None, sizes: Sizes = FULL, *, progress: bool = True) -> dict:
    """Every figure of one bench run (see the module doc), as a dict."""
    backends, failed = _backends(backend_names)
    nb = len(backends)
    steps = 2 + nb * (len(sizes.decode_rows) + len(sizes.q8_rows) + 2)
    if _torch_sdpa()[0] is not None:
        steps += len(sizes.decode_rows) + 1
    if what == "all":
        steps += nb + 2 * nb + 2
    prog = _Progress(steps, progress)
    res = {"what": what, "sizes": dataclasses.asdict(sizes), "machine": {},
           "backends": [b.describe() for b in backends],
           "unavailable": [dict(backend=n, why=w) for n, w in failed], "peers": {},
           "decode": [], "q8": [], "busy": [], "small": [], "prefill": [], "append": [], "wire": []}
    try:
        prog.step("stream-read bandwidth")
        bw, src = stream_read_bandwidth(sizes.bandwidth_bytes)
        prog.step("float32 matmul")
        peak = matmul_flops(sizes.matmul_n)
        res["machine"] = dict(stream_read_gbps=bw, bandwidth_source=src, matmul_gflops=peak / 1e9,
                              matmul_n=sizes.matmul_n, llc_bytes=last_level_cache_bytes(),
                              cpu_count=os.cpu_count(), numpy=np.__version__,
                              python=platform.python_version(), platform=platform.platform())
        _decode(res, backends, sizes, prog)
        _small(res, backends, sizes, prog)
        if what == "all":
            _prefill(res, backends, sizes, peak, prog)
            _append(res, backends, sizes, prog)
            _wire(res, sizes, bw, prog)
    finally:
        prog.close()
    return res


# ── reporting ──

def _table(header, rows) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    return [fmt(header), "-" * len(fmt(header)), *map(fmt, rows)]


def format_report(res: dict) -> str:
    """The human-readable tables of a :func:`run` result."""
    m, sz = res["machine"], res["sizes"]
    out = [f"machine: {m['cpu_count']} CPUs, numpy {m['numpy']}, Python {m['python']}",
           f"  stream-read bandwidth {m['stream_read_gbps']:.1f} GB/s  [{m['bandwidth_source']}]",
           f"  float32 matmul {m['matmul_gflops']:.1f} GFLOP/s  [numpy {m['matmul_n']}^3]"]
    for u in res["unavailable"]:
        out.append(f"  backend {u['backend']}: not measured ({u['why']})")
    for name, what in res["peers"].items():
        out.append(f"  peer {name}: {what}")
    rows_all = sz["decode_rows"]
    out += ["", f"decode (attend_layer, one token, {sz['num_heads']} Q / {sz['num_kv_heads']} KV heads, "
                f"hd {sz['head_dim']}, F32): GB/s of K+V read (fraction of the stream probe run around "
                f"it); each call reads its layer from memory (copies taken in turn, past twice the "
                f"{m.get('llc_bytes', 0) >> 20} MiB last-level cache, as in a model)"]
    names = list(dict.fromkeys(d["backend"] for d in res["decode"]))
    cells = {(d["backend"], d["rows"]): f"{d['gbps']:.2f} ({d['fraction']:.2f})" for d in res["decode"]}
    out += _table(["backend", *map(_rows_label, rows_all)],
                  [[n, *(cells.get((n, r), "-") for r in rows_all)] for n in names])
    probes = [d["probe_gbps"] for d in res["decode"] + res["q8"] if "probe_gbps" in d]
    if probes:
        out.append(f"(the probe around these timings read {min(probes):.1f}-{max(probes):.1f} GB/s)")
    if res["q8"]:
        out += ["", "q8 decode: time q8 / time F32 (below 1: fewer bytes read pays off); q8 GB/s (fraction)"]
        out += _table(["backend", "rows", "q8 ms", "F32 ms", "q8/F32", "q8 GB/s"],
                      [[d["backend"], _rows_label(d["rows"]), f"{d['q8_seconds'] * 1e3:.2f}",
                        f"{d['f32_seconds'] * 1e3:.2f}", f"{d['ratio']:.2f}",
                        f"{d['q8_gbps']:.2f} ({d['q8_fraction']:.2f})"] for d in res["q8"]])
    if res["busy"]:
        out += ["", f"beside a busy process (another process spinning on a core; kvreg on its default thread "
                    f"budget, torch on its own): a {_rows_label(res['busy'][0]['rows'])}-row decode, each call "
                    "from memory"]
        out += _table(["backend", "quiet ms", "busy ms", "busy/quiet"],
                      [[d["backend"], f"{d['quiet_seconds'] * 1e3:.2f}", f"{d['busy_seconds'] * 1e3:.2f}",
                        f"{d['ratio']:.2f}"] for d in res["busy"]])
    if res["small"]:
        s0 = res["small"][0]
        out += ["", f"a small model's decode call (SmolLM2-135M: 9 Q / 3 KV heads, hd 64; {s0['rows']} rows, going "
                    f"round {s0['layers']} layers): µs per call, and over reading its bytes at the probe + 10 µs"]
        out += _table(["backend", "call", "µs", "x (bytes + 10 µs)"],
                      [[d["backend"], d["call"], f"{d['seconds'] * 1e6:.1f}", f"{d['ratio']:.2f}"]
                       for d in res["small"]])
    if res["prefill"]:
        p0 = res["prefill"][0]
        out += ["", f"prefill (attend_chunk b={p0['b']} after {p0['s0']} rows, {p0['num_heads']} Q / "
                    f"{p0['num_kv_heads']} KV heads, hd {sz['head_dim']}): useful GFLOP/s (fraction of matmul)"]
        out += _table(["backend", "ms", "GFLOP/s", "of matmul"],
                      [[d["backend"], f"{d['seconds'] * 1e3:.1f}", f"{d['gflops']:.2f}", f"{d['fraction']:.3f}"]
                       for d in res["prefill"]])
    if res["append"]:
        out += ["", f"append (one token, one {sz['num_kv_heads']}x{sz['head_dim']} layer, K and V): "
                    "µs per token, and over a memcpy of the row"]
        out += _table(["backend", "kv", "µs/token", "memcpy µs", "x memcpy"],
                      [[d["backend"], d["kv"], f"{d['us_per_token']:.1f}", f"{d['memcpy_us']:.2f}",
                        f"{d['ratio']:.0f}"] for d in res["append"]])
    if res["wire"]:
        w0 = res["wire"][0]
        out += ["", f"wire ({_rows_label(w0['rows'])}-row {sz['num_kv_heads']}x{sz['head_dim']} layer): "
                    "GB/s of f32 K+V (fraction of stream bandwidth)"]
        out += _table(["payload", "blob MiB", "export GB/s", "import GB/s"],
                      [[d["payload"], f"{d['blob_bytes'] / 2**20:.1f}",
                        f"{d['export_gbps']:.2f} ({d['export_fraction']:.2f})",
                        f"{d['import_gbps']:.2f} ({d['import_fraction']:.2f})"] for d in res["wire"]])
    return "\n".join(out)


def plot_decode(res: dict, path: str) -> None:
    """Decode GB/s against context length, one line per backend, with the
    stream-read bandwidth as the ceiling. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(d["backend"] for d in res["decode"]):
        pts = sorted((d["rows"], d["gbps"]) for d in res["decode"] if d["backend"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for d in res["q8"]:
        ax.plot([d["rows"]], [d["q8_gbps"]], marker="x", linestyle="none", color="gray")
    bw = res["machine"]["stream_read_gbps"]
    ax.axhline(bw, color="k", linestyle="--", label=f"stream read {bw:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (rows)")
    ax.set_ylabel("decode GB/s (K+V bytes read / time)")
    sz = res["sizes"]
    ax.set_title(f"attend_layer decode, {sz['num_heads']} Q / {sz['num_kv_heads']} KV, hd {sz['head_dim']}"
                 " (x: q8)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    """``kvreg bench [all|decode] [--backend NAME ...] [--quick] [--json FILE] [--plot FILE.png]``."""
    what = getattr(args, "what", "all") or "all"
    if getattr(args, "busy", False):
        print("kvreg bench: --busy applies to --model (`kvreg bench decode` always times a decode beside a "
              "busy process)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("kvreg_conformance") is None:
        print("kvreg bench: needs kvreg-conformance, whose fill helpers build the benchmarked layers "
              "(pip install 'kvreg-tools[bench]')", file=sys.stderr)
        return 2
    plot = getattr(args, "plot", None)
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvreg bench: --plot needs matplotlib (pip install 'kvreg-tools[bench]' or pip install matplotlib)",
                  file=sys.stderr)
            return 2
    sizes = getattr(args, "sizes", None) or (QUICK if getattr(args, "quick", False) else FULL)
    res = run(what, getattr(args, "backend", None), sizes, progress=getattr(args, "progress", True))
    print(format_report(res))
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"\nevery figure: {args.json}")
    if plot:
        plot_decode(res, plot)
        print(f"decode plot: {plot}")
    return 0
