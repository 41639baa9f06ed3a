"""The correctness gate (`kvreuse.model.check`): what its references leave out, and that it catches runtimes that are
wrong where real workloads run. Faults are injected by monkeypatching the runtime. The gate's first tests (every
family passes; a wrong mask or RoPE offset fails) are in test_runtime.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvreuse.model import native
from kvreuse.model.check import (
    KEY_TILE,
    CheckResult,
    check_greedy_generation,
    check_prefill_logits,
    gate_prompt_ids,
    run_gate,
)
from kvreuse.model.kv_pool import KVPool
from kvreuse.model.resolved_step import _OneRequest, _Pooled
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


def failing(results: list[CheckResult]) -> list[str]:
    return [result.name for result in results if not result.passed]


def encode_words(text: str) -> list[int]:
    """A tokenizer for the tiny models: a token per word, the same tokens for the same number of words."""
    return random_ids(len(text.split()), seed=0)


def scaled_output(attend: Callable, factor: float) -> Callable:
    """`attend` (writing its output into its `out` argument, or returning it) with that output scaled."""
    def wrong(*args, **kwargs):
        returned = attend(*args, **kwargs)
        if returned is None:
            kwargs.get("out", args[3]).mul_(factor)
            return None
        return returned * factor
    return wrong


def test_gate_catches_pooled_decoding_gone_wrong(make_tiny, prompt_ids, monkeypatch):
    """The pool's attention call (the server's decoding of 2+ sequences) 10% off; decoding alone is right."""
    model = LayerwiseModel(make_tiny("llama"))  # passes the gate: test_runtime.py's test_correctness_gate
    monkeypatch.setattr(_Pooled, "attend", scaled_output(_Pooled.attend, 1.1))  # the native kernels' path
    monkeypatch.setattr(KVPool, "attend_one_each", scaled_output(KVPool.attend_one_each, 1.1))  # torch's
    assert failing(run_gate(model, prompt_ids, {EOS})) == ["pooled decoding of 3 sequences vs transformers forward"]


def test_gate_catches_a_continued_prefill_that_ignores_the_cached_rows(make_tiny, prompt_ids, monkeypatch):
    """Rows prefilled after a cached part attend only each other (a conversation's next turn losing its history)."""
    model = LayerwiseModel(make_tiny("llama"))
    attend = LayerwiseModel.attend

    def own_rows_only(self, layer, q, q_pos, keys, values, k_pos):
        if q.shape[0] > 1 and int(q_pos.min()) > 0:
            own = k_pos >= int(q_pos.min())
            keys, values, k_pos = keys[own], values[own], k_pos[own]
        return attend(self, layer, q, q_pos, keys, values, k_pos)

    monkeypatch.setattr(LayerwiseModel, "attend", own_rows_only)
    takes = _OneRequest.takes  # a step resolved once attends in C: prompts of many rows take the path above
    monkeypatch.setattr(_OneRequest, "takes",
                        staticmethod(lambda group, dtype: len(group) == 1 and takes(group, dtype)))
    assert failing(run_gate(model, prompt_ids, {EOS})) == ["prefill continuing a cache vs transformers forward"]


def test_gate_s_prompt_catches_attention_wrong_past_the_first_key_tile(make_tiny, monkeypatch):
    """The prefill attention kernel drops the keys past its first tile of 64: the gate's prompt must run past it
    (SmolLM2's gate prompt was 45 tokens, and this fault passed the gate)."""
    model = LayerwiseModel(make_tiny("llama"))
    prompt = gate_prompt_ids(model, encode_words, "a few words of text")
    assert check_prefill_logits(model, prompt).passed
    init = _OneRequest.__init__

    def first_tile_only(self, model, group, threads):
        init(self, model, group, threads)
        self.keys_count = min(self.keys_count, KEY_TILE) if self.rows_count > 1 else self.keys_count

    monkeypatch.setattr(_OneRequest, "__init__", first_tile_only)  # the native kernels' path; torch's:
    prefill_attention = native.prefill_attention
    monkeypatch.setattr(native, "prefill_attention", lambda q, q_pos, keys, values, k_pos, window, scale:
                        prefill_attention(q, q_pos, keys[:KEY_TILE], values[:KEY_TILE], k_pos[:KEY_TILE], window,
                                          scale))
    assert not check_prefill_logits(model, prompt).passed


def test_logits_tolerance_is_relative_to_the_logits_scale(make_tiny, prompt_ids, monkeypatch):
    """fp32's differences in summation order grow with the logits (and the model's width, which tiny models lack):
    logits in the thousands differ from transformers' by more than 1e-4 with a correct runtime. A fault moving them
    by 1e-3 of their scale still fails."""
    hf_model = make_tiny("llama")
    with torch.no_grad():
        hf_model.lm_head.weight.mul_(1000.0)
    model = LayerwiseModel(hf_model)
    result = check_prefill_logits(model, prompt_ids)
    assert result.passed, result.detail
    logits = LayerwiseModel.logits
    monkeypatch.setattr(LayerwiseModel, "logits", lambda self, hidden, int8=False: logits(self, hidden, int8) * 1.001)
    assert not check_prefill_logits(model, prompt_ids).passed

