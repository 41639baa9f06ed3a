"""Decoding after a prefill (full or a KV cache rebuilt by reuse) until a stop condition: one request's loop and the
streamed text every path shares."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvreuse.engine.sampling import Sampler, SamplingParams
from kvreuse.engine.stats import PrefillStats
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
    stats: PrefillStats | None = None  # how the prompt's KV was obtained (the reuse engine fills it)


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


class TextStream:
    """One sequence's sampled tokens as text. EOS, a stop string or max_tokens finish it; `new_text()` hands out
    only text that can no longer change (no possible start of a stop string, no half-decoded character), so a
    streaming client never sees text that is later cut.

    Tokens are turned into text incrementally, as vLLM and TGI do: each token decodes a window of the few tokens
    since the last settled ones and keeps what the window adds to its start's text, so a step costs the same at
    the 4000th token as at the first (decoding every token so far took 1.1 ms a token at 4K tokens on the engine
    thread, for every running sequence). A window starts at the tokens settled last, so tokenizers that render a
    token by what precedes it (SentencePiece's leading space) give the whole decode's text."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: set[int]):
        self.tokenizer, self.params, self.eos_ids = tokenizer, params, eos_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
        self._shown = 0
        self._settled_tokens = 0  # tokens whose text is in self.text
        self._window_start = 0  # the first of the tokens settled last: the context the next window starts from

    def add(self, token: int) -> bool:
        """Take the next sampled token; returns True once the sequence is finished."""
        if token in self.eos_ids:
            self._settle(final=True)
            self.finish_reason = "stop"
            return True
        self.token_ids.append(token)
        searched = len(self.text)
        last = len(self.token_ids) >= self.params.max_tokens
        self._settle(final=last)
        cut = self._stop_string_at(searched)
        if cut >= 0:
            self.text, self.finish_reason = self.text[:cut], "stop"
        elif last:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _settle(self, final: bool) -> None:
        """Append the text of the tokens since the settled ones, unless it ends in a character whose last byte
        has not come yet (a byte-level tokenizer renders it as U+FFFD): that waits, unless the stream ends."""
        decode = self.tokenizer.decode
        window = decode(self.token_ids[self._window_start :], skip_special_tokens=True)
        if window.endswith("\ufffd") and not final:
            return
        known = decode(self.token_ids[self._window_start : self._settled_tokens], skip_special_tokens=True)
        self.text += window[len(known) :]
        self._window_start, self._settled_tokens = self._settled_tokens, len(self.token_ids)

    def _stop_string_at(self, searched: int) -> int:
        """Where the first stop string starts in the text, or -1; text before `searched` held none."""
        return min((i for s in self.params.stop if (i := self.text.find(s, max(searched - len(s) + 1, 0))) >= 0),
                   default=-1)

    def new_text(self) -> str:
        """Text settled since the previous call."""
        end = len(self.text) if self.finish_reason else len(self.text) - self._stop_string_start()
        delta = self.text[self._shown : end]
        self._shown = max(self._shown, end)
        return delta

    def _stop_string_start(self) -> int:
        """Characters at the text's end that may begin a stop string."""
        return max((stop_string_start(self.text, s) for s in self.params.stop), default=0)

    def generation(self, prompt_tokens: int, ttft: float, total_seconds: float) -> Generation:
        return Generation(self.text, self.token_ids, self.finish_reason or "length", prompt_tokens, ttft, total_seconds)


def stop_string_start(text: str, stop: str) -> int:
    """The most characters at the end of `text` that begin `stop` without completing it. Runs on the engine thread
    for every sequence after every token: only where the tail holds stop's first character is it compared, not
    at each of stop's lengths (that was quadratic in its length)."""
    tail = text[max(len(text) - len(stop) + 1, 0) :] if len(stop) > 1 else ""
    start = tail.find(stop[0]) if tail else -1
    while start >= 0:
        if stop.startswith(tail[start:]):
            return len(tail) - start
        start = tail.find(stop[0], start + 1)
    return 0


def decode(
    loaded: LoadedModel,
    first_logits: torch.Tensor,
    cache: KVCache,
    params: SamplingParams,
    started: float,
    prompt_tokens: int,
) -> Generation:
    """Decode from an already prefilled `cache`; `started` is when the request arrived (for TTFT)."""
    stream = TextStream(loaded.tokenizer, params, set() if params.ignore_eos else eos_token_ids(loaded))
    ttft = 0.0
    for token in iter_tokens(loaded.runtime, first_logits, cache, Sampler(params), stream.eos_ids):
        ttft = ttft or time.perf_counter() - started
        if stream.add(token):
            break
    return stream.generation(prompt_tokens, ttft, time.perf_counter() - started)
