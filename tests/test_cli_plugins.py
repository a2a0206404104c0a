"""The kvreg command's plugin seam: subcommands from the ``kvreg.commands``
entry points, a clear message when kvreg-conformance (which provides
conformance) or kvreg-tools (bench, eval, generate, demo) is absent, and a
parser that stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvreg import cli


class _EntryPoint:
    def __init__(self, name, load):
        self.name, self.value, self._load = name, f"fake:{name}", load

    def load(self):
        return self._load()


@pytest.fixture
def no_plugins(monkeypatch):
    monkeypatch.setattr(cli, "_command_entry_points", lambda: [])


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--help"], ["bench", "o1", "--real", "--quick"],
                                  ["eval", "--model", "smollm2-135m"], ["generate"], ["demo", "--tokens", "4"]])
def test_tool_command_without_kvreg_tools_says_where_it_lives(no_plugins, capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"kvreg {argv[0]}: this command lives in the kvreg-tools distribution" in err
    assert "pip install kvreg-tools" in err and "pip install -e tools" in err


@pytest.mark.parametrize("argv", [["conformance"], ["conformance", "--backend", "all", "--profile", "quick"],
                                  ["conformance", "--help"]])
def test_conformance_without_kvreg_conformance_says_how_to_install_it(no_plugins, capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "kvreg conformance: this command lives in the kvreg-conformance distribution" in err
    assert "pip install kvreg-conformance" in err and "pip install -e conformance" in err


def test_help_lists_plugin_commands_without_their_distributions(no_plugins, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("info", "wire", *cli.PLUGIN_COMMANDS):
        assert name in out
    assert "(needs kvreg-tools)" in out and "(needs kvreg-conformance)" in out


def test_info_runs_without_the_suite(no_plugins, capsys, monkeypatch):
    # kvreg info is the core's own: no plugin command, no kvreg_conformance import
    monkeypatch.setitem(sys.modules, "kvreg_conformance", None)
    assert cli.main(["info"]) == 0
    assert "registered backends:" in capsys.readouterr().out


def test_core_commands_still_refuse_unknown_arguments(no_plugins, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["wire", "inspect", "blob.bin", "--bogus"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_plugin_adds_its_subcommand(monkeypatch, capsys):
    def register(sub):
        hp = sub.add_parser("hello", help="says hello")
        hp.add_argument("--name", default="world")
        hp.set_defaults(func=lambda args: print(f"hello {args.name}") or 7)

    monkeypatch.setattr(cli, "_command_entry_points", lambda: [_EntryPoint("hello", lambda: register)])
    assert cli.main(["hello", "--name", "kv"]) == 7
    assert capsys.readouterr().out == "hello kv\n"
    with pytest.raises(SystemExit) as exc:
        cli.main(["hello", "--nope"])
    assert exc.value.code == 2


def test_a_broken_plugin_is_reported_and_the_rest_runs(monkeypatch, capsys, tmp_path):
    def boom():
        raise ImportError("no module named kvreg_tools.cli")

    monkeypatch.setattr(cli, "_command_entry_points", lambda: [_EntryPoint("bench", boom)])
    assert cli.main(["wire", "inspect", str(tmp_path / "nope.bin")]) == 2  # the core command ran
    assert "command plugin 'bench' (fake:bench) failed to load: ImportError" in capsys.readouterr().err
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "kvreg-tools distribution, and its plugin failed to load (ImportError" in err


def test_parser_and_help_import_nothing_heavy():
    """kvreg --help (with whatever plugins are installed) imports no torch,
    transformers or matplotlib."""
    code = ("import sys\nfrom kvreg.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
