"""Single-request generation: prefill (or a KV cache rebuilt by reuse), then decode until a stop condition."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvreuse.engine.sampling import Sampler, SamplingParams
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.loader import LoadedModel
from kvreuse.model.runtime import LayerwiseModel


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    ttft: float  # seconds from the request's start to its first token
    total_seconds: float
    stats: dict = field(default_factory=dict)  # how the prompt's KV was obtained (reuse methods fill it)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` under the tokenizer's own chat template, ready for the assistant's answer."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids = loaded.runtime.hf_model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def iter_tokens(
    model: LayerwiseModel,
    first_logits: torch.Tensor,
    cache: KVCache,
    sampler: Sampler,
    eos_ids: set[int],
) -> Iterator[int]:
    """Yield sampled tokens one by one, EOS included, for as long as the caller keeps asking."""
    logits = first_logits
    while True:
        token = sampler(logits)
        yield token
        if token in eos_ids:
            return
        logits = model.decode(token, cache)


def decode(
    loaded: LoadedModel,
    first_logits: torch.Tensor,
    cache: KVCache,
    params: SamplingParams,
    started: float,
    prompt_tokens: int,
) -> Generation:
    """Decode from an already prefilled `cache`; `started` is when the request arrived (for TTFT)."""
    eos_ids = set() if params.ignore_eos else eos_token_ids(loaded)
    tokens: list[int] = []
    text, finish_reason, ttft = "", "length", 0.0
    for token in iter_tokens(loaded.runtime, first_logits, cache, Sampler(params), eos_ids):
        if not tokens:
            ttft = time.perf_counter() - started
        if token in eos_ids:
            finish_reason = "stop"
            break
        tokens.append(token)
        text = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min((i for s in params.stop if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            text, finish_reason = text[:cut], "stop"
            break
        if len(tokens) >= params.max_tokens:
            break
    return Generation(text, tokens, finish_reason, prompt_tokens, ttft, time.perf_counter() - started)


def generate(loaded: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> Generation:
    """Full prefill of `prompt_ids`, then decode: the reference path every reuse method is compared to."""
    started = time.perf_counter()
    result = loaded.runtime.prefill(prompt_ids, cache=loaded.runtime.new_cache(len(prompt_ids) + params.max_tokens))
    return decode(loaded, result.logits, result.cache, params, started, len(prompt_ids))
