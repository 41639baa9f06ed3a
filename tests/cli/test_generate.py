"""The `kvreuse` command end to end on the embedded model."""

from dataclasses import replace

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


@pytest.mark.parametrize("content, message", [
    (None, "No such file or directory"), (b"\xff\xfebinary", "is not UTF-8 text (byte 0)"), (b"", "holds no text"),
    (b" \n\t", "holds no text")])
def test_a_document_that_is_no_text_is_named_before_the_model_loads(content, message, tmp_path, capsys, monkeypatch):
    import kvreuse.engine.reuse

    monkeypatch.setattr(kvreuse.engine.reuse.ReuseEngine, "load", lambda *a: pytest.fail("loaded the model"))
    doc = tmp_path / "doc.txt"
    if content is not None:
        doc.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--document", str(doc)])
    assert exit_info.value.code == 2 and f"--document: {str(doc)!r}" in (err := capsys.readouterr().err)
    assert message in err


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"],
                                     ["eval", "--dataset", "../shared/datasets/hotpotqa.jsonl"]])
def test_a_bad_store_spec_is_named_before_the_model_loads(command, capsys, monkeypatch):
    import kvreuse.engine.reuse

    monkeypatch.setattr(kvreuse.engine.reuse.ReuseEngine, "load", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--store", "memory:1GB,disk:/tmp/kv:5XB"])
    assert exit_info.value.code == 2
    assert "argument --store: bad store spec 'disk:/tmp/kv:5XB': bad size '5XB'" in capsys.readouterr().err


def test_generate_decodes_over_int8_weights_when_asked(tiny_model_dir, capsys, monkeypatch):
    from kvreuse.model.runtime import LayerwiseModel

    switched = []
    decode_in_int8 = LayerwiseModel.decode_in_int8
    monkeypatch.setattr(LayerwiseModel, "decode_in_int8",
                        lambda self, enabled=True: switched.append(enabled) or decode_in_int8(self, enabled))
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "3"]
    assert main(args) == 0 and switched == []
    assert main(args + ["--decode-weights", "int8"]) == 0 and switched == [True]
    with pytest.raises(SystemExit):
        main(args + ["--decode-weights", "int4"])
    assert "--decode-weights: invalid choice: 'int4'" in capsys.readouterr().err


@pytest.mark.parametrize("words, budget", [(1, 128), (8100, None)])
def test_the_default_budget_is_what_the_window_leaves_room_for(words, budget, tiny_model_dir, monkeypatch):
    """As the server's: a prompt a few tokens short of the window generates to its end, not a refusal for the
    128 tokens it did not ask for."""
    from kvreuse.engine.reuse import ReuseEngine

    asked = []
    generate = ReuseEngine.generate
    monkeypatch.setattr(ReuseEngine, "generate", lambda self, request, method, params:
                        asked.append((len(request), self.model.config.max_position_embeddings, params.max_tokens))
                        or generate(self, request, method, replace(params, max_tokens=1)))
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "word " * words]) == 0
    ((prompt, window, max_tokens),) = asked
    assert max_tokens == (budget or window - prompt) and prompt + max_tokens <= window
    assert budget or window - prompt < 128
