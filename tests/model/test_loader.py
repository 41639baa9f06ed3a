"""Finding and loading models: clear errors for what cannot be loaded, never a hub request."""

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from kvreuse.cli import main
from kvreuse.model import loader
from kvreuse.model.adapters import UnsupportedModelError
from kvreuse.model.identity import file_digest
from kvreuse.model.loader import ModelLoadError, convert_gguf, load_model, resolve_model_dir
from kvreuse.model.runtime import LayerwiseModel


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="never downloads"):
        resolve_model_dir(str(tmp_path / "nope"))


def test_hub_name_is_not_fetched():
    with pytest.raises(ModelLoadError, match="neither a local Hugging Face directory nor a .gguf file"):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="dtype 'float8'"):
        load_model(None, "float8")


def test_unsupported_architecture_is_a_clear_error():
    config = AutoConfig.for_model(
        "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64
    )
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*llama, mistral, qwen2, qwen3"):
        LayerwiseModel(AutoModelForCausalLM.from_config(config))


def test_cli_bad_model_exits_nonzero_with_message(tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--model", str(tmp_path / "missing")]) == 2
    assert "kvreuse: error: model" in capsys.readouterr().err


def test_console_script_reports_bad_model(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "kvreuse.cli", "check-model", str(tmp_path / "missing.gguf")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "missing.gguf" in done.stderr and "Traceback" not in done.stderr


def test_a_packaged_model_whose_wheel_is_missing_names_the_package(monkeypatch):
    monkeypatch.setitem(loader.PACKAGED_MODELS, "tiny-packaged", ("no_such_module_kvreuse", "no-such-wheel"))
    with pytest.raises(ModelLoadError, match="pip install no-such-wheel"):
        resolve_model_dir("tiny-packaged")


@pytest.mark.parametrize(("name", "finder"), [("gemma3-270m", "packaged_gguf"),
                                              (loader.EMBEDDED_MODEL, "embedded_gguf")])
def test_a_model_directory_named_like_a_shipped_model_is_pointed_out(tmp_path, monkeypatch, capsys, name, finder):
    """A shipped model's name loads that model; a model directory of the same name in the working directory is named
    by a path, and the note says so (the directory used to be passed over in silence)."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loader, finder, lambda *args: tmp_path / "shipped.gguf")
    monkeypatch.setattr(loader, "convert_gguf", lambda gguf: tmp_path / "converted")
    assert resolve_model_dir(name) == tmp_path / "converted"
    assert f"name it by a path: ./{name}" in capsys.readouterr().err
    assert resolve_model_dir(f"./{name}") == Path(name)
    assert capsys.readouterr().err == ""


def test_a_converted_gguf_file_is_not_read_again_at_each_load(tmp_path, monkeypatch):
    """Its digest names its conversion; hashing a file of several GB at every start took about 0.8 s a GB."""
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF weights")
    converted = tmp_path / "cache" / "models" / f"model-{file_digest(gguf)[:12]}"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    reads, open_path = [], Path.open
    monkeypatch.setattr(Path, "open", lambda path, *args, **kwargs: (reads.append(path) if path == gguf else None)
                        or open_path(path, *args, **kwargs))
    assert [convert_gguf(gguf) for _ in range(3)] == [converted] * 3
    assert reads == [gguf]


def test_a_tokenizer_with_ids_past_the_embedding_is_warned_of(tmp_path, embedded_tokenizer, caplog):
    """Tokens added without resizing the embedding have no row: named when the model loads (the server refuses
    prompts that hold them, tests/server/test_errors.py)."""
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    embedded_tokenizer.save_pretrained(tmp_path)
    load_model(str(tmp_path))
    assert f"has token ids up to {len(embedded_tokenizer) - 1}, the model's embedding 256 rows" in caplog.text
    caplog.clear()
    load_model(None)
    assert "token ids up to" not in caplog.text
