"""The ``kvreg`` command: ``info``, ``wire inspect``; with the
kvreg-conformance distribution installed also ``conformance``, with
kvreg-tools ``generate``, ``eval``, ``bench``, ``demo``, ``report`` (entry-point group
``kvreg.commands``, :data:`COMMANDS_GROUP`)."""

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
            caps = cls.capability_lines()
        except Exception as exc:  # noqa: BLE001
            caps = [f"native kernels: {failure(exc)}"]
        takes = ", takes KVREG_DEVICE" if registry.takes_devices(cls) else ""
        print(f"  {name} (priority {cls.priority}{', auto' if cls.auto else ''}{takes})")
        print(f"    devices: {'; '.join(devices) if devices else 'none'}")
        for line in caps:
            print(f"    {line}")
    for name, err in registry.load_errors().items():
        print(f"  {name}: FAILED TO LOAD: {err}")
    _print_kv_modes(failure)
    # The report is the product; a non-zero status tells a script that the
    # environment as set cannot run kvreg.
    return 0 if ok else 1


#: One line per KV mode for ``kvreg info`` (and ``kvreg eval``'s legend); a mode missing here gets a generic line.
KV_MODE_DESCRIPTIONS = {
    "f32": "float32 K and V (exact; kvreg eval's reference)",
    "f16": "IEEE binary16 K and V, round to nearest even",
    "bf16": "bfloat16 K and V, round to nearest even",
    "q8": "int8 K (rotated, scale per 32 channels) and V (scale per row); 8 newest rows float16",
    "q8k": "q8's K, float32 V",
    "q8v": "float32 K, q8's V",
    "q4": "int4 rows (rotated); the 112 before the 16 newest int8, those float16",
    "q2": "2-bit K per channel and V per row (KIVI), in blocks of 32 rows; the 32-63 newest float16",
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


def _modes_only(rec: dict, modes: set[str]) -> bool:
    return rec.get("kind") == "eval" and all(r["config"] in modes for r in rec.get("results", []))


def measured_modes() -> tuple[list[str], dict[str, dict[str, tuple[float, float | None]]], list[dict]]:
    """The KV modes' accuracy as kvreg's own records measured it
    (``kvreg/results/*.json``, written by ``kvreg eval --json``):
    ``(models, {mode: {model: (mean KL, top-1)}}, the records they come
    from)``. Only records that measure KV modes alone count (a budget or
    eviction record scores modes under another protocol); where two measure
    a mode on a model, the later date wins."""
    import json
    from importlib.resources import files

    import kvreg
    from kvreg.models import MODELS

    modes = {m.value for m in kvreg.KvMode}
    folder = files("kvreg") / "results"
    records = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name) if folder.is_dir() else []:
        if entry.name.endswith(".json"):
            data = json.loads(entry.read_text(encoding="utf-8"))
            records += [r for r in (data if isinstance(data, list) else [data]) if _modes_only(r, modes)]
    figures: dict[str, dict[str, tuple[float, float | None]]] = {}
    source: dict[tuple[str, str], int] = {}
    for i, rec in sorted(enumerate(records), key=lambda ir: ir[1]["date"]):
        for row in rec["results"]:
            if row["config"] in modes:
                figures.setdefault(row["config"], {})[rec["model"]] = (row["kl_mean"], row.get("top1"))
                source[(row["config"], rec["model"])] = i
    used = [records[i] for i in sorted(set(source.values()))]
    # the bundled models first, in the order kvreg info sizes the modes at
    order = {name: i for i, name in enumerate(MODELS)}
    models = sorted({r["model"] for r in used}, key=lambda m: (order.get(m, len(order)), m))
    return models, figures, used


def _print_kv_modes(failure) -> None:
    """The ``KV modes`` section of ``kvreg info``: every :class:`KvMode`, its
    bytes/element (computed here) and its measured KL (:func:`measured_modes`)."""
    import kvreg

    def fig(kl_top1) -> str:
        if kl_top1 is None:
            return "—"
        kl, top1 = kl_top1
        return f"{kl:.2e} ({'—' if top1 is None else f'{100 * top1:.1f}%'})"

    try:
        models, figures, used = measured_modes()
    except Exception as exc:  # noqa: BLE001  (a broken record leaves the sizes listed)
        models, figures, used = [], {}, []
        print(f"measured KL: {failure(exc)}")
    geo = " / ".join(f"{label} {nkv}x{hd}" for label, nkv, hd in _KV_INFO_GEOMETRIES)
    print(f"KV modes (bytes/element at {_KV_INFO_ROWS} rows, {geo}; mean KL (top-1), "
          f"{' / '.join(models) or 'not measured'}):")
    width = max(len(m.value) for m in kvreg.KvMode)
    for mode in kvreg.KvMode:
        desc = KV_MODE_DESCRIPTIONS.get(mode.value, f"{mode.value} storage (see kvreg.modes.KvMode)")
        try:
            size = " / ".join(f"{_kv_bytes_per_element(mode, nkv, hd):.3f}" for _, nkv, hd in _KV_INFO_GEOMETRIES)
            size += " bytes/element"
        except Exception as exc:  # noqa: BLE001  (one mode failing leaves the others listed)
            size = failure(exc)
        row = figures.get(mode.value, {})
        kl = " / ".join(fig(row.get(m)) for m in models) or "—"
        print(f"  {mode.value:<{width}}  {size}  KL {kl}  {desc}")
    for rec in sorted(used, key=lambda r: models.index(r["model"])):
        print(f"  measured {rec['date']} on {rec['machine']['cpu']}: {rec['command']}")
    print("  every measured figure: docs/benchmarks.md (kvreg report)")


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


