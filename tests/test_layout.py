"""The shape of the code the architecture promises (docs/architecture.md):
modules of a readable size, no import cycle, a layer composed of parts, and
no distribution reaching into the core's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvreg
from kvreg.storage import DenseStorage, Int8Storage, KiviStorage, Storage, TieredStorage, make_storage

ROOT = Path(__file__).resolve().parents[1]
#: The shipped packages, each the folder of its import package.
PACKAGES = [ROOT / "kvreg", ROOT / "backends" / "numba" / "kvreg_numba", ROOT / "backends" / "opencl" / "kvreg_opencl"]
#: A module past this many lines wants splitting by concept.
MAX_LINES = 800


def _modules():
    for pkg in PACKAGES:
        for path in sorted(pkg.rglob("*.py")):
            if "__pycache__" not in path.parts and "tests" not in path.parts:
                yield pkg, path


def _name(pkg: Path, path: Path) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(pkg: Path, path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` of every import outside ``if TYPE_CHECKING:`` blocks."""
    mod, out = _name(pkg, path), []
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for n in node.orelse:
                    self.visit(n)
                return
            self.generic_visit(node)

        def visit_Import(self, node):
            out.extend((a.name, ()) for a in node.names)

        def visit_ImportFrom(self, node):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            out.append((base, tuple(a.name for a in node.names)))

    Visitor().visit(ast.parse(path.read_text()))
    return out


@pytest.mark.parametrize("path", [p for _, p in _modules()], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_past_the_line_limit(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_no_import_cycle_between_modules():
    mods = {_name(pkg, path): (pkg, path) for pkg, path in _modules()}
    graph = {}
    for name, (pkg, path) in mods.items():
        deps = set()
        for base, names in _imports(pkg, path):
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in mods]
            for target in subs + ([base] if len(subs) < len(names) or not names else []):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    # a depth-first search that reports the first cycle it closes
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return trail[trail.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, trail + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            assert cycle is None, " -> ".join(cycle)


def test_no_backend_imports_a_private_name_of_the_core():
    for pkg, path in _modules():
        if pkg.name == "kvreg":
            continue
        for base, names in _imports(pkg, path):
            if base.split(".")[0] != "kvreg":
                continue
            private = [p for p in base.split(".") + list(names) if p.startswith("_") and p != "__future__"]
            assert not private, f"{path.relative_to(ROOT)} imports {base} {names}"


#: The facade's own lines: what it does beyond naming its parts' methods.
MAX_LAYER_CLASS_LINES = 500


def test_the_layer_is_composed_not_inherited():
    assert kvreg.LayerKvCache.__bases__ == (object,)
    tree = ast.parse((ROOT / "kvreg" / "layer.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LayerKvCache")
    lines = cls.end_lineno - cls.lineno + 1
    assert lines <= MAX_LAYER_CLASS_LINES, f"LayerKvCache is {lines} lines"
    lay = kvreg.LayerKvCache(2, 8, "q8", "reference")
    assert isinstance(lay.storage, Storage) and lay.seal is not None and lay.wire is not None and lay.ring is None
    lay.install_bounded(4)
    assert lay.ring is not None and lay.bounded is lay.ring.state


@pytest.mark.parametrize("mode,family", [(m, KiviStorage if m is kvreg.KvMode.Q2 else TieredStorage if m.tiered
                                          else Int8Storage if m.quantized else DenseStorage) for m in kvreg.KvMode],
                         ids=lambda x: str(x))
def test_each_mode_is_stored_by_its_family(mode, family):
    st = make_storage(2, 8, mode, 1)
    assert type(st) is family and st.mode is mode
