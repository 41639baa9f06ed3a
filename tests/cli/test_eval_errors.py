"""Bad input to `kvreuse eval` fails fast, before any model loads, with a message naming what is wrong."""

import pytest

from kvreuse.cli import main

from ..eval.support import DATASETS

QA_FILE = str(DATASETS / "2wikimqa.jsonl")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "no/such/file.jsonl"], "dataset file 'no/such/file.jsonl' does not exist"),
        (["--dataset", QA_FILE, "--methods", "full,,naive"], "--methods: empty entry in 'full,,naive'"),
        (["--dataset", QA_FILE, "--methods", "cacheblend=0.15"], "unknown method 'cacheblend=0.15'"),
        (["--dataset", QA_FILE, "--chunking", "fixed:abc"], "chunking 'fixed:abc' is neither"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvreuse: error: ") and message in err and "Traceback" not in err


def test_unknown_schema_is_named(tmp_path, capsys):
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"id": "1", "prompt": "hello"}\n')
    assert main(["eval", "--dataset", str(odd)]) == 2
    assert "unknown dataset schema" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--limit", "--max-tokens"])
def test_counts_must_be_positive(option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--dataset", QA_FILE, option, "0"])
    assert exit_info.value.code == 2 and "expected a whole number >= 1, got '0'" in capsys.readouterr().err


def test_an_out_folder_of_another_dataset_is_refused(tiny_model_dir, tmp_path, capsys):
    """Its report would be replaced by this dataset's without a word."""
    (tmp_path / "results.json").write_text('{"settings": {"dataset": "hotpotqa"}}')
    argv = ["--dataset", QA_FILE, "--out", str(tmp_path), "--model", str(tiny_model_dir), "--limit", "1",
            "--methods", "naive", "--max-tokens", "1", "--no-progress"]  # short, were it not refused
    assert main(["eval", *argv]) == 2
    assert "holds the report of dataset 'hotpotqa'; give dataset '2wikimqa' a folder of its own" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("command", [["eval", "--dataset", QA_FILE], ["analyze", "hkvd", "--dataset", QA_FILE]])
def test_a_file_in_the_place_of_the_out_folder_is_refused_before_any_work(command, tmp_path, capsys):
    """It failed at the end, the run lost: eval after its first example, analyze after all of it."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    for out in (in_the_way, in_the_way / "below"):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--out", str(out)])
        assert exit_info.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
