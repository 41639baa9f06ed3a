"""Choosing the next token: greedy, or by temperature with top-k, nucleus (top-p) and min-p filtering, reproducible by
seed; biases a request sets on tokens, penalties for what the prompt and output hold; the log-probabilities of each
choice and its alternatives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


MAX_LOGPROBS = 20  # alternatives a token can report (OpenAI's top_logprobs bound, vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 100.0  # |bias| a token can take (OpenAI's range: -100 bans a token, 100 all but forces it)
LOWEST_LOGPROB = -9999.0  # what a token of probability 0 reports (-inf has no JSON form; vLLM's value)


class InvalidSampling(ValueError):
    """A sampling parameter out of its range, named (the server's 400 names it too)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """What decides the next token and when a sequence ends: OpenAI's parameters, and vLLM's beside them (top_k,
    min_p, repetition_penalty, stop_token_ids, min_tokens, include_stop_str_in_output), with vLLM's meanings."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    top_k: int = 0  # the k most likely tokens only; 0 or -1: all
    min_p: float = 0.0  # tokens less likely than min_p times the most likely one are dropped
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once for each time the output holds the token
    repetition_penalty: float = 1.0  # divides the positive logits of prompt and output tokens, multiplies the rest
    stop_token_ids: list[int] = field(default_factory=list)  # end the sequence, their text kept
    min_tokens: int = 0  # no EOS, stop token or stop string ends the sequence before this many tokens
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # report each token's log-probability and this many most likely alternatives
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to these tokens' logits before anything else

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # as OpenAI's API takes it: one stop string, not one per character
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(stop, str) for stop in self.stop):
            raise TypeError(f"stop: expected a text or a list of texts, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(map(_whole, self.stop_token_ids)):
            raise TypeError(f"stop_token_ids: expected a list of token ids, got {self.stop_token_ids!r}")
        if not isinstance(self.logit_bias, dict) or not all(
                _whole(token) and isinstance(bias, (int, float)) and not isinstance(bias, bool)
                for token, bias in self.logit_bias.items()):
            raise TypeError(f"logit_bias: expected token ids mapped to numbers, got {self.logit_bias!r}")
        for name in ("max_tokens", "seed", "top_k", "min_tokens", "logprobs"):
            value = getattr(self, name)
            if not _whole(value) and not (name in ("seed", "logprobs") and value is None):
                raise TypeError(f"{name}: expected a whole number, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name}: expected a number, got {value!r}")
        checks = {
            "max_tokens": (self.max_tokens >= 1, "must be >= 1"),
            # NaN compares False either way
            "temperature": (math.isfinite(self.temperature) and self.temperature >= 0, "must be a finite number >= 0"),
            "top_p": (0 < self.top_p <= 1, "must be in (0, 1]"),
            "seed": (self.seed is None or -(2**63) <= self.seed < 2**64, "must be in [-2**63, 2**64)"),
            "top_k": (self.top_k >= -1, "must be -1 or 0 (all tokens), or >= 1"),
            "min_p": (0 <= self.min_p <= 1, "must be in [0, 1]"),
            "presence_penalty": (-2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            "frequency_penalty": (-2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            "repetition_penalty": (0 < self.repetition_penalty < math.inf, "must be a finite number > 0"),
            "min_tokens": (0 <= self.min_tokens <= self.max_tokens, f"must be in [0, max_tokens={self.max_tokens}]"),
            "stop_token_ids": (all(t >= 0 for t in self.stop_token_ids), "must be token ids >= 0"),
            "logprobs": (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                         f"must be in [0, {MAX_LOGPROBS}]"),
            "logit_bias": (all(token >= 0 and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
                               for token, bias in self.logit_bias.items()),
                           f"must map token ids >= 0 to biases in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
        }
        for name, (ok, rule) in checks.items():
            if not ok:
                raise InvalidSampling(name, f"{name} {rule}, got {getattr(self, name)}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the most likely tokens' at its step, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Sampler:
    """One sequence's choice of each next token. It keeps the tokens it chose, which the penalties and min_tokens
    read; `prompt` (token ids) is what repetition_penalty counts beside them, `eos_ids` what min_tokens holds back
    with the stop tokens. With `params.logprobs` set, `last_logprob` is the last choice's: from the model's own
    distribution, before biases, penalties, temperature and filtering (vLLM's default, raw_logprobs), so that they
    say what the model predicted whatever the sampling settings."""

    def __init__(self, params: SamplingParams, prompt: torch.Tensor | None = None,
                 eos_ids: frozenset[int] | set[int] = frozenset()):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)  # a negative seed is taken as 2**64 + seed
        else:
            self.generator.seed()
        self.chosen = 0
        self._held_back = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)))
        self._prompt = prompt
        self._counts: torch.Tensor | None = None  # how often the output holds each token (penalties only)
        self._in_prompt: torch.Tensor | None = None  # which tokens the prompt holds (repetition_penalty only)
        self._bias: torch.Tensor | None = None  # logit_bias over the vocabulary, made at the first choice
        self.last_logprob: TokenLogprob | None = None

    def __call__(self, logits: torch.Tensor) -> int:
        if bool(torch.isnan(logits).any()):
            raise ValueError("the model's next-token logits hold NaN")
        token = self._choose(self._adjusted(logits))
        if self.params.logprobs is not None:
            self.last_logprob = _logprob_of(token, logits, self.params.logprobs)
        self.chosen += 1
        if self._counts is not None:
            self._counts[token] += 1
        return token

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after the biases, the penalties and min_tokens, in vLLM's order (a copy where any applies)."""
        params, vocab = self.params, logits.shape[-1]
        if params.logit_bias:
            logits = self._biased(logits.float())
        if params.penalized:
            if self._counts is None:
                self._counts, self._in_prompt = torch.zeros(vocab), torch.zeros(vocab, dtype=torch.bool)
                if self._prompt is not None:
                    self._in_prompt[self._prompt[self._prompt < vocab]] = True
            logits = _penalized(logits.float(), self._counts, self._in_prompt, params)
        if self.chosen < params.min_tokens and self._held_back:
            held_back = torch.tensor([t for t in self._held_back if t < vocab], dtype=torch.long)
            logits = logits.index_fill(-1, held_back, -math.inf)
        return logits

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        if self._bias is None:
            vocab = logits.shape[-1]
            outside = [token for token in self.params.logit_bias if token >= vocab]
            if outside:  # the server checks ids against the vocabulary first; a library caller learns it here
                raise InvalidSampling("logit_bias", f"logit_bias: token id {outside[0]} is outside the vocabulary "
                                                    f"[0, {vocab})")
            self._bias = torch.zeros(vocab)
            tokens = torch.tensor(list(self.params.logit_bias), dtype=torch.long)
            self._bias[tokens] = torch.tensor(list(self.params.logit_bias.values()), dtype=torch.float32)
        return logits + self._bias

    def _choose(self, logits: torch.Tensor) -> int:
        params = self.params
        if not params.temperature:
            return int(logits.argmax())
        scaled = logits.float() / params.temperature
        if bool((torch.isinf(scaled) & torch.isfinite(logits)).any()):
            # a temperature so close to 0 that finite logits overflow: greedy is its limit (a logit that is -inf
            # already, a masked token, just gets probability 0 below)
            return int(logits.argmax())
        if 0 < params.top_k < scaled.shape[-1]:
            scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k).values[-1], -math.inf)
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1:
            probs = _nucleus(probs, params.top_p)
        if params.min_p > 0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _logprob_of(token: int, logits: torch.Tensor, alternatives: int) -> TokenLogprob:
    logprobs = logits.float().log_softmax(-1).clamp_(min=LOWEST_LOGPROB)
    top = logprobs.topk(min(alternatives, logprobs.shape[-1])) if alternatives else None
    return TokenLogprob(token, float(logprobs[token]),
                        [] if top is None else list(zip(top.indices.tolist(), top.values.tolist())))


def _penalized(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, params: SamplingParams
               ) -> torch.Tensor:
    """vLLM's order: the repetition penalty over the prompt's and output's tokens, then frequency and presence
    over the output's (a new tensor)."""
    if params.repetition_penalty != 1:
        penalty = params.repetition_penalty
        logits = torch.where(in_prompt | (counts > 0), torch.where(logits > 0, logits / penalty, logits * penalty),
                             logits)
    return logits - counts * params.frequency_penalty - (counts > 0).float() * params.presence_penalty


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always stays)."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # The top token is kept outright, not by the comparison: a top_p below float32's range (5e-324) rounds to 0,
    # which the top token's mass before it (0) would reach.
    sorted_probs[1:][mass_before[1:] >= top_p] = 0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
