"""``kvreg conformance``: run the conformance suite per backend and device.

:func:`register` is the ``kvreg.commands`` entry point that adds the
subcommand to the ``kvreg`` command (:mod:`kvreg.cli`); ``run(args)`` takes
the namespace it parses (``backend``, ``device``, ``report``, ``junit``,
``keyword``, ``profile``). Each selected
(backend, device) pair runs ``python -m pytest <suite> --kvreg-backend B
--kvreg-device D`` in its own subprocess (a backend's device context, a
crash or a leak stays in its process), with pytest's progress shown live
under a ``[i/n] backend on device`` banner. The suite's conftest writes a
side file (``KVREG_CONFORMANCE_SIDE``) with outcome counts, the slowest
cases, the worst error per tolerance entry and stale xfail
entries; the command prints them as a table, optionally writes them as JSON
(``--report``) and merges the per-run JUnit files into one (``--junit``).

Exit status: 0 when every run passed (xfails allowed), 1 when any case
failed or errored or a backend did not start on a device its ``devices()``
listed, 2 when nothing could run (no suite, unknown backend). A backend that
cannot start where no device was claimed (an explicit ``--device``, or
``devices()`` itself failing) skips with its reason.

``--backend all`` (the default) runs every registered backend on every
device its ``devices()`` lists. ``--profile`` (default ``KVREG_PROFILE``)
says how thorough: ``quick`` (``--quick``) the cases marked quick with few
hypothesis examples, ``full`` every case with many. The suite is this
package, or the folder ``KVREG_CONFORMANCE_DIR``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def suite_dir() -> Path | None:
    """Where the conformance suite lives, or None if it cannot be found."""
    env = os.environ.get("KVREG_CONFORMANCE_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parent)
    for c in candidates:
        if (c / "conftest.py").is_file():
            return c
    return None


def targets(backend: str | None, device: str | None) -> tuple[list[tuple[str, str | None]], list[str]]:
    """``[(backend, device)]`` to run, and lines to warn about."""
    from kvreg import registry
    from kvreg.errors import BackendError

    found = registry.backends()
    warnings = [f"backend plugin {n!r} failed to load: {e}" for n, e in registry.load_errors().items()]
    if backend and backend.lower() != "all":
        if backend.lower() not in found:
            raise BackendError(f"unknown kvreg backend {backend!r}; registered: {', '.join(sorted(found))}")
        return [(backend.lower(), device)], warnings
    out = []
    for name in sorted(found, key=lambda n: (n != "reference", n)):
        if device is not None:
            out.append((name, device))
            continue
        try:
            devs = found[name].devices() or [None]
        except BackendError as exc:
            warnings.append(f"{name}: no devices ({exc}); its run will report why it cannot start")
            devs = [None]
        out.extend((name, d) for d in devs)
    return out, warnings


def chosen_profile(args) -> str:
    """The profile of a run: ``--quick``, else ``--profile``, else ``KVREG_PROFILE``, else ``default``."""
    if getattr(args, "quick", False):
        return "quick"
    chosen = getattr(args, "profile", None) or os.environ.get("KVREG_PROFILE", "").strip() or "default"
    if chosen not in ("quick", "default", "full"):
        raise ValueError(f"KVREG_PROFILE={chosen!r}: expected quick, default or full")
    return chosen


def _pytest_cmd(suite: Path, name: str, device: str | None, args, junit: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", str(suite), "--kvreg-backend", name, "-p", "no:cacheprovider",
           "-q", "-rfE", "--tb=short", f"--rootdir={suite.parent}"]
    if device is not None:
        cmd += ["--kvreg-device", device]
    if getattr(args, "keyword", None):
        cmd += ["-k", args.keyword]
    cmd += ["--kvreg-profile", chosen_profile(args)]
    if junit:
        cmd += [f"--junitxml={junit}"]
    return cmd


def run_one(suite: Path, name: str, device: str | None, args, tmp: Path, idx: int) -> dict:
    """One subprocess run of the suite; returns its side-file record."""
    side = tmp / f"side-{idx}.json"
    junit = str(tmp / f"junit-{idx}.xml") if getattr(args, "junit", None) else None
    env = dict(os.environ)
    env["KVREG_CONFORMANCE_SIDE"] = str(side)
    root = str(suite.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    proc = subprocess.run(_pytest_cmd(suite, name, device, args, junit), env=env, cwd=root)
    rec = {"backend": name, "device": device, "outcomes": {}, "worst_error": {}, "slowest": [],
           "stale_xfail": [], "unavailable": None}
    if side.is_file():
        rec.update(json.loads(side.read_text()))
    rec["returncode"] = proc.returncode
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    rec["junit"] = junit
    return rec


def _failed(rec: dict) -> bool:
    o = rec.get("outcomes", {})
    if rec.get("unavailable") and rec.get("claimed"):
        return True   # devices() listed this device, so the backend must start on it
    # pytest exit 5 = nothing collected (e.g. -k matched nothing): not a failure.
    return bool(o.get("failed") or o.get("error")) or rec["returncode"] not in (0, 5)


def table(records: list[dict]) -> str:
    """The summary table, one block per run."""
    lines = [f"{'backend':12s} {'device':28s} {'pass':>5s} {'fail':>5s} {'xfail':>5s} {'skip':>5s} {'time':>7s}"]
    for r in records:
        o = r.get("outcomes", {})
        fail = o.get("failed", 0) + o.get("error", 0)
        lines.append(f"{r['backend']:12s} {str(r.get('device') or 'default')[:28]:28s} {o.get('passed', 0):5d} "
                     f"{fail:5d} {o.get('xfailed', 0):5d} {o.get('skipped', 0):5d} {r['seconds']:6.1f}s")
        if r.get("unavailable"):
            lines.append(f"    unavailable: {r['unavailable']}")
        if r.get("slowest"):
            s = r["slowest"][0]
            lines.append(f"    slowest case: {s['seconds']:.2f}s {s['case']}")
        worst = r.get("worst_error") or {}
        if worst:
            lines.append("    worst error per tolerance entry (|err| / tolerance, |err|):")
            for k, w in sorted(worst.items()):
                lines.append(f"      {k:26s} {w['ratio']:7.3f}  {w['abs']:.3g}")
        for s in r.get("stale_xfail", []):
            lines.append(f"    WARNING stale xfail entry: {s}")
        if r["returncode"] not in (0, 5) and not fail:
            lines.append(f"    pytest exited with status {r['returncode']}")
    return "\n".join(lines)


def merge_junit(records: list[dict], dest: str) -> None:
    """One JUnit file: every run's test suites, renamed ``backend@device``."""
    root = ET.Element("testsuites")
    for r in records:
        path = r.get("junit")
        if not path or not Path(path).is_file():
            continue
        tree = ET.parse(path).getroot()
        suites = [tree] if tree.tag == "testsuite" else list(tree)
        for s in suites:
            s.set("name", f"kvreg-conformance[{r['backend']}@{r.get('device') or 'default'}]")
            root.append(s)
    ET.ElementTree(root).write(dest, encoding="utf-8", xml_declaration=True)


