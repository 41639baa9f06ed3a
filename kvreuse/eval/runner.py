"""Run every method on every example, full prefill first as the reference; resumable; aggregate per method.

Chunks are compiled (computed and stored) before any method runs and outside the timed region, as in the
papers: TTFT measures the online path only, including every load from the store.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
import typing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from kvreuse.engine.sampling import SamplingParams
from kvreuse.eval.datasets import ChunkedPrompt, Dataset
from kvreuse.eval.metrics import agreement, first_line, first_token_kl, mean_log_likelihood, task_score
from kvreuse.fusion.methods import DEFAULT_MAX_KL, Auto, parse_method, parse_method_list

REFERENCE = "full"


class MethodSpecError(ValueError):
    """The --methods list cannot be parsed."""


class Engine(Protocol):
    """What the runner needs of `kvreuse.engine.reuse.ReuseEngine`."""

    fingerprint: str

    def build_request(self, chunks: list[str], question: str, system: str | None = None) -> Any: ...
    def compile(self, request: Any, methods: list[str]) -> Any: ...
    def prefill(self, request: Any, method: str, extra_capacity: int = 0) -> Any: ...  # .logits .cache .ttft .stats
    def generate(self, request: Any, method: str, sampling: Any) -> Any: ...  # .text, .ttft
    def generate_after(self, fused: Any, sampling: Any, started: float, request: Any) -> Any: ...
    def answer_ids(self, answer: str) -> list[int]: ...
    def teacher_forced_logprobs(self, first_logits: torch.Tensor, cache: Any, answer_ids: list[int]
                                ) -> torch.Tensor: ...


# What may follow '@' in a method besides a dtype: the method on an fp32 engine that decodes over int8 weights
INT8_DECODE = "int8-decode"


def split_dtype(method: str) -> tuple[str, str | None]:
    """'cacheblend:0.15@bfloat16' -> ('cacheblend:0.15', 'bfloat16'): the method run by an engine in that dtype (or
    INT8_DECODE's engine), against the run's reference (full, in the run's own dtype). Without a suffix: (method,
    None)."""
    name, _, dtype = method.partition("@")
    return name, dtype or None


def engine_options(variant: str) -> dict[str, str]:
    """ReuseEngine.load's options for the engine of methods named `method@variant`."""
    return {"dtype": "float32", "decode_weights": "int8"} if variant == INT8_DECODE else {"dtype": variant}


def parse_methods(spec: str) -> list[str]:
    """'naive,cacheblend:0.15@bfloat16' -> ['full', 'naive', 'cacheblend:0.15@bfloat16']: full always there, and
    first; a method may name the engine variant it runs on after '@'."""
    from kvreuse.model.loader import DTYPES

    def check(method: str) -> None:
        name, dtype = split_dtype(method)
        if method.endswith("@") or (dtype is not None and dtype not in (*DTYPES, INT8_DECODE)):
            raise ValueError(f"{method!r}: what follows '@' must be one of {', '.join(DTYPES)} or {INT8_DECODE}")
        parse_method(name)

    try:
        return parse_method_list(spec, check)
    except ValueError as e:
        raise MethodSpecError(str(e)) from None


@dataclass(frozen=True)
class RunSettings:
    """Everything a result depends on besides the example and the method: part of every cache key."""

    model: str  # the engine's fingerprint
    dataset: str
    chunking: str
    max_tokens: int
    store: str


@dataclass
class MethodResult:
    example_id: str
    method: str
    score: float  # F1 or Rouge-L against gold
    agreement: float  # token F1 with full prefill's output
    gold_loglik: float  # mean log-probability of the (first) gold answer's tokens
    first_token_kl: float  # KL(full || method), nats
    ttft: float  # seconds: the prefill's
    recompute_share: float | None  # as reported by the engine
    output: str
    stats: dict = field(default_factory=dict)
    # Full prefill's TTFT on this example in the run that measured this row, so that a method added to a resumed
    # run is compared with full timed beside it (None: a row of an older layout, compared with full's cached row).
    reference_ttft: float | None = None

    @classmethod
    def from_record(cls, record: dict) -> MethodResult:
        """A row of the resume file, its fields of the types the report computes with: a row edited or damaged
        into another type (a score as text) is a TypeError here, not the run's crash once every example is done."""
        result = cls(**record)
        for name, hint in typing.get_type_hints(cls).items():
            value, kinds = getattr(result, name), _accepted(hint)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise TypeError(f"{name}: expected {hint}, got {value!r}")
        return result


def _accepted(hint: Any) -> tuple[type, ...]:
    """The types a field's annotation admits as JSON gives them back: a float field takes a whole number too."""
    kinds = typing.get_args(hint) or (hint,)
    return tuple(kind for each in kinds for kind in ((int, float) if each is float else (each,)))


class ResultCache:
    """Per-example results, one JSON line each, appended as they come so an interrupted run resumes."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[str, MethodResult] = {}
        if path.is_file():
            data = path.read_bytes()
            for line in data.decode("utf-8", errors="replace").splitlines():
                # a line cut by a run killed mid-write, damaged, or of an older layout, is recomputed
                try:
                    entry = json.loads(line)
                    self.records[entry["key"]] = MethodResult.from_record(entry["result"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
            if data and not data.endswith(b"\n"):  # the next record would be glued to that cut line, and lost
                with path.open("ab") as f:
                    f.write(b"\n")

    @staticmethod
    def key(settings: RunSettings, prompt: ChunkedPrompt, method: str) -> str:
        """The settings, the method, the example's id and a digest of its text: an edited dataset file, or another
        file of the same name, is measured again."""
        text = json.dumps([prompt.chunks, prompt.question, prompt.answers])
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return json.dumps({**asdict(settings), "id": prompt.id, "text": digest, "method": method}, sort_keys=True)

    def get(self, key: str) -> MethodResult | None:
        return self.records.get(key)

    def put(self, key: str, result: MethodResult) -> None:
        self.records[key] = result
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "result": asdict(result)}) + "\n")


def _scalar_stats(stats: Any) -> dict:
    """A prefill's stats as a flat record of scalars (`PrefillStats.record`, or a plain dict's scalars)."""
    record = stats.record() if hasattr(stats, "record") else dict(stats or {})
    return {k: v for k, v in record.items() if isinstance(v, (int, float, str, bool)) or v is None}


class ExampleRun:
    """One example: its request, compiled once, and the reference (full prefill) every method is compared to.
    Methods with a dtype suffix run on the engine of that dtype (`engines`), on a request of its own."""

    def __init__(self, engine: Engine, prompt: ChunkedPrompt, dataset: Dataset, max_tokens: int,
                 engines: Mapping[str, Engine] | None = None):
        self.engine, self.prompt, self.dataset = engine, prompt, dataset
        self.engines = dict(engines or {})
        self.sampling = SamplingParams(max_tokens=max_tokens)
        self.request = engine.build_request(chunks=prompt.chunks, question=prompt.question)
        self.requests = {dtype: e.build_request(chunks=prompt.chunks, question=prompt.question)
                         for dtype, e in self.engines.items()}
        self.reference_logits: torch.Tensor | None = None
        self.reference_output: str | None = None
        self.reference_ttft: float | None = None

    def engine_for(self, method: str) -> tuple[Engine, Any, str]:
        """The engine, request and plain method name `method` runs with."""
        name, dtype = split_dtype(method)
        if dtype is None:
            return self.engine, self.request, name
        if dtype not in self.engines:
            raise MethodSpecError(f"--methods: {method!r} needs an engine in {dtype}, and none was loaded")
        return self.engines[dtype], self.requests[dtype], name

    def compile(self, methods: list[str]) -> None:
        """Each engine compiles the chunks its methods need."""
        by_dtype: dict[str | None, list[str]] = {}
        for method in methods:
            by_dtype.setdefault(split_dtype(method)[1], []).append(method)
        for dtype_methods in by_dtype.values():
            engine, request, _ = self.engine_for(dtype_methods[0])
            engine.compile(request, methods=[split_dtype(m)[0] for m in dtype_methods])

    def _sampling(self) -> SamplingParams:
        """Only an output's first line is scored where the dataset says so: stop at the end of that line."""
        return replace(self.sampling, stop=["\n"]) if self.dataset.first_line else self.sampling

    def use_cached_reference(self, cached: MethodResult) -> None:
        """Full prefill's first-token logits are not cached (a vocabulary-sized vector per example), so they
        are recomputed whenever another method of this example still has to run; that prefill's TTFT is what the
        methods measured now are compared with (the cached row's came from another run)."""
        out = self.engine.prefill(self.request, method=REFERENCE, extra_capacity=self.sampling.max_tokens)
        self.reference_logits, self.reference_output, self.reference_ttft = out.logits, cached.output, float(out.ttft)

    def measure(self, method: str) -> MethodResult:
        """One prefill serves the generation and, from a copy of its cache, the gold answer's likelihood."""
        engine, request, name = self.engine_for(method)
        answer_ids = engine.answer_ids(self.prompt.answers[0])
        started = time.perf_counter()
        out = engine.prefill(request, method=name, extra_capacity=self.sampling.max_tokens)
        gold_cache = out.cache.clone()
        generation = engine.generate_after(out, self._sampling(), started, request)
        if self.dataset.first_line and not generation.text.lstrip("\n"):
            # the model opened with a newline, where the first-line stop cut it: generate the whole budget
            generation = engine.generate(request, method=name, sampling=self.sampling)
        output = first_line(generation.text) if self.dataset.first_line else generation.text.strip()
        if method == REFERENCE:
            self.reference_logits, self.reference_output, self.reference_ttft = out.logits, output, float(out.ttft)
        logprobs = engine.teacher_forced_logprobs(out.logits, gold_cache, answer_ids)
        stats = _scalar_stats(out.stats)
        return MethodResult(
            example_id=self.prompt.id,
            method=method,
            score=task_score(self.prompt.task, output, self.prompt.answers),
            agreement=agreement(self.reference_output, output),
            gold_loglik=mean_log_likelihood(logprobs),
            first_token_kl=first_token_kl(self.reference_logits, out.logits),
            ttft=float(out.ttft),
            # of the reused chunk rows: none for a method that reused none (full, prefix), not 0
            recompute_share=stats.get("recompute_share") if stats.get("reused_tokens") else None,
            output=output,
            stats=stats,
            reference_ttft=self.reference_ttft,
        )


