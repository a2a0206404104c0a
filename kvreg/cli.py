"""The ``kvreg`` command: ``info``, ``generate``, ``eval``, ``wire inspect``, ``conformance``, ``bench``, ``demo``."""

from __future__ import annotations

import argparse
import os
import sys


def _cmd_info(args) -> int:
    import kvreg
    from kvreg import registry

    # Diagnoses a bad environment instead of dying of it: every section
    # reports its own failure and the rest still print.
    def failure(exc) -> str:
        return f"ERROR: {exc}" if isinstance(exc, kvreg.KvregError) else f"ERROR: {type(exc).__name__}: {exc}"

    print(f"kvreg {kvreg.__version__}")
    env = {k: os.environ.get(k) for k in ("KVREG_BACKEND", "KVREG_DEVICE", "KVREG_KV")}
    print("environment: " + ", ".join(f"{k}={v if v is not None else '(unset)'}" for k, v in env.items()))
    try:
        mode = kvreg.KvMode.from_env().value
    except Exception as exc:  # noqa: BLE001
        mode = failure(exc)
    print(f"KV mode: {mode}")
    ok = True
    try:
        active = kvreg.get_backend()
        print(f"active backend: {active.describe()}")
    except Exception as exc:  # noqa: BLE001  (a backend's own error, e.g. a driver's, is reported too)
        ok = False
        print(f"active backend: {failure(exc)}")
    print("registered backends:")
    try:
        found = sorted(registry.backends().items())
    except Exception as exc:  # noqa: BLE001
        found = []
        print(f"  {failure(exc)}")
    for name, cls in found:
        try:
            devices = cls.device_labels()
        except Exception as exc:  # noqa: BLE001
            devices = [f"unavailable: {exc}"]
        try:
            native = cls.native_kernels()
        except Exception as exc:  # noqa: BLE001
            native = [failure(exc)]
        takes = ", takes KVREG_DEVICE" if registry.takes_devices(cls) else ""
        print(f"  {name} (priority {cls.priority}{', auto' if cls.auto else ''}{takes})")
        print(f"    devices: {'; '.join(devices) if devices else 'none'}")
        print(f"    native kernels: {', '.join(native) if native else 'none (inherits the reference)'}")
    for name, err in registry.load_errors().items():
        print(f"  {name}: FAILED TO LOAD: {err}")
    _print_kv_modes(failure)
    # The report is the product; a non-zero status tells a script that the
    # environment as set cannot run kvreg.
    return 0 if ok else 1


#: One line per KV mode for ``kvreg info``; a mode missing here gets a generic line.
_KV_MODE_DESCRIPTIONS = {
    "f32": "float32 K and V (exact; kvreg eval's reference)",
    "f16": "IEEE binary16 K and V, round to nearest even",
    "bf16": "bfloat16 K and V, round to nearest even",
    "q8": "int8 K (rotated, scale per 32 channels) and V (scale per row); 8 newest rows float16",
    "q8k": "q8's K, float32 V",
    "q8v": "float32 K, q8's V",
    "q4": "int4 rows (rotated); the 112 before the 16 newest int8, those float16",
    "q8_2f": "the seed's q8: int8 K and V over a per-channel field frozen at 64 rows",
    "q8k_2f": "the seed's q8 on K only (2f field), float32 V",
    "q8v_2f": "the seed's q8 on V only (2f field), float32 K",
}

#: (label, num_kv_heads, head_dim) of the geometries ``kvreg info`` sizes each mode at.
_KV_INFO_GEOMETRIES = (("SmolLM2-135M", 3, 64), ("Gemma-3-270M", 1, 256))
_KV_INFO_ROWS = 2048


def _kv_bytes_per_element(mode, nkv: int, hd: int, rows: int = _KV_INFO_ROWS) -> float:
    """Stored bytes per K/V element of a reference layer holding ``rows`` random rows."""
    import numpy as np

    import kvreg

    layer = kvreg.LayerKvCache(nkv, hd, mode, "reference")
    rng = np.random.default_rng(0)
    layer.extend(rng.standard_normal((rows, nkv, hd), dtype=np.float32),
                 rng.standard_normal((rows, nkv, hd), dtype=np.float32))
    return layer.memory_bytes() / (2 * nkv * hd * rows)


def _print_kv_modes(failure) -> None:
    """The ``KV modes`` section of ``kvreg info``: every :class:`KvMode`, its
    bytes/element (computed here) and its measured KL (:mod:`kvreg.measured`)."""
    import kvreg
    from kvreg import measured

    def fig(kl_top1) -> str:
        if kl_top1 is None:
            return "—"
        kl, top1 = kl_top1
        return f"{kl:.2e} ({'—' if top1 is None else f'{100 * top1:.1f}%'})"

    geo = " / ".join(f"{label} {nkv}x{hd}" for label, nkv, hd in _KV_INFO_GEOMETRIES)
    models = " / ".join(measured.MODELS)
    print(f"KV modes (bytes/element at {_KV_INFO_ROWS} rows, {geo}; mean KL (top-1), {models}):")
    width = max(len(m.value) for m in kvreg.KvMode)
    for mode in kvreg.KvMode:
        desc = _KV_MODE_DESCRIPTIONS.get(mode.value, f"{mode.value} storage (see kvreg.modes.KvMode)")
        try:
            size = " / ".join(f"{_kv_bytes_per_element(mode, nkv, hd):.3f}" for _, nkv, hd in _KV_INFO_GEOMETRIES)
            size += " bytes/element"
        except Exception as exc:  # noqa: BLE001  (one mode failing leaves the others listed)
            size = failure(exc)
        row = measured.KL.get(mode.value, {})
        kl = " / ".join(fig(row.get(m)) for m in measured.MODELS)
        print(f"  {mode.value:<{width}}  {size}  KL {kl}  {desc}")
    print(f"  measured with: {measured.COMMAND} ({measured.DATE})")


