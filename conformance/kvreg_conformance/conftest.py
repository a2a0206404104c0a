"""pytest wiring of the conformance suite.

Options (added by :mod:`kvreg_conformance.plugin`, the ``pytest11`` entry
point of kvreg-conformance, so they exist before this conftest loads):
``--kvreg-backend NAME`` (default ``KVREG_BACKEND`` or ``reference``),
``--kvreg-device SPEC`` (default ``KVREG_DEVICE``, else the backend's own
default), ``--kvreg-profile quick|default|full`` (default ``KVREG_PROFILE``:
``quick`` runs the cases marked quick with few hypothesis examples, ``full``
every case with many). A backend that cannot start skips every case with the
reason instead of erroring.

Known gaps are data, read from two lists (both apply):

* ``KVREG_CONFORMANCE_XFAIL_DIR/<backend>.txt`` when that variable is set,
  else the suite's own ``kvreg_conformance/xfail/<backend>.txt`` (kvreg's backends);
* the list the backend class ships itself: its ``conformance_xfail``
  attribute, a package resource ``"package.module:relative/path.txt"``
  (read with :mod:`importlib.resources`), or None. A third-party backend
  cannot write into the suite's package, so it declares its list this way.

Each holds one case-id pattern per line (fnmatch against the node id, or
against the test name when the pattern has no ``::``), then ``#`` and the
reason. An entry that matches no collected case is reported as stale
(terminal summary and side file), naming its list.

``KVREG_CONFORMANCE_SIDE=path.json``: at the end of the session write the
outcome counts, the slowest case, the worst error per kernel against the
oracle and the stale xfail entries there (read by ``kvreg conformance``).
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .checks import WORST, Checker
from .plugin import profile

if TYPE_CHECKING:
    from kvreg.plugin import Backend

_HERE = Path(__file__).parent
_STATE: dict = {}


def _selected(config) -> tuple[str, str | None]:
    name = config.getoption("--kvreg-backend") or os.environ.get("KVREG_BACKEND", "").strip() or "reference"
    device = config.getoption("--kvreg-device") or os.environ.get("KVREG_DEVICE", "").strip() or None
    return name.lower(), device


#: Hypothesis examples per property, by profile (``--kvreg-profile``).
EXAMPLES = {"quick": 8, "default": 25, "full": 200}


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: part of the quick profile (--kvreg-profile quick)")
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "kvreg-conformance", deadline=None, derandomize=True, print_blob=True,
        max_examples=EXAMPLES[profile(config)],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.load_profile("kvreg-conformance")
    name, device = _selected(config)
    _STATE.update(name=name, device=device, outcomes={}, durations=[], backend=None, error=None)


def _start_backend():
    """The backend under test, or the reason it cannot start (cached)."""
    if _STATE["backend"] is None and _STATE["error"] is None:
        import kvreg
        from kvreg.errors import BackendError

        try:
            _STATE["backend"] = kvreg.get_backend(_STATE["name"], _STATE["device"])
        except BackendError as exc:
            _STATE["error"] = f"backend {_STATE['name']!r} cannot start: {exc}"
        except Exception as exc:  # a backend's own failure to start is a skip with its reason too
            _STATE["error"] = f"backend {_STATE['name']!r} cannot start: {type(exc).__name__}: {exc}"
    return _STATE["backend"], _STATE["error"]


def _backend_lines() -> list[str]:
    be, err = _start_backend()
    if be is None:
        return [f"kvreg backend: {_STATE['name']} (device {_STATE['device'] or 'default'}): UNAVAILABLE: {err}"]
    return [f"kvreg backend: {be.name}, device: {be.device}"] + [
        f"kvreg {line}" for line in type(be).capability_lines()]


def pytest_report_header(config):
    return _backend_lines()


# ── known gaps ──

def parse_xfail(text: str) -> list[tuple[str, str]]:
    """``(pattern, reason)`` per entry of an xfail list's text."""
    entries = []
    for line in text.splitlines():
        body, _, reason = line.partition("#")
        pattern = body.strip()
        if pattern:
            entries.append((pattern, reason.strip() or "known gap (no reason given)"))
    return entries


def read_xfail_file(path: Path) -> list[tuple[str, str]]:
    """``(pattern, reason)`` per entry of an xfail list file (none when absent)."""
    return parse_xfail(path.read_text()) if path.is_file() else []


def read_xfail_resource(spec: str) -> list[tuple[str, str]]:
    """``(pattern, reason)`` per entry of the list a backend class declares:
    ``"package.module:relative/path.txt"``, a resource of that package."""
    anchor, sep, rel = spec.partition(":")
    if not sep or not anchor or not rel:
        raise pytest.UsageError(f"conformance_xfail = {spec!r}: expected 'package.module:relative/path.txt'")
    try:
        res = importlib.resources.files(anchor).joinpath(*rel.split("/"))
        return parse_xfail(res.read_text(encoding="utf-8"))
    except (ImportError, OSError) as exc:
        raise pytest.UsageError(f"conformance_xfail = {spec!r} cannot be read: {type(exc).__name__}: {exc}") from None


def xfail_lists(name: str, cls: type[Backend] | None) -> list[tuple[str, list[tuple[str, str]]]]:
    """``(source, entries)`` of every xfail list that applies to backend ``name``
    (class ``cls``, None when not registered), in the order they are read."""
    folder = os.environ.get("KVREG_CONFORMANCE_XFAIL_DIR")
    path = (Path(folder) if folder else _HERE / "xfail") / f"{name}.txt"
    lists = [(str(path), read_xfail_file(path))]
    spec = cls.conformance_xfail if cls is not None else None
    if spec:
        lists.append((spec, read_xfail_resource(spec)))
        _STATE.setdefault("resources", set()).add(spec)
    return lists


