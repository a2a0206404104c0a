"""The conformance suite fails each deliberately broken backend, and the
failure names the broken kernel (broken_backends.py beside this file).

Every run is in this process (pytester): the suite collected once per run
on one broken backend, restricted with -k to the cases that exercise the
bug (the whole suite would catch it too, only slower).
"""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SUITE = HERE.parent / "kvreg_conformance"

pytest_plugins = ["pytester"]


@pytest.fixture
def run_suite(pytester, monkeypatch):
    """``run(backend, keyword) -> (exit code, output)``: the installed suite in
    this process, on ``backend`` with the broken backends registered."""
    from hypothesis import settings

    monkeypatch.syspath_prepend(str(HERE))
    for name in ("KVREG_CONFORMANCE_SIDE", "KVREG_CONFORMANCE_XFAIL_DIR", "KVREG_BACKEND", "KVREG_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    outer = settings.default   # the suite loads its own hypothesis profile

    def run(backend, keyword):
        res = pytester.runpytest_inprocess(
            str(SUITE), "-p", "broken_backends", "-p", "no:cacheprovider", f"--rootdir={SUITE.parent}",
            f"--confcutdir={SUITE.parent}", "--kvreg-backend", backend, "--kvreg-profile", "default",
            "-k", keyword, "-q", "--tb=line")
        return res.ret, res.stdout.str() + res.stderr.str()

    yield run
    settings.register_profile("kvreg-outer", outer)
    settings.load_profile("kvreg-outer")


@pytest.mark.parametrize("backend,keyword,kernel", [
    ("broken_round", "quantize_rows_rounds_ties", "quantize_rows"),
    ("broken_imp", "attend_group_matches_the_oracle and plain", "importance"),
    ("broken_window", "attend_layer_equals_attend_group", "attend_layer"),
    ("broken_gather", "evict_born_gathers", "gather_rows"),
    ("broken_mirror", "truncate_then_append", "attend_group"),
    ("broken_exact", "attend_group_matches_the_oracle and plain and q8", "attend_group"),
    ("broken_narrow", "upto_past_255_rows", "attend_group"),
    ("broken_ragged", "attention_on_ragged_heads", "attend_layer"),
    ("broken_ring", "import_at_the_same_position", "bounded_attend"),
    ("broken_nan", "nan_in_a_key_row", "attend_layer"),
    ("broken_rotate", "rotate_rows", "rotate_rows"),
])
def test_suite_fails_the_broken_backend_naming_the_kernel(run_suite, backend, keyword, kernel):
    rc, out = run_suite(backend, keyword)
    assert rc == 1, f"the suite must fail {backend} (exit {rc}):\n{out[-3000:]}"
    assert f"kernel {kernel}" in out and f"backend {backend!r}" in out, out[-3000:]


def test_the_same_selections_pass_on_the_reference(run_suite):
    # Guards the cases above: they fail because of the bug, not the selection.
    rc, out = run_suite("reference", "quantize_rows_rounds_ties or attend_group_matches_the_oracle and plain "
                                     "or attend_layer_equals_attend_group or evict_born_gathers "
                                     "or truncate_then_append or nan_in_a_key_row or rotate_rows "
                                     "or upto_past_255_rows or attention_on_ragged_heads "
                                     "or import_at_the_same_position")
    assert rc == 0, out[-3000:]


def test_xfail_list_marks_known_gaps_and_reports_stale_entries(run_suite, tmp_path, monkeypatch):
    (tmp_path / "broken_round.txt").write_text(
        "test_quantize_rows_rounds_ties_away_from_zero*  # known: rounds half to even\n"
        "test_no_such_case  # stale on purpose\n")
    monkeypatch.setenv("KVREG_CONFORMANCE_XFAIL_DIR", str(tmp_path))
    rc, out = run_suite("broken_round", "quantize_rows_rounds_ties")
    assert rc == 0, out[-3000:]
    assert "2 xfailed" in out
    assert "stale xfail entry" in out and "test_no_such_case" in out