def run(args) -> int:
    """Entry point of ``kvreg conformance``; returns the exit status."""
    suite = suite_dir()
    if suite is None:
        print("kvreg conformance: the suite was not found: neither KVREG_CONFORMANCE_DIR nor the installed "
              "kvreg_conformance package holds its conftest.py (reinstall kvreg-conformance)", file=sys.stderr)
        return 2
    from kvreg.errors import BackendError

    try:
        chosen_profile(args)
    except ValueError as exc:
        print(f"kvreg conformance: {exc}", file=sys.stderr)
        return 2
    try:
        pairs, warnings = targets(getattr(args, "backend", None), getattr(args, "device", None))
    except BackendError as exc:
        print(f"kvreg conformance: {exc}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"kvreg conformance: warning: {w}", file=sys.stderr)
    claimed = set(pairs) if (getattr(args, "backend", None) or "all").lower() == "all" and \
        getattr(args, "device", None) is None else set()
    claimed = {p for p in claimed if p[1] is not None}
    if not pairs:
        print("kvreg conformance: no backend registered", file=sys.stderr)
        return 2
    records = []
    with tempfile.TemporaryDirectory(prefix="kvreg-conformance-") as tmpd:
        tmp = Path(tmpd)
        for i, (name, device) in enumerate(pairs):
            banner = f"[{i + 1}/{len(pairs)}] {name} on {device or 'its default device'}"
            print(f"\n=== {banner} ({chosen_profile(args)} profile)", flush=True)
            rec = run_one(suite, name, device, args, tmp, i)
            rec["claimed"] = (name, device) in claimed
            records.append(rec)
        if getattr(args, "junit", None):
            merge_junit(records, args.junit)
    print("\nkvreg conformance summary")
    print(table(records))
    if getattr(args, "report", None):
        clean = [{k: v for k, v in r.items() if k != "junit"} for r in records]
        Path(args.report).write_text(json.dumps({"runs": clean, "profile": chosen_profile(args),
                                                 "keyword": getattr(args, "keyword", None)}, indent=1))
    failed = [r for r in records if _failed(r)]
    if failed:
        print(f"\nFAILED: {', '.join(r['backend'] + '@' + str(r.get('device') or 'default') for r in failed)}")
        return 1
    return 0


def register(sub) -> None:
    """Add ``kvreg conformance`` to the ``kvreg`` command's subparsers ``sub``."""
    cp = sub.add_parser("conformance", help="run the conformance suite per backend and device")
    cp.add_argument("--backend", default=None, help="backend name or 'all' (default: all installed)")
    cp.add_argument("--device", default=None, help="device spec (backend-specific)")
    cp.add_argument("--report", default=None, metavar="FILE.json")
    cp.add_argument("--junit", default=None, metavar="FILE.xml")
    cp.add_argument("-k", dest="keyword", default=None, metavar="EXPR")
    cp.add_argument("--profile", choices=("quick", "default", "full"), default=None,
                    help="how thorough: quick (the quick cases, few examples), default, full (many examples); "
                         "default: KVREG_PROFILE or 'default'")
    cp.add_argument("--quick", action="store_true", help="the same as --profile quick")
    cp.set_defaults(func=run)
