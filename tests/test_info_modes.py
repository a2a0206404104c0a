"""`kvreg info` lists every KV mode with its bytes/element and measured KL."""

import re

import kvreg
from kvreg import measured
from kvreg.cli import main


def _info(capsys, monkeypatch) -> str:
    monkeypatch.setenv("KVREG_BACKEND", "reference")
    monkeypatch.delenv("KVREG_DEVICE", raising=False)
    monkeypatch.delenv("KVREG_KV", raising=False)
    assert main(["info"]) == 0
    return capsys.readouterr().out


def _sizes(out: str) -> dict[str, tuple[float, float]]:
    """Each mode's line in the KV modes section: (SmolLM2, Gemma) bytes/element."""
    section = out.split("KV modes", 1)[1]
    found = {}
    for m in re.finditer(r"^  (\S+)\s+(\d+\.\d{3}) / (\d+\.\d{3}) bytes/element", section, re.M):
        found[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return found


def test_info_lists_every_kv_mode_with_its_bytes_per_element(capsys, monkeypatch):
    out = _info(capsys, monkeypatch)
    sizes = _sizes(out)
    assert set(sizes) == {m.value for m in kvreg.KvMode}
    assert sizes["f32"] == (4.0, 4.0)
    assert sizes["f16"] == (2.0, 2.0) and sizes["bf16"] == (2.0, 2.0)
    assert "4.000 / 4.000 bytes/element" in out and "2.000 / 2.000 bytes/element" in out
    # Every quantized mode stores less than float32.
    assert all(0 < a < 4 and 0 < b < 4 for mode, (a, b) in sizes.items() if mode != "f32")


def test_info_prints_the_measured_kl_and_its_command(capsys, monkeypatch):
    out = _info(capsys, monkeypatch)
    assert f"measured with: {measured.COMMAND}" in out
    lines = {line.split()[0]: line for line in out.split("KV modes", 1)[1].splitlines()[1:] if line.strip()}
    for mode, per_model in measured.KL.items():
        for kl, top1 in per_model.values():
            assert f"{kl:.2e}" in lines[mode]
            if top1 is not None:
                assert f"{100 * top1:.1f}%" in lines[mode]
    unmeasured = [m.value for m in kvreg.KvMode if m.value not in measured.KL]
    for mode in unmeasured:
        assert "KL — / —" in lines[mode]   # not measured: a dash, not a number


def test_measured_figures_name_known_modes_and_models():
    values = {m.value for m in kvreg.KvMode}
    for mode, per_model in measured.KL.items():
        assert mode in values
        assert set(per_model) <= set(measured.MODELS)
