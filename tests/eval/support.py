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
    "auto": ([2.0, 0.5, 0.0], "Free Guy", 0.2, 0.15),
}


@dataclass
class FakeCache:
    method: str

    def clone(self) -> FakeCache:
        return FakeCache(self.method)


@dataclass
class Output:
    logits: torch.Tensor
    ttft: float
    stats: dict
    text: str = ""
    cache: FakeCache | None = None


@dataclass
class FakeEngine:
    fingerprint: str = "fake-model"
    calls: Counter = field(default_factory=Counter)
    samplings: list = field(default_factory=list)  # the sampling parameters each generation was asked for
    text_override: dict = field(default_factory=dict)  # method -> generated text, replacing BEHAVIOUR's
    compiled: list = field(default_factory=list)  # the method names each compile was asked for, in order

    def build_request(self, chunks, question, system=None):
        return (tuple(chunks), question)

    def compile(self, request, methods):
        self.calls["compile"] += 1
        self.compiled += list(methods)

    def _output(self, method: str) -> Output:
        logits, text, ttft, share = BEHAVIOUR[method]
        text = self.text_override.get(method, text)
        stats = {"method": method, "recompute_share": share, "reused_tokens": 0 if method == "full" else 20}
        return Output(torch.tensor(logits), ttft, stats, text, FakeCache(method))

    def prefill(self, request, method, extra_capacity=0):
        self.calls[("prefill", method)] += 1
        return self._output(method)

    def _generated(self, method: str, sampling) -> Output:
        self.calls[("generate", method)] += 1
        self.samplings.append(sampling)
        output = self._output(method)
        cut = min((i for s in sampling.stop if (i := output.text.find(s)) >= 0), default=len(output.text))
        output.text = output.text[:cut]
        return output

    def generate(self, request, method, sampling):
        return self._generated(method, sampling)

    def generate_after(self, fused, sampling, started, request):
        return self._generated(fused.cache.method, sampling)

    def answer_ids(self, answer):
        return [1, 2]

    def teacher_forced_logprobs(self, first_logits, cache, answer_ids):
        return torch.tensor([-1.0, -2.0]) * (1 + BEHAVIOUR[cache.method][3])
