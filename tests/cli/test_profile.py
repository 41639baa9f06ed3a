"""`kvreuse profile` checks where it saves before it measures: a bad --out lost the whole measurement at its end."""

import pytest

from kvreuse.cli import main


@pytest.mark.parametrize("command", [["profile", "costs"], ["profile", "fidelity", "results.json"]])
def test_a_folder_or_a_missing_folder_as_out_is_refused_before_any_work(command, tmp_path, capsys):
    for out, message in [(tmp_path, "is a folder, not a file"), (tmp_path / "no" / "p.json", "does not exist")]:
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--out", str(out)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
