"""`kvreuse profile` checks where it saves before it measures: a bad --out lost the whole measurement at its end."""

import pytest

from kvreuse.cli import main


@pytest.mark.parametrize("command", [["profile", "costs"], ["profile", "fidelity", "results.json"]])
def test_a_folder_or_a_missing_folder_as_out_is_refused_before_any_work(command, tmp_path, capsys):
    for out, message in [(tmp_path, "is a folder, not a file"), (tmp_path / "no" / "p.json", "does not exist")]:
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--out", str(out)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_profile_fidelity_folds_into_a_saved_table_or_replaces_it_only_when_told(tmp_path, monkeypatch, capsys):
    """A second call replaced the saved table without a word: the first datasets' worst cases were lost."""
    from kvreuse.controller.fidelity import load_table

    from ..controller.test_fidelity import eval_results

    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path / "cache"))
    first = eval_results(tmp_path / "a.json", "m", "2wikimqa", {"naive": (0.4, 0.5)})
    second = eval_results(tmp_path / "b.json", "m", "hotpotqa", {"naive": (0.1, 0.9), "legolink:16": (0.2, 0.7)})
    assert main(["profile", "fidelity", str(first)]) == 0
    saved = tmp_path / "cache" / "controller" / "fidelity-m.json"
    assert main(["profile", "fidelity", str(second)]) == 2
    assert f"{saved} holds a fidelity table already" in capsys.readouterr().err
    assert load_table("m").sources == ["2wikimqa: 10 examples"]
    assert main(["profile", "fidelity", str(second), str(saved)]) == 0  # folded in: each method's worst
    assert load_table("m").methods["naive"].first_token_kl == 0.4 and "legolink:16" in load_table("m").methods
    assert main(["profile", "fidelity", str(second), "--replace"]) == 0
    assert load_table("m").sources == ["hotpotqa: 10 examples"]
