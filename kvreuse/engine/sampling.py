"""Choosing the next token: greedy, or temperature with nucleus (top-p) filtering, reproducible by seed."""

from __future__ import annotations

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
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        scaled = logits.float() / self.params.temperature if self.params.temperature else None
        if scaled is None or not bool(torch.isfinite(scaled).all()):
            # greedy, or a temperature so close to 0 that the scaled logits overflow: greedy is its limit
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