def run(
    engine: Engine,
    dataset: Dataset,
    methods: list[str],
    settings: RunSettings,
    cache: ResultCache,
    progress: bool = True,
    engines: Mapping[str, Engine] | None = None,
) -> list[MethodResult]:
    """Evaluate `methods` (full first) on every prompt, skipping what `cache` holds already. `engines`: by dtype,
    the engines that run methods named `method@dtype`."""
    assert methods[0] == REFERENCE, "full prefill must run first: it is every other method's reference"
    results: list[MethodResult] = []
    warmed = False
    with ProgressBar(progress, f"eval {dataset.name}", len(dataset.prompts) * len(methods)) as bar:
        for prompt in dataset.prompts:
            keys = {m: ResultCache.key(settings, prompt, m) for m in methods}
            todo = [m for m in methods if cache.get(keys[m]) is None or _chosen_at_run_time(m)]
            bar.advance(len(methods) - len(todo), f"{prompt.id}: cached")
            if todo:
                bar.advance(0, f"{prompt.id}: compile")
                example = ExampleRun(engine, prompt, dataset, settings.max_tokens, engines)
                example.compile(todo)
                if not warmed:  # the first prefill of every engine pays one-off costs; keep them out of TTFT
                    for method in _warm_up_methods(methods, engines or {}):
                        warm, request, name = example.engine_for(method)
                        warm.prefill(request, method=name)
                    warmed = True
                if REFERENCE not in todo:  # otherwise measuring full, first in `todo`, sets the reference
                    example.use_cached_reference(cache.get(keys[REFERENCE]))
                for method in todo:
                    bar.advance(0, f"{prompt.id}: {method}")
                    cache.put(keys[method], example.measure(method))
                    bar.advance(1)
            results += [cache.get(keys[m]) for m in methods]
    return results