def _cmd_wire_inspect(args) -> int:
    from kvreg.wire import inspect

    try:
        with open(args.file, "rb") as fh:
            buf = fh.read()
    except OSError as exc:
        print(f"kvreg wire inspect: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    report = inspect(buf)
    print(report)
    # inspect() ends with an "OK: ..." or "ERROR: ..." verdict line.
    return 1 if report.rstrip().splitlines()[-1].startswith("ERROR") else 0


def _cmd_conformance(args) -> int:
    from kvreg.conformance_cli import run

    return run(args)


def _cmd_bench(args) -> int:
    from kvreg.bench import main as bench_main

    return bench_main(args)


def _cmd_demo(args) -> int:
    from kvreg.demo import main as demo_main

    return demo_main(args)


def _cmd_generate(args) -> int:
    from kvreg.generate import main as generate_main

    return generate_main(args)


def _cmd_eval(args) -> int:
    from kvreg.evaluation import main as eval_main

    return eval_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvreg", description="kvreg: KV cache library for LLM inference engines")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("info", help="version, backends, devices, native kernels, environment")
    sp.set_defaults(func=_cmd_info)

    from kvreg.evaluation import DEFAULT_CONFIGS
    from kvreg.generate import DEFAULT_PROMPT
    from kvreg.models import MODELS

    gp = sub.add_parser("generate", help="text from a real model through kvreg, beside DynamicCache")
    gp.add_argument("--model", default="smollm2-135m", choices=list(MODELS))
    gp.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    gp.add_argument("--tokens", type=int, default=64)
    gp.add_argument("--kv", default=None, help="KV mode (default: KVREG_KV, else f32)")
    gp.add_argument("--backend", default=None, help="kvreg backend (default: KVREG_BACKEND, else auto)")
    gp.set_defaults(func=_cmd_generate)

    ep = sub.add_parser("eval", help="perplexity, KL and top-1 agreement of cache configs on a real model")
    ep.add_argument("--model", default="smollm2-135m", choices=list(MODELS) + ["all"])
    ep.add_argument("--text", action="append", default=None, metavar="FILE",
                    help="text file (repeatable; default: CPython's textwrap.py)")
    ep.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated: KV modes, born:N, sinkwin:N, recent:N, o1:M:W:SINK, X@MODE, "
                         "dynamic, static (default: %(default)s)")
    ep.add_argument("--tokens", type=int, default=2048)
    ep.add_argument("--prefix", type=int, default=256)
    ep.add_argument("--backend", default=None)
    ep.add_argument("--json", default=None, metavar="FILE")
    ep.add_argument("--md", default=None, metavar="FILE", help="write the markdown tables here too")
    ep.add_argument("--plot", default=None, metavar="FILE.png", help="KL against cache bytes")
    ep.add_argument("--no-progress", action="store_true")
    ep.set_defaults(func=_cmd_eval)

    wp = sub.add_parser("wire", help="wire-format tools")
    wsub = wp.add_subparsers(dest="wire_command", required=True)
    ip = wsub.add_parser("inspect", help="print the header and body summary of a blob, or what is wrong with it")
    ip.add_argument("file")
    ip.set_defaults(func=_cmd_wire_inspect)

    cp = sub.add_parser("conformance", help="run the conformance suite per backend and device")
    cp.add_argument("--backend", default=None, help="backend name or 'all' (default: all installed)")
    cp.add_argument("--device", default=None, help="device spec (backend-specific)")
    cp.add_argument("--report", default=None, metavar="FILE.json")
    cp.add_argument("--junit", default=None, metavar="FILE.xml")
    cp.add_argument("-k", dest="keyword", default=None, metavar="EXPR")
    cp.add_argument("--quick", action="store_true", help="the quick profile (< 60 s per backend)")
    cp.set_defaults(func=_cmd_conformance)

    bp = sub.add_parser("bench", help="throughput against the machine's limits and peers")
    bp.add_argument("what", nargs="?", default="all", choices=["all", "decode", "o1"])
    bp.add_argument("--backend", action="append", default=None)
    bp.add_argument("--quick", action="store_true")
    bp.add_argument("--real", action="store_true",
                    help="o1 only: the accuracy table on real captured Q/K/V (kvreg.testing.real_attention)")
    bp.add_argument("--json", default=None, metavar="FILE")
    bp.add_argument("--plot", default=None, metavar="FILE.png")
    bp.set_defaults(func=_cmd_bench)

    dp = sub.add_parser("demo", help="a small GPT-style decoder driving KvCache")
    dp.add_argument("--tokens", type=int, default=32)
    dp.add_argument("--prompt", type=int, default=256)
    dp.add_argument("--chunk", type=int, default=64)
    dp.add_argument("--kv", default=None, help="KV mode (a KVREG_KV value: f32, f16, bf16, q8, q4, ...)")
    dp.add_argument("--budget", type=int, default=None, help="Born eviction at this many rows")
    dp.add_argument("--o1", action="store_true", help="seal every layer with the O(1) Nyström state")
    dp.add_argument("--handoff", action="store_true", help="prefill in one process, decode in another")
    dp.add_argument("--layers", type=int, default=8)
    dp.set_defaults(func=_cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
