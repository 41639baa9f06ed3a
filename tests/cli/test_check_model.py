"""`kvreuse check-model` end to end on the tiny model directory (its verdicts mean nothing of SmolLM2: plumbing)."""

from __future__ import annotations

import json
import shutil

import pytest

from kvreuse.cli import main
from kvreuse.cli.check_model import GATE_PROMPT
from kvreuse.model import check
from kvreuse.model.check import CheckResult, core_length, gate_prompt_ids
from kvreuse.model.loader import load_model
from tests.conftest import greedy_tokens


def test_a_model_s_generation_config_neither_fails_the_gate_nor_moves_its_eos(tiny_model_dir, tmp_path, capsys):
    """An instruct model's generation_config.json: a repetition penalty and an n-gram rule, which the runtime does
    not apply, and an EOS token config.json does not list, at which the engine stops and so must both sides."""
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "instruct")
    loaded = load_model(str(model_dir))
    prompt = gate_prompt_ids(loaded.runtime, lambda text: loaded.tokenizer(text).input_ids, GATE_PROMPT)
    tokens = greedy_tokens(loaded.runtime, prompt[:core_length(loaded.runtime)], 32)  # where the gate decodes
    eos = loaded.tokenizer.eos_token_id
    stop_at = next(i for i in range(3, 32) if tokens[i] not in tokens[:i] and tokens[i] != eos)
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos, tokens[stop_at]], "repetition_penalty": 1.3, "no_repeat_ngram_size": 3}))
    assert main(["check-model", str(model_dir)]) == 0
    assert f"(ours {stop_at + 1}, transformers {stop_at + 1})" in capsys.readouterr().out


def test_help_lists_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as done:
        main(["check-model", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for line in ("0  the model passes", "1  the model fails", "2  no verdict: the model could not be loaded",
                 "3  no verdict: check-model crashed"):
        assert line in out


def test_a_failed_gate_exits_1(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(check, "run_gate", lambda *args: [CheckResult("a check", False, "what differed")])
    assert main(["check-model", str(tiny_model_dir)]) == 1
    assert "FAIL  a check: what differed" in capsys.readouterr().out


def test_a_crash_while_checking_exits_3_with_its_traceback(tiny_model_dir, monkeypatch, capsys):
    """A crash is no verdict: it must not exit 1, as a failed gate does (Python's own exit code for a traceback)."""
    def crash(*args):
        raise RuntimeError("a kernel refused the shapes")

    monkeypatch.setattr(check, "run_gate", crash)
    assert main(["check-model", str(tiny_model_dir)]) == 3
    out = capsys.readouterr()
    assert "FAIL" not in out.out
    assert "Traceback" in out.err and "RuntimeError: a kernel refused the shapes" in out.err
    assert "kvreuse: error: check-model crashed on" in out.err


def test_a_truncated_gguf_file_is_a_load_error(tmp_path, monkeypatch, capsys):
    """transformers' GGUF reader raised struct.error on it: a traceback and exit 1, as if the gate had failed."""
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path / "cache"))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert main(["check-model", str(truncated)]) == 2
    err = capsys.readouterr().err
    assert "kvreuse: error: cannot convert" in err and "truncated.gguf" in err and "Traceback" not in err


def test_a_truncated_weights_file_is_a_load_error(tiny_model_dir, tmp_path, capsys):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "truncated")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["check-model", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert "kvreuse: error: cannot load model from" in err and "Traceback" not in err