def runs_missing_chunks(results: list[MethodResult]) -> list[MethodResult]:
    """Runs that found fewer of their example's chunks stored than were compiled just before (a store too small
    for one example's chunks evicts some before they are read): a reuse method's figures there are partly full
    prefill's."""
    return [r for r in results if r.stats.get("chunk_hits", 0) < r.stats.get("chunks", 0)]


def _chosen_at_run_time(method: str) -> bool:
    """An auto method: what it runs depends on the fidelity table and machine profile of the moment, which the
    resume cache's key does not hold (a table built since made a cached row stale), so it is measured every run."""
    return isinstance(parse_method(split_dtype(method)[0]), Auto)


def _warm_up_methods(methods: list[str], engines: Mapping[str, Engine]) -> set[str]:
    """Full prefill on every engine, and each auto method: an engine's first auto request measures the machine
    profile its controller lacks (seconds), which must not count as that request's TTFT."""
    autos = {m for m in methods if _chosen_at_run_time(m)}
    return {REFERENCE, *(f"{REFERENCE}@{dtype}" for dtype in engines), *autos}


class ProgressBar:
    """A rich progress bar on stderr, advanced per (example, method) since one example can take minutes;
    a no-op when disabled."""

    def __init__(self, enabled: bool, description: str, total: int):
        self.bar, self.description = None, description
        if enabled:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True))
            self.task = self.bar.add_task(description, total=total)

    def __enter__(self) -> ProgressBar:
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()

    def advance(self, steps: int, status: str | None = None) -> None:
        if self.bar:
            description = f"{self.description} {status}" if status else None
            self.bar.update(self.task, advance=steps, description=description)