#: The subcommands other distributions provide: name -> (distribution, its
#: folder in kvreg's repository, help). Without the distribution installed
#: each still parses and says how to install it.
PLUGIN_COMMANDS = {
    "conformance": ("kvreg-conformance", "conformance", "run the conformance suite per backend and device"),
    "generate": ("kvreg-tools", "tools", "text from a real model through kvreg, beside DynamicCache"),
    "eval": ("kvreg-tools", "tools", "perplexity, KL and top-1 agreement of cache configs on a real model"),
    "bench": ("kvreg-tools", "tools", "throughput against the machine's limits and peers"),
    "demo": ("kvreg-tools", "tools", "a small GPT-style decoder driving KvCache"),
    "report": ("kvreg-tools", "tools", "docs/benchmarks.md from the benchmark records"),
}

#: The entry-point group of extra ``kvreg`` subcommands. Each entry point is a
#: callable ``register(subparsers)`` that adds its subparser(s) and sets their
#: handler with ``set_defaults(func=...)``; the handler gets the parsed
#: arguments and returns the exit status.
COMMANDS_GROUP = "kvreg.commands"


def _command_entry_points() -> list:
    """The installed entry points of :data:`COMMANDS_GROUP` (a seam for tests)."""
    from importlib.metadata import entry_points

    seen, found = set(), []
    for ep in entry_points(group=COMMANDS_GROUP):
        if (ep.name, ep.value) not in seen:  # one distribution seen twice on sys.path
            seen.add((ep.name, ep.value))
            found.append(ep)
    return found


def _register_plugins(sub) -> dict:
    """Lets every installed ``kvreg.commands`` entry point add its subcommands.

    A plugin that fails to load or register is reported on stderr and
    skipped (``kvreg info`` must still run in a broken environment); returns
    ``{entry point name: error}`` for those."""
    errors = {}
    for ep in _command_entry_points():
        try:
            ep.load()(sub)
        except Exception as exc:  # noqa: BLE001  (one broken plugin leaves the others and the core commands)
            errors[ep.name] = f"{type(exc).__name__}: {exc}"
            print(f"kvreg: command plugin {ep.name!r} ({ep.value}) failed to load: {errors[ep.name]}",
                  file=sys.stderr)
    return errors


def _missing_command(name: str, error: str | None):
    """The handler of a :data:`PLUGIN_COMMANDS` subcommand that no installed plugin provides."""
    dist, folder, _ = PLUGIN_COMMANDS[name]

    def run(args) -> int:
        why = f"its plugin failed to load ({error})" if error else "it is not installed"
        print(f"kvreg {name}: this command lives in the {dist} distribution, and {why}.\n"
              f"  pip install {dist}\n"
              f"  (in kvreg's repository: pip install -e {folder})", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvreg", description="kvreg: KV cache library for LLM inference engines")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("info", help="version, backends, devices, native kernels, environment")
    sp.set_defaults(func=_cmd_info)

    wp = sub.add_parser("wire", help="wire-format tools")
    wsub = wp.add_subparsers(dest="wire_command", required=True)
    ip = wsub.add_parser("inspect", help="print the header and body summary of a blob, or what is wrong with it")
    ip.add_argument("file")
    ip.set_defaults(func=_cmd_wire_inspect)

    errors = _register_plugins(sub)
    for name, (dist, _, help_) in PLUGIN_COMMANDS.items():
        if name not in sub.choices:
            # No options of its own: any arguments (--help included) end in
            # the message of _missing_command (see main).
            mp = sub.add_parser(name, help=f"{help_} (needs {dist})", add_help=False)
            mp.set_defaults(func=_missing_command(name, errors.get(name)), _plugin_missing=True)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if extra and not getattr(args, "_plugin_missing", False):
        p.error(f"unrecognized arguments: {' '.join(extra)}")  # as parse_args would
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
