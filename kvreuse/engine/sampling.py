"""Choosing the next token: greedy, or temperature with nucleus (top-p) filtering, reproducible by seed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # as OpenAI's API takes it: one stop string, not one per character
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(stop, str) for stop in self.stop):
            raise TypeError(f"stop: expected a text or a list of texts, got {self.stop!r}")
        for name, value in (("max_tokens", self.max_tokens), ("seed", self.seed)):
            whole = isinstance(value, int) and not isinstance(value, bool)
            if not whole and not (name == "seed" and value is None):
                raise TypeError(f"{name}: expected a whole number, got {value!r}")
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name}: expected a number, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN compares False either way
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:  # what a torch.Generator takes
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        if bool(torch.isnan(logits).any()):
            raise ValueError("the model's next-token logits hold NaN")
        if not self.params.temperature:
            return int(logits.argmax())
        scaled = logits.float() / self.params.temperature
        if bool((torch.isinf(scaled) & torch.isfinite(logits)).any()):
            # a temperature so close to 0 that finite logits overflow: greedy is its limit (a logit that is -inf
            # already, a masked token, just gets probability 0 below)
            return int(logits.argmax())
        probs = torch.softmax(scaled, dim=-1)
        if self.params.top_p < 1:
            probs = _nucleus(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always stays)."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # The top token is kept outright, not by the comparison: a top_p below float32's range (5e-324) rounds to 0,
    # which the top token's mass before it (0) would reach.
    sorted_probs[1:][mass_before[1:] >= top_p] = 0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
