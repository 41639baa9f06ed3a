"""The correctness gate (`kvreuse.model.check`): what its references leave out, and that it catches runtimes that are
wrong where real workloads run. Faults are injected by monkeypatching the runtime. The gate's first tests (every
family passes; a wrong mask or RoPE offset fails) are in test_runtime.py."""

from __future__ import annotations

import pytest
import torch

from kvreuse.model.check import check_greedy_generation
from kvreuse.model.runtime import LayerwiseModel
from tests.conftest import TINY_COMMON, greedy_tokens, random_ids

EOS = TINY_COMMON["eos_token_id"]


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    return random_ids(60, seed=1)


def test_greedy_reference_leaves_out_the_model_s_generation_config(make_tiny, prompt_ids):
    """`generate` applies a shipped generation_config.json's rules (instruct models set repetition_penalty), which
    change greedy tokens; the model computed exactly does not apply them, so neither may the gate's reference."""
    model = LayerwiseModel(make_tiny("llama"))
    config = model.hf_model.generation_config
    config.repetition_penalty, config.no_repeat_ngram_size = 1.5, 2
    result = check_greedy_generation(model, prompt_ids, {EOS})
    assert result.passed, result.detail


def test_greedy_decoding_stops_at_the_given_eos_tokens_on_both_sides(make_tiny, prompt_ids):
    """A generation_config listing an EOS token that config.json does not (Llama-3 and Qwen2.5 instruct models do):
    both sides stop at the set given (check-model gives the engine's), not each at its own."""
    model = LayerwiseModel(make_tiny("llama"))
    tokens = greedy_tokens(model, prompt_ids, 32)
    stop_at = next(i for i in range(3, 32) if tokens[i] not in tokens[:i] and tokens[i] != EOS)
    model.hf_model.generation_config.eos_token_id = [EOS, tokens[stop_at]]
    result = check_greedy_generation(model, prompt_ids, {EOS, tokens[stop_at]})
    assert result.passed, result.detail
    assert f"(ours {stop_at + 1}, transformers {stop_at + 1})" in result.detail
