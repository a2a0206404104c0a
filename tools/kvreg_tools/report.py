"""Benchmark records, and ``kvreg report``: the page generated from them.

A record is one JSON file, one run on one machine:

- kind ``"eval"`` (``kvreg eval --json``, and peers' runs measured the same
  way): ``system``, ``command``, ``machine`` (``cpu``, ``cores``,
  ``platform``, ``python``), ``date``, ``model``, ``text``,
  ``text_sha256``, ``tokens``, ``prefix``, ``scored``, ``reference``
  (``peak_bytes``, ``avg_bytes`` of the full-precision cache) and
  ``results``: per configuration ``config``, ``ppl``, ``kl_mean``,
  ``kl_p99``, ``top1``, ``peak_bytes``, ``avg_bytes``, ``ms_per_token``;
- kind ``"bench"`` (``kvreg bench --json``): what the benchmark writes, with
  ``system``, ``command``, ``date`` and the ``machine`` fields above added.

kvreg's own records are ``kvreg/results/*.json`` (package data: ``kvreg
info`` reads them installed), peers' are ``docs/results/peers/*.json``.
:func:`render` makes ``docs/benchmarks.md`` of them, the same bytes for the
same files (sorted; no timestamp of its own): the date a figure was measured
is the record's. ``kvreg report --check`` says whether the committed page is
what the records give.

This module also holds what a run records about itself (:func:`header`) and
:class:`Load`, which tells whether other processes shared the machine while
a run was timed.
"""

from __future__ import annotations

import datetime
import difflib
import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

from kvreg.errors import ConfigError

__all__ = ["Load", "header", "load_records", "machine", "main", "render"]

#: Where the records live and where the page goes, from the repository root.
KVREG_RESULTS = Path("kvreg/results")
PEER_RESULTS = Path("docs/results/peers")
PAGE = Path("docs/benchmarks.md")

#: Environment variables that change what a run measures; a record's command names those set.
COMMAND_ENV = ("KVREG_BACKEND", "KVREG_DEVICE", "KVREG_KV", "KVREG_THREADS", "NUMBA_NUM_THREADS",
               "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")

_EVAL_KEYS = ("system", "command", "machine", "date", "model", "text", "text_sha256", "tokens", "prefix", "scored",
              "reference", "results")
_RESULT_KEYS = ("config", "ppl", "kl_mean", "kl_p99", "top1", "peak_bytes", "avg_bytes")
_MACHINE_KEYS = ("cpu", "cores", "platform", "python")


# ---------------------------------------------------------------------------
# What a run records about itself


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> dict:
    """The machine a run is measured on: CPU model, cores, OS and Python."""
    return {"cpu": _cpu_name(), "cores": os.cpu_count() or 1, "platform": platform.platform(),
            "python": platform.python_version()}


