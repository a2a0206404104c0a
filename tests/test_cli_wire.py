"""`kvreg wire inspect FILE`: a summary of a good blob, the fault of a broken one."""

import numpy as np

import kvreg
from kvreg.cli import main


def _blob():
    c = kvreg.LayerKvCache(2, 4, "f32", "reference")
    for p in range(3):
        c.append(np.full(8, p, np.float32), np.ones(8, np.float32))
    return c.export_wire()


def test_inspect_summarizes_a_good_blob(tmp_path, capsys):
    f = tmp_path / "good.bin"
    f.write_bytes(_blob())
    assert main(["wire", "inspect", str(f)]) == 0
    out = capsys.readouterr().out
    assert "kind 0 (Full)" in out and "OK: Full record, position 3" in out


def test_inspect_says_what_is_wrong_and_where(tmp_path, capsys):
    f = tmp_path / "cut.bin"
    f.write_bytes(_blob()[:-3])
    assert main(["wire", "inspect", str(f)]) == 1
    out = capsys.readouterr().out
    assert "ERROR: kv import: truncated payload" in out and "at byte" in out


def test_inspect_of_a_missing_file_is_a_usage_error(tmp_path, capsys):
    assert main(["wire", "inspect", str(tmp_path / "nope.bin")]) == 2
    assert "cannot read" in capsys.readouterr().err
