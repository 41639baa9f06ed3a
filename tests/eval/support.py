"""Test support: where the benchmark files are, and a stand-in for ReuseEngine with fixed, known outputs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

DATASETS = Path(__file__).parents[3] / "shared" / "datasets"  # ../shared/datasets from the project root

# method -> (first-token logits, generated text, TTFT seconds, recompute share)
BEHAVIOUR = {
    "full": ([2.0, 0.0, 0.0], "Free Guy\nbecause ...", 0.4, 1.0),
    "naive": ([0.0, 0.0, 0.0], "Forbidden Ground", 0.1, 0.0),
    "cacheblend:0.15": ([2.0, 1.0, 0.0], "free guy film", 0.2, 0.15),
}


@dataclass
class Output:
    logits: torch.Tensor
    ttft: float
    stats: dict
    text: str = ""


@dataclass
class FakeEngine:
    fingerprint: str = "fake-model"
    calls: Counter = field(default_factory=Counter)
    generation_slowdown: float = 1.0  # the generation's prefill takes this times as long as the timed one

    def build_request(self, chunks, question, system=None):
        return (tuple(chunks), question)

    def compile(self, request, methods):
        self.calls["compile"] += 1

    def _output(self, method: str) -> Output:
        logits, text, ttft, share = BEHAVIOUR[method]
        return Output(torch.tensor(logits), ttft, {"method": method, "recompute_share": share}, text)

    def prefill(self, request, method):
        self.calls[("prefill", method)] += 1
        return self._output(method)

    def generate(self, request, method, sampling):
        self.calls[("generate", method)] += 1
        output = self._output(method)
        output.ttft *= self.generation_slowdown
        return output

    def answer_logprobs(self, request, method, answer_text):
        return torch.tensor([-1.0, -2.0]) * (1 + BEHAVIOUR[method][3])
