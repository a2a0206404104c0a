"""``python -m kvreg_numba.warm`` (what ``make install`` runs) drives every
KV mode's kernels through kvreg's public API, split over processes, and
fails loudly if any path it takes no longer runs."""

from __future__ import annotations

from kvreg_numba import warm


def test_the_warm_up_runs_every_mode_split_over_two_processes(capsys):
    assert warm.main(["--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "(2 processes;" in out and "kernels compiled and cached" in out
