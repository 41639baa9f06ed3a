"""`kvreuse check-model` end to end on the tiny model directory (its verdicts mean nothing of SmolLM2: plumbing)."""

from __future__ import annotations

import json
import shutil

from kvreuse.cli import main
from kvreuse.cli.check_model import GATE_PROMPT
from kvreuse.model.check import gate_prompt_ids
from kvreuse.model.loader import load_model
from tests.conftest import greedy_tokens


def test_a_model_s_generation_config_neither_fails_the_gate_nor_moves_its_eos(tiny_model_dir, tmp_path, capsys):
    """An instruct model's generation_config.json: a repetition penalty and an n-gram rule, which the runtime does
    not apply, and an EOS token config.json does not list, at which the engine stops and so must both sides."""
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "instruct")
    loaded = load_model(str(model_dir))
    prompt = gate_prompt_ids(loaded.runtime, lambda text: loaded.tokenizer(text).input_ids, GATE_PROMPT)
    tokens = greedy_tokens(loaded.runtime, prompt, 32)
    eos = loaded.tokenizer.eos_token_id
    stop_at = next(i for i in range(3, 32) if tokens[i] not in tokens[:i] and tokens[i] != eos)
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos, tokens[stop_at]], "repetition_penalty": 1.3, "no_repeat_ngram_size": 3}))
    assert main(["check-model", str(model_dir)]) == 0
    assert f"(ours {stop_at + 1}, transformers {stop_at + 1})" in capsys.readouterr().out
