"""Decoding after a prefill (full or a KV cache rebuilt by reuse) until a stop condition: one request's loop and the
streamed text every path shares."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvreuse.engine.sampling import Sampler, SamplingParams, TokenLogprob
from kvreuse.engine.stats import PrefillStats
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.loader import LoadedModel
from kvreuse.model.runtime import LayerwiseModel


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop string or a stop token) or "length"
    prompt_tokens: int
    ttft: float  # seconds from the request's start to its first token
    total_seconds: float
    stats: PrefillStats | None = None  # how the prompt's KV was obtained (the reuse engine fills it)
    stop_reason: str | int | None = None  # the stop string or stop token that ended it (None: EOS or length)
    logprobs: list[TokenLogprob] | None = None  # one for each of token_ids, when asked for


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids = loaded.runtime.hf_model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def iter_tokens(model: LayerwiseModel, first_logits: torch.Tensor, cache: KVCache, sampler: Sampler) -> Iterator[int]:
    """Yield sampled tokens one by one for as long as the caller keeps asking (a TextStream says when to stop)."""
    logits = first_logits
    while True:
        token = sampler(logits)
        yield token
        logits = model.decode(token, cache)


class TextStream:
    """One sequence's sampled tokens as text. EOS, a stop string, a stop token or max_tokens finish it (stop strings
    are looked for from the min_tokens-th token on, as vLLM does); `new_text()` hands out only text that can no
    longer change (no possible start of a stop string, no half-decoded character), so a streaming client never
    sees text that is later cut.

    Tokens are turned into text incrementally, as vLLM and TGI do: each token decodes a window of the few tokens
    since the last settled ones and keeps what the window adds to its start's text, so a step costs the same at
    the 4000th token as at the first (decoding every token so far took 1.1 ms a token at 4K tokens on the engine
    thread, for every running sequence). A window starts at the tokens settled last, so tokenizers that render a
    token by what precedes it (SentencePiece's leading space) give the whole decode's text."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: set[int]):
        """eos_ids: the model's end-of-sequence tokens, which finish it unless `params.ignore_eos`."""
        self.tokenizer, self.params = tokenizer, params
        self.eos_ids = set() if params.ignore_eos else eos_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" (EOS, a stop string or a stop token) or "length"
        self.stop_reason: str | int | None = None
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self._logprobs_shown = 0
        self._stop_tokens = set(params.stop_token_ids)
        self._shown = 0
        self._stops = [StopMatcher(stop) for stop in params.stop if stop]
        self._settled_tokens = 0  # tokens whose text is in self.text
        self._window_start = 0  # the first of the tokens settled last: the context the next window starts from

    def add(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Take the next sampled token (and its log-probabilities, when asked for); returns True once the sequence
        is finished. EOS ends it like the last token max_tokens allows: what is still held back (half a character)
        settles, and stop strings see it. A stop token ends it too, its text kept (vLLM's stop_token_ids)."""
        eos = token in self.eos_ids
        if not eos:
            self.token_ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append(logprob)
        stop_token = token in self._stop_tokens
        searched = len(self.text)
        last = len(self.token_ids) >= self.params.max_tokens
        self._settle(final=eos or last or stop_token)
        added = self.text[searched:]
        stop = self._stop_string(added, searched) if len(self.token_ids) >= self.params.min_tokens else None
        if stop is not None:
            matcher, start = stop
            end = start + len(matcher.stop) if self.params.include_stop_str_in_output else start
            self.text, self.finish_reason, self.stop_reason = self.text[:end], "stop", matcher.stop
        elif eos or stop_token:
            self.finish_reason, self.stop_reason = "stop", token if stop_token else None
        elif last:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _stop_string(self, added: str, offset: int) -> tuple[StopMatcher, int] | None:
        """The stop string that starts first in the text, with where it starts, once `added` (at `offset`) is
        fed to every matcher."""
        found = [(stop, start) for stop in self._stops if (start := stop.feed(added, offset)) >= 0]
        return min(found, key=lambda stop_and_start: stop_and_start[1], default=None)

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

    def new_text(self) -> str:
        """Text settled since the previous call."""
        held = 0 if self.finish_reason else max((stop.matched for stop in self._stops), default=0)
        end = len(self.text) - held  # what may begin a stop string waits
        delta = self.text[self._shown : end]
        self._shown = max(self._shown, end)
        return delta

    def new_logprobs(self) -> list[TokenLogprob] | None:
        """The log-probabilities of the tokens taken since the previous call (None: not asked for)."""
        if self.logprobs is None:
            return None
        new = self.logprobs[self._logprobs_shown :]
        self._logprobs_shown = len(self.logprobs)
        return new

    def generation(self, prompt_tokens: int, ttft: float, total_seconds: float) -> Generation:
        return Generation(self.text, self.token_ids, self.finish_reason or "length", prompt_tokens, ttft, total_seconds,
                          stop_reason=self.stop_reason, logprobs=self.logprobs)


class StopMatcher:
    """One stop string against a text fed to it piece by piece (Knuth-Morris-Pratt): after each piece, how much of
    the stop the text ends with, or where the stop first occurs. A token costs its own characters whatever the
    stop's length (comparing each of the stop's prefixes with the text's end after every token, as before, was
    quadratic in it, on the engine thread every stream shares)."""

    def __init__(self, stop: str):
        self.stop = stop
        self.matched = 0  # the longest start of the stop that the text fed so far ends with
        # fallback[k]: the longest proper start of stop[: k + 1] that is also its end
        self._fallback = [0] * len(stop)
        for k in range(1, len(stop)):
            n = self._fallback[k - 1]
            while n and stop[k] != stop[n]:
                n = self._fallback[n - 1]
            self._fallback[k] = n + (stop[k] == stop[n])

    def feed(self, text: str, offset: int) -> int:
        """Take `text`, found at `offset` of the whole; returns where in the whole the stop starts, or -1."""
        stop, fallback, matched = self.stop, self._fallback, self.matched
        for i, character in enumerate(text):
            while matched and stop[matched] != character:
                matched = fallback[matched - 1]
            matched += stop[matched] == character
            if matched == len(stop):
                self.matched = matched
                return offset + i + 1 - matched
        self.matched = matched
        return -1


def decode(
    loaded: LoadedModel,
    first_logits: torch.Tensor,
    cache: KVCache,
    params: SamplingParams,
    started: float,
    prompt: torch.Tensor,
) -> Generation:
    """Decode from an already prefilled `cache` of the `prompt`'s token ids; `started` is when the request arrived
    (for TTFT)."""
    eos_ids = eos_token_ids(loaded)
    stream = TextStream(loaded.tokenizer, params, eos_ids)
    ttft = 0.0
    sampler = Sampler(params, prompt, eos_ids)
    for token in iter_tokens(loaded.runtime, first_logits, cache, sampler):
        ttft = ttft or time.perf_counter() - started
        if stream.add(token, sampler.last_logprob):
            break
    return stream.generation(len(prompt), ttft, time.perf_counter() - started)
