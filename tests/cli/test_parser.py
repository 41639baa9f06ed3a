"""The command tree: `kvreuse --help` and a mistyped command answer without importing any command's module."""

import subprocess
import sys

import pytest

# What a command's module costs to import: seconds of torch and transformers.
SCRIPT = """
import sys
from kvreuse.cli import main
from kvreuse.cli.parser import COMMANDS
try:
    main(sys.argv[1:])
except SystemExit as e:
    commands = {f"kvreuse.cli.{module}" for module, _ in COMMANDS.values()}
    print("exit", e.code, sorted({m.split(".")[0] for m in sys.modules if m.startswith(("torch", "transformers"))}
                                 | commands & set(sys.modules)))
"""


@pytest.mark.parametrize("argv, exit_code, shown", [
    (["--help"], 0, "check-model"), ([], 2, "the following arguments are required: command"),
    (["genrate"], 2, "invalid choice: 'genrate'")])
def test_help_and_a_mistyped_command_import_no_command(argv, exit_code, shown):
    run = subprocess.run([sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True, timeout=60)
    assert run.stdout.splitlines()[-1] == f"exit {exit_code} []" and shown in run.stdout + run.stderr


def test_serve_s_help_imports_neither_torch_nor_transformers():
    run = subprocess.run([sys.executable, "-c", SCRIPT, "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert run.stdout.splitlines()[-1] == "exit 0 ['kvreuse.cli.serve']" and "--max-concurrency" in run.stdout


def test_the_command_given_gets_its_arguments(capsys):
    from kvreuse.cli import main

    with pytest.raises(SystemExit):
        main(["cache", "--help"])
    assert "{ls,stats,rm,clear,bench}" in capsys.readouterr().out


def test_ctrl_c_ends_a_command_with_a_line_not_a_traceback(monkeypatch, capsys, tmp_path):
    """What the command opened is closed on the way out (its `with` blocks); the user sees one line, exit 130."""
    from kvreuse.cli import cache, main

    closed = []

    def interrupted(args):
        with cache._opened(args) as store:
            monkeypatch.setattr(store, "close", lambda: closed.append(True))
            raise KeyboardInterrupt

    monkeypatch.setattr(cache, "cmd_ls", interrupted)
    assert main(["cache", "ls", "--store", f"disk:{tmp_path}"]) == 130
    assert capsys.readouterr().err == "kvreuse: interrupted\n" and closed == [True]
