"""The `kvreuse` command end to end on the embedded model."""

import pytest

from kvreuse.cli import main


@pytest.mark.real_model
def test_generate_reuses_a_warmed_document(tmp_path, capsys, embedded_model):
    doc = tmp_path / "doc.txt"
    doc.write_text("The Eiffel Tower is in Paris. It was completed in 1889.")
    args = ["generate", "--prompt", "When was the tower completed?", "--document", str(doc), "--max-tokens", "4"]
    assert main(args + ["--warm", "--method", "naive"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and "naive: prompt" in out.err
    loaded = int(out.err.split("(")[1].split(" loaded")[0])
    assert loaded > 0  # the document (and template head) came from the store


def test_missing_document_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--document", str(tmp_path / "none.txt")]) == 2
    assert "none.txt" in capsys.readouterr().err