@dataclass
class MethodSummary:
    method: str
    examples: int
    score: float
    agreement: float
    gold_loglik: float
    first_token_kl: float
    recompute_share: float | None
    ttft_mean: float
    ttft_median: float
    ttft_p90: float
    speedup: float  # full's median TTFT / this method's, over the same examples of the same run
    speedup_mean: float  # the mean over examples of full's TTFT / this method's on the same example
    above_floor: float  # share of examples whose first-token KL exceeds the floor (a per-request bound, not a mean)


def _percentile(values: list[float], q: float) -> float:
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


def aggregate(results: list[MethodResult], methods: list[str], floor: float = DEFAULT_MAX_KL) -> list[MethodSummary]:
    """Per method; `floor`: the first-token KL a request may reach (auto's default floor unless given)."""
    by_method = {m: [r for r in results if r.method == m] for m in methods}
    cached_reference = {r.example_id: r.ttft for r in by_method[REFERENCE]}
    summaries = []
    for method, rows in by_method.items():
        shares = [r.recompute_share for r in rows if r.recompute_share is not None]
        ttfts = [r.ttft for r in rows]
        references = [cached_reference[r.example_id] if r.reference_ttft is None else r.reference_ttft for r in rows]
        summaries.append(
            MethodSummary(
                method=method,
                examples=len(rows),
                score=statistics.fmean(r.score for r in rows),
                agreement=statistics.fmean(r.agreement for r in rows),
                gold_loglik=statistics.fmean(r.gold_loglik for r in rows),
                first_token_kl=statistics.fmean(r.first_token_kl for r in rows),
                recompute_share=statistics.fmean(shares) if shares else None,
                ttft_mean=statistics.fmean(ttfts),
                ttft_median=statistics.median(ttfts),
                ttft_p90=_percentile(ttfts, 0.9),
                speedup=statistics.median(references) / statistics.median(ttfts),
                speedup_mean=statistics.fmean(reference / r.ttft for reference, r in zip(references, rows)),
                above_floor=sum(r.first_token_kl > floor for r in rows) / len(rows),
            )
        )
    return summaries
