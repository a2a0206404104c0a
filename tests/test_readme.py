"""The README's usage snippet runs as written, its figures are the generated
report's, and the README and docs link only to what exists and speak of the
product, not of how it was built."""

import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
#: The generated report: the one page that carries dates (of measurement) and hashes (of texts).
REPORT = ROOT / "docs" / "benchmarks.md"
PAGES = [README, ROOT / "CONTRIBUTING.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p != REPORT)


def test_readme_snippet_runs():
    text = README.read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "kvreg.KvCache(" in c)
    rng = np.random.default_rng(0)
    n = 8
    env = {
        "k_chunk": rng.standard_normal((n, 8, 128), dtype=np.float32),
        "v_chunk": rng.standard_normal((n, 8, 128), dtype=np.float32),
        "q_chunk": rng.standard_normal((n, 32, 128), dtype=np.float32),
        "n": n,
        "k": rng.standard_normal((8, 128), dtype=np.float32),
        "v": rng.standard_normal((8, 128), dtype=np.float32),
        "q": rng.standard_normal((32, 128), dtype=np.float32),
    }
    exec(compile(code, "README.md", "exec"), env)
    assert env["out"].shape == (32, 128)
    assert env["blob"][:4] == b"KVRC"


def test_readme_is_a_short_page_that_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    first_block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "run"], ["make", "test"]]


def test_readme_figures_are_the_reports():
    """Every figure in the README's results is printed in docs/benchmarks.md."""
    results = README.read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    figures = re.findall(r"\d+\.\d+e[-+]\d+|\d+\.\d+%|\d+\.\d+", results)
    assert figures, "the README's results name no figure"
    report = REPORT.read_text()
    missing = [f for f in figures if f not in report]
    assert not missing, f"figures in the README that docs/benchmarks.md does not print: {missing}"
    assert "(docs/benchmarks.md)" in results


@pytest.mark.parametrize("page", PAGES + [REPORT], ids=lambda p: p.name)
def test_links_between_pages_resolve(page):
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.name} links to files that do not exist: {broken}"


#: How development history shows in prose: commit hashes, development sessions,
#: issue numbers and calendar dates.
HISTORY = [
    # a word of 7-12 hex digits with a letter and a digit; not a float's digits, not a CRC shown by inspect
    (r"(?<![.\w])(?<!CRC-32 )(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b", "a commit hash"),
    (r"\bsessions?\b", "a development session"),
    (r"\bissues? #?\d+|(?<![\w&])#\d+\b", "an issue number"),
    (r"\b20\d\d-\d\d-\d\d\b|\b\d\d-\d\d, (morning|night|late)", "a date"),
]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_speak_of_the_product_not_its_history(page):
    text = page.read_text()
    found = [(why, m.group(0)) for pattern, why in HISTORY for m in re.finditer(pattern, text, re.I)]
    assert not found, f"{page.name}: {found}"


def test_the_measurement_diary_is_gone():
    assert not (ROOT / "docs" / "figures.md").exists()
    assert not any("figures.md" in p.read_text() for p in PAGES)