def _backend_class(name: str) -> type[Backend] | None:
    be = _STATE.get("backend")
    if be is not None:
        return type(be)
    from kvreg import registry

    return registry.backends().get(name)


def _matches(pattern: str, item) -> bool:
    if "::" in pattern or "/" in pattern:
        return fnmatch.fnmatchcase(item.nodeid, pattern) or fnmatch.fnmatchcase(item.nodeid, f"*{pattern}")
    return fnmatch.fnmatchcase(item.name, pattern)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    entries = [(source, pattern, reason)
               for source, found in xfail_lists(_STATE["name"], _backend_class(_STATE["name"]))
               for pattern, reason in found]
    used = set()
    for item in items:
        hits = [e for e in entries if _matches(e[1], item)]
        if hits:   # the first entry that matches gives the reason; every one that matches is in use
            source, _, reason = hits[0]
            label = source if source in _STATE.get("resources", ()) else Path(source).name
            item.add_marker(pytest.mark.xfail(reason=f"{label}: {reason}", strict=False))
            used.update((s, p) for s, p, _ in hits)
    # tryfirst: -k / -m deselection has not run yet, so an entry is judged
    # stale against every collected case, not against this run's selection.
    _STATE["stale_entries"] = [(s, p, r) for s, p, r in entries if (s, p) not in used]
    _STATE["stale"] = [f"{s}: {p}  # {r}" for s, p, r in _STATE["stale_entries"]]
    if profile(config) == "quick":
        others = [item for item in items if item.get_closest_marker("quick") is None]
        if others:
            config.hook.pytest_deselected(items=others)
            items[:] = [item for item in items if item.get_closest_marker("quick") is not None]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    if config.get_verbosity() < 0:   # -q hides the header: say what was tested here
        for line in _backend_lines():
            tr.write_line(line)
    for source, pattern, reason in _STATE.get("stale_entries", []):
        tr.write_line(f"WARNING: stale xfail entry in {source} matches no case: {pattern}  # {reason}",
                      yellow=True)
    if WORST:
        tr.write_sep("-", "kvreg: worst error per tolerance entry (|err| / tolerance)")
        for kernel, w in sorted(WORST.items()):
            tr.write_line(f"  {kernel:26s} {w['ratio']:8.3f}  |err|={w['abs']:.3g}  {w['case']}")


# ── fixtures ──

@pytest.fixture(scope="session")
def backend():
    """The backend under test (skips every case, with the reason, when it cannot start)."""
    be, err = _start_backend()
    if be is None:
        pytest.skip(err)
    return be


@pytest.fixture(scope="session")
def ref():
    """The NumPy reference backend (the exact class is compared with it)."""
    import kvreg

    return kvreg.get_backend("reference")


def _shrinks(cls: type[Backend] | None) -> bool:
    from kvreg.plugin import Backend

    return cls is not None and cls.small_tunables is not Backend.small_tunables


def pytest_generate_tests(metafunc):
    # A case that asks for ``tunables`` runs at the backend's own tunables
    # and, where it offers them, at its small ones (multi-block paths).
    if "tunables" in metafunc.fixturenames and _shrinks(_backend_class(_STATE["name"])):
        metafunc.parametrize("tunables", ["default", "small"], indirect=True,
                             ids=["tunables-default", "tunables-small"])


@pytest.fixture
def tunables(request, backend):
    """The case runs at the backend's tunables, or (``small``) inside
    :meth:`~kvreg.plugin.Backend.small_tunables`."""
    if getattr(request, "param", "default") == "small":
        with backend.small_tunables():
            yield "small"
    else:
        yield "default"


@pytest.fixture
def check(backend, request):
    """Comparisons that name the kernel, backend and device (conformance.checks)."""
    return Checker(backend.name, str(backend.device), request.node.nodeid)


# ── the side file for `kvreg conformance` ──

def pytest_runtest_logreport(report):
    outcomes = _STATE.setdefault("outcomes", {})
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        if hasattr(report, "wasxfail"):
            kind = "xfailed" if report.outcome == "skipped" else "xpassed"
        else:
            kind = report.outcome
        outcomes[kind] = outcomes.get(kind, 0) + 1
        if report.when == "call":
            _STATE.setdefault("durations", []).append((report.duration, report.nodeid))
    elif report.when == "teardown" and report.outcome == "failed":
        outcomes["error"] = outcomes.get("error", 0) + 1


def pytest_sessionfinish(session, exitstatus):
    side = os.environ.get("KVREG_CONFORMANCE_SIDE")
    if not side:
        return
    be = _STATE.get("backend")
    durations = sorted(_STATE.get("durations", []), reverse=True)
    data = {
        "backend": _STATE.get("name"),
        "device": str(be.device) if be is not None else _STATE.get("device"),
        "unavailable": _STATE.get("error"),
        "exitstatus": int(exitstatus),
        "outcomes": _STATE.get("outcomes", {}),
        "slowest": [{"seconds": round(d, 3), "case": n} for d, n in durations[:5]],
        "worst_error": WORST,
        "stale_xfail": _STATE.get("stale", []),
    }
    Path(side).write_text(json.dumps(data, indent=1, sort_keys=True))