def command(words: list[str]) -> str:
    """The shell command a record was made by: the environment variables of
    :data:`COMMAND_ENV` that are set, then ``words``, quoted."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in COMMAND_ENV if os.environ.get(k)]
    return " ".join(env + [shlex.join(words)])


def header(kind: str, words: list[str]) -> dict:
    """The fields every record starts with: kind, system, command, machine, date."""
    return {"kind": kind, "system": "kvreg", "command": command(words), "machine": machine(),
            "date": datetime.date.today().isoformat()}


def _busy_seconds() -> float | None:
    """CPU seconds every CPU of the machine spent busy (steal included), or None off Linux."""
    try:
        with open("/proc/stat", encoding="utf-8") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    ticks = [int(x) for x in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


class Load:
    """How much of the machine other processes took while this one ran.

    Started at construction; :meth:`others` is the number of cores other
    processes (and the hypervisor's steal) kept busy on average since then:
    the machine's busy CPU time less this process's, over the wall time."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self._wall = time.perf_counter()
        self._own = time.process_time()
        self._busy = _busy_seconds()

    def others(self) -> float | None:
        busy = _busy_seconds()
        wall = time.perf_counter() - self._wall
        if busy is None or self._busy is None or wall <= 0:
            return None
        own = time.process_time() - self._own
        return max(0.0, (busy - self._busy - own) / wall)

    def warning(self) -> str | None:
        """A line saying the timings are unreliable when other processes took
        more than a quarter of the cores (at least half a core), else None."""
        others = self.others()
        if others is None or others <= max(0.5, self.cores / 4):
            return None
        return (f"timings are unreliable: the machine was busy (other processes kept {others:.1f} of its "
                f"{self.cores} cores busy on average during the run); the timings are kept as measured")


# ---------------------------------------------------------------------------
# Reading records


def _check_record(rec, where: str) -> None:
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: expected a JSON object (one run), got {type(rec).__name__}")
    kind = rec.get("kind")
    if kind not in ("eval", "bench"):
        raise ConfigError(f"{where}: \"kind\" must be \"eval\" or \"bench\", got {kind!r}")
    need = _EVAL_KEYS if kind == "eval" else ("system", "command", "machine", "date")
    missing = [k for k in need if k not in rec]
    missing += [f"machine.{k}" for k in _MACHINE_KEYS if k not in (rec.get("machine") or {})]
    if kind == "eval":
        for k in ("peak_bytes", "avg_bytes"):
            if k not in (rec.get("reference") or {}):
                missing.append(f"reference.{k}")
        for i, r in enumerate(rec.get("results") or []):
            missing += [f"results[{i}].{k}" for k in _RESULT_KEYS if k not in r]
        if not rec.get("results"):
            missing.append("results (at least one configuration)")
    if missing:
        raise ConfigError(f"{where}: a {kind} record lacks {', '.join(missing)}")
    try:
        datetime.date.fromisoformat(rec["date"])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: \"date\" must be YYYY-MM-DD, got {rec['date']!r}") from None


def load_records(root: Path) -> list[tuple[str, dict]]:
    """``(path relative to root, record)`` of every record under ``root``'s
    :data:`KVREG_RESULTS` and :data:`PEER_RESULTS`, sorted by path. A file may
    hold one record or a list of them (``kvreg eval --model all``)."""
    found = []
    for folder in (KVREG_RESULTS, PEER_RESULTS):
        for path in sorted((root / folder).glob("*.json")):
            rel = path.relative_to(root).as_posix()
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{rel}: not readable JSON: {exc}") from None
            items = data if isinstance(data, list) else [data]
            for i, rec in enumerate(items):
                where = rel if len(items) == 1 else f"{rel}[{i}]"
                _check_record(rec, where)
                found.append((where, rec))
    return found


# ---------------------------------------------------------------------------
# The page


