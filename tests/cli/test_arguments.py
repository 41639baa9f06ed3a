"""The argument types commands share: output paths checked when a command starts, so a long run is not lost at its
end for a path it cannot write."""

from __future__ import annotations

import argparse
import os

import pytest

from kvreuse.cli import arguments


@pytest.fixture
def read_only(monkeypatch, tmp_path):
    """tmp_path/ro as a read-only file system shows it: os.access refuses writing there (even to root)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "old.json").write_text("{}")
    real_access = os.access
    monkeypatch.setattr(arguments.os, "access", lambda path, mode: False if str(path).startswith(str(folder))
                        else real_access(path, mode))
    return folder


@pytest.mark.parametrize("check, name", [(arguments.output_folder, "out"), (arguments.output_folder, "new/out"),
                                         (arguments.output_file, "p.json"), (arguments.output_file, "old.json")])
def test_an_output_where_nothing_can_be_written_is_refused_when_the_command_starts(read_only, check, name):
    with pytest.raises(argparse.ArgumentTypeError, match="cannot be written to"):
        check(str(read_only / name))


def test_writable_outputs_pass(tmp_path):
    assert arguments.output_folder(str(tmp_path / "new" / "out")) == tmp_path / "new" / "out"
    assert arguments.output_file(str(tmp_path / "p.json")) == tmp_path / "p.json"