def _num(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _mib(x) -> str:
    return "—" if x is None else f"{x / 2**20:.2f}"


def _machine_words(m: dict) -> str:
    return f"{m['cpu']}, {m['cores']} cores, {m['platform']}, Python {m['python']}"


def _run_line(where: str, rec: dict) -> str:
    return (f"- **{rec['system']}** (`{where}`): measured {rec['date']} on {_machine_words(rec['machine'])}.  \n"
            f"  `{rec['command']}`")


_EVAL_HEAD = ["| system | cache | mean KL | p99 KL | top-1 | PPL | peak MiB | avg MiB | peak / full |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]


def _eval_rows(rec: dict) -> list[str]:
    ref = rec["reference"]
    full = ref["peak_bytes"]
    name = f"{ref.get('config', 'full precision')} (reference)"
    rows = [f"| {rec['system']} | {name} | 0 | 0 | 100.0% | {_num(ref.get('ppl'), '.4f')} | "
            f"{_mib(full)} | {_mib(ref['avg_bytes'])} | 1.000 |"]
    for r in rec["results"]:
        frac = None if r["peak_bytes"] is None or not full else r["peak_bytes"] / full
        top1 = None if r["top1"] is None else 100 * r["top1"]
        rows.append(f"| {rec['system']} | {r['config']} | {_num(r['kl_mean'], '.2e')} | {_num(r['kl_p99'], '.2e')} | "
                    f"{_num(top1, '.1f')}{'' if top1 is None else '%'} | {_num(r['ppl'], '.4f')} | "
                    f"{_mib(r['peak_bytes'])} | {_mib(r['avg_bytes'])} | {_num(frac, '.3f')} |")
    return rows


_KEEP = re.compile(r"\bkeep ([0-9.]+)$")


def _best(rows: list[tuple[str, dict]]) -> str:
    """``config (system): KL, avg MiB`` of the least mean KL among ``rows``, or a dash."""
    rows = [(system, r) for system, r in rows if r["kl_mean"] is not None]
    if not rows:
        return "— | —"
    system, r = min(rows, key=lambda sr: sr[1]["kl_mean"])
    return f"{r['config']} ({system}, avg {_mib(r['avg_bytes'])}) | {r['kl_mean']:.2e}"


def _budget_rows(runs: list[tuple[str, dict]]) -> list[str]:
    """kvreg's pick per budget (``kvreg eval --budget``) beside the peers of the
    same run: the best whose average bytes fit the budget, and (more generous
    to kvpress, whose presses grow a row per decode step) the best press
    keeping at most that fraction of the prefix, whatever its bytes."""
    picks = [b for _, rec in runs if rec["system"] == "kvreg" for b in rec.get("budgets") or []]
    if not picks:
        return []
    peers = [rec for _, rec in runs if rec["system"] != "kvreg"]
    out = ["At a memory budget (a fraction of the full-precision cache's peak bytes; kvreg's pick by its "
           "measured **peak**, the peers by their **average**):", "",
           "| budget | kvreg's pick (peak MiB) | mean KL | best peer whose avg fits | mean KL "
           "| best press keeping ≤ the budget's fraction | mean KL |",
           "|---:|---|---:|---|---:|---|---:|"]
    for b in sorted(picks, key=lambda b: b["fraction"]):
        fits = [(p["system"], r) for p in peers for r in p["results"]
                if r["avg_bytes"] is not None and r["avg_bytes"] <= b["fraction"] * p["reference"]["peak_bytes"]]
        keeps = [(p["system"], r) for p in peers for r in p["results"]
                 if (m := _KEEP.search(r["config"])) and float(m.group(1)) <= b["fraction"]]
        pick = "none fits" if b["config"] is None else f"{b['config']} ({_mib(b['peak_bytes'])})"
        kl = _num(b.get("kl_mean"), ".2e")
        out.append(f"| {100 * b['fraction']:g}% | {pick} | {kl} | {_best(fits)} | {_best(keeps)} |")
    return out + [""]


def _eval_sections(records: list[tuple[str, dict]]) -> list[str]:
    groups: dict[tuple, list[tuple[str, dict]]] = {}
    for where, rec in records:
        key = (rec["model"], rec["text"], rec["text_sha256"], rec["tokens"], rec["prefix"])
        groups.setdefault(key, []).append((where, rec))
    out = []
    for (model, text, sha, tokens, prefix), runs in sorted(groups.items()):
        runs.sort(key=lambda wr: (wr[1]["system"] != "kvreg", wr[1]["system"], wr[0]))
        scored = runs[0][1]["scored"]
        out += [f"### {model} · {text} · {tokens} tokens, prefix {prefix} ({scored} scored)", "",
                f"Text: `{text}`, SHA-256 `{sha}`.", ""]
        out += _EVAL_HEAD
        for _, rec in runs:
            out += _eval_rows(rec)
        out += [""] + _budget_rows(runs)
        out += ["Runs:", ""] + [_run_line(where, rec) for where, rec in runs] + [""]
    return out


def _bench_text(rec: dict) -> tuple[str, str]:
    """(title, the benchmark's own report) of a bench record."""
    if "model" in rec:
        from kvreg_tools.model_bench import format_report

        return f"{rec['model']} in the model, context {rec['context']}", format_report(rec)
    if "sizes" in rec:
        from kvreg_tools.bench import format_report

        return f"kernels ({rec.get('what', 'all')})", format_report(rec)
    raise ConfigError("a bench record must be what `kvreg bench --json` or `kvreg bench --model ... --json` writes")


def _bench_sections(records: list[tuple[str, dict]]) -> list[str]:
    out = []
    made = []
    for where, rec in records:
        try:
            title, body = _bench_text(rec)
        except (ConfigError, KeyError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        made.append((title, where, rec, body))
    for title, where, rec, body in sorted(made, key=lambda t: (t[0], t[1])):
        out += [f"### {title}", "", _run_line(where, rec), "", "```text", body.rstrip(), "```", ""]
    return out


INTRO = """\
# Benchmarks

<!-- Generated by `kvreg report` from kvreg/results/*.json and
docs/results/peers/*.json. Do not edit: add or rerun a record, then run
`kvreg report`. -->

Every figure here comes from a JSON record of one run on one machine; each
table names the machine, the date it was measured and the command that
measured it, so you can rerun it on yours. Timings depend on the machine and
on what else it runs; accuracy and memory figures do not.

**Accuracy and memory** (`kvreg eval --json`). A text is tokenized; the
first *prefix* tokens are prefilled in one call, then every following token
is decoded one at a time through the cache, the true token fed (teacher
forcing). Each configuration runs beside the system's full-precision cache
(kvreg's: float32 rows, which answer as transformers' `DynamicCache`):

- **mean KL / p99 KL**: KL(reference ‖ configuration) of the next-token
  distributions in nats, mean and 99th percentile over the scored positions;
- **top-1**: the fraction of positions whose most likely next token is the
  reference's;
- **PPL**: perplexity of the scored tokens under that cache;
- **peak MiB / avg MiB**: the cache's bytes after the prefill and after
  every decode step, largest and mean;
- **peak / full**: the peak over the full-precision cache's peak in the
  same run.

What the configuration names mean: `kvreg eval --help` and the legend
`kvreg eval` prints under its table."""


def render(records: list[tuple[str, dict]]) -> str:
    """The page of ``records`` (``(path, record)`` pairs, :func:`load_records`)."""
    evals = [(w, r) for w, r in records if r["kind"] == "eval"]
    benches = [(w, r) for w, r in records if r["kind"] == "bench"]
    out = [INTRO, ""]
    if evals:
        out += ["## Accuracy and memory", ""] + _eval_sections(evals)
    if benches:
        out += ["## Speed (`kvreg bench --json`)", ""] + _bench_sections(benches)
    if not records:
        out += ["No records yet: run `kvreg eval --json kvreg/results/NAME.json`, then `kvreg report`.", ""]
    return "\n".join(out).rstrip() + "\n"


def difference(old: str, new: str, limit: int = 40) -> str:
    """A unified diff of ``old`` (committed) against ``new`` (generated), at most ``limit`` lines."""
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), "committed", "generated", lineterm="", n=1))
    more = len(lines) - limit
    return "\n".join(lines[:limit] + ([f"... {more} more lines"] if more > 0 else []))


def main(args) -> int:
    """``kvreg report [--root DIR] [--check]``."""
    root = Path(args.root)
    page = root / PAGE
    if not (root / KVREG_RESULTS).is_dir():
        print(f"kvreg report: no {KVREG_RESULTS} under {root.resolve()}; run it at the root of kvreg's repository "
              "or give --root", file=sys.stderr)
        return 2
    try:
        text = render(load_records(root))
    except ConfigError as exc:
        print(f"kvreg report: {exc}", file=sys.stderr)
        return 2
    if args.check:
        old = page.read_text(encoding="utf-8") if page.exists() else ""
        if old == text:
            print(f"{PAGE} is up to date with its {KVREG_RESULTS}/ and {PEER_RESULTS}/ records")
            return 0
        why = "does not exist" if not page.exists() else "differs from what its records give"
        print(f"kvreg report --check: {PAGE} {why}; run `kvreg report` to regenerate it.\n"
              f"{difference(old, text)}", file=sys.stderr)
        return 1
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0
