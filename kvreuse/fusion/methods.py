"""The reuse methods, each a small policy that fills a fusion plan.

    full            recompute everything (the quality reference)
    prefix          reuse only the exact prefix; compute the rest (what vLLM's prefix caching gives)
    naive           reuse every stored chunk as is; compute fresh tokens only
    cacheblend:r    layer 0 in full, then keep recomputing the r share of chunk tokens whose KV deviates most
                    (gradual filtering: a little more than r at the first check layer, r from the second on)
    legolink:k      recompute the first k tokens of every chunk (their attention sinks), but a leading one;
                    legolink:k:recent=n also recomputes the chunk rows among the last n before the question
    legolink0       chunks compiled behind dummy tokens, so they carry no sink; compute fresh tokens only
    cachetune:r     recompute, from layer 0 on, the r share of each chunk's tokens ranked highest offline by
                    its low-pass frequency score; transfer only the other rows (sparse transfer)
    guarded:d       layer 0 in full, then keep recomputing the most deviating chunk tokens until the deviation
                    left on the others is at most d of the stored KV's energy (default 5e-4): a share set per
                    request by how strongly its chunks interact, up to every token (full prefill's output)
    guarded-query:d guarded, with each token's deviation weighted by the attention the question pays it at the
                    check layer (default 2e-3)
                    guarded:d:sinks=k:recent=n also recomputes, whatever their deviation, the first k tokens of
                    every moved chunk and the chunk rows among the last n before the question; :examples=n
                    recomputes, when the chunks are solved examples the question ends like (few-shot), the sinks
                    and the chunk rows among the last n before the question instead of the deviating rows
    auto[:floor]    the fastest of the above whose expected fidelity meets the floor (kvreuse.controller.auto):
                    auto:0.1 or auto:kl=0.1 bounds the first-token KL (default 0.15), auto:agreement=0.6 the
                    agreement with full prefill's output
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvreuse.fusion.plan import FusionPlan, Narrowing, PlacedSegment, plan_from_rows
from kvreuse.fusion.segments import Request, SegmentKind
from kvreuse.store.keys import compile_mode

LEGOLINK0_DUMMY_TOKENS = 4
# Measured to keep at most 10% of examples above first-token KL 0.15 at 2x or more over full prefill on
# 2wikimqa, hotpotqa and SAMSum (docs/RESULTS.md, "Faithful by default").
DEFAULT_METHOD = "guarded:3.5e-4:sinks=4:examples=448"


@dataclass(frozen=True)
class Method:
    """Base policy: the exact-prefix-aware plans share `plan_from_rows`; subclasses choose recomputed rows."""

    name: str
    compile_mode: str = "plain"
    needs_ranking = False  # whether plans read the stored per-token ranking
    restores_prefix = True  # whether the exact prefix's stored blocks are restored before the plan runs

    def plan(self, request: Request, placed: list[PlacedSegment]) -> FusionPlan:
        return plan_from_rows(self.name, request, placed, self.recompute(placed))

    def recompute(self, placed: list[PlacedSegment]) -> dict[int, torch.Tensor]:
        return {}


@dataclass(frozen=True)
class Full(Method):
    restores_prefix = False

    def plan(self, request: Request, placed: list[PlacedSegment]) -> FusionPlan:
        return plan_from_rows(self.name, request, placed, reuse=False)


@dataclass(frozen=True)
class PrefixOnly(Method):
    def plan(self, request: Request, placed: list[PlacedSegment]) -> FusionPlan:
        exact_only = [p if p.segment.kind == SegmentKind.PREFIX else PlacedSegment(p.segment) for p in placed]
        return plan_from_rows(self.name, request, exact_only)


def _chunk_hits(placed: list[PlacedSegment]) -> list[tuple[int, PlacedSegment]]:
    return [(i, p) for i, p in enumerate(placed) if p.reusable and p.segment.kind == SegmentKind.CHUNK]


def _every_chunk_row(placed: list[PlacedSegment]) -> dict[int, torch.Tensor]:
    """Every row of every stored chunk: what a method recomputing layer 0 in full starts from."""
    return {i: torch.arange(len(p.segment.token_ids)) for i, p in _chunk_hits(placed)}


def sink_rows(placed: list[PlacedSegment], sink_tokens: int) -> dict[int, torch.Tensor]:
    """The first `sink_tokens` of every chunk that moved: compiled alone, a chunk's first tokens are its own
    attention sink, which the prompt it is placed in does not have. A chunk starting the prompt sits where it was
    compiled: its sink is the real one."""
    return {i: torch.arange(min(sink_tokens, len(p.segment.token_ids)))
            for i, p in _chunk_hits(placed) if p.segment.start > 0 and sink_tokens}


def recent_rows(placed: list[PlacedSegment], recent_tokens: int) -> dict[int, torch.Tensor]:
    """The stored chunks' rows among the last `recent_tokens` rows before the question (the end of the last
    chunk). The question attends most to what is nearest it, and a few-shot prompt's answer copies the format
    of its last examples: on SAMSum, recomputing its last chunk alone halved first-token KL."""
    hits = _chunk_hits(placed)
    chunk_ends = [p.segment.start + len(p.segment.token_ids) for p in placed if p.segment.kind == SegmentKind.CHUNK]
    if not hits or not recent_tokens:
        return {}
    first = max(chunk_ends) - recent_tokens
    return {i: torch.arange(max(0, first - p.segment.start), len(p.segment.token_ids))
            for i, p in hits if p.segment.start + len(p.segment.token_ids) > first}


# The question's last tokens that, found in most chunks, mark them as solved examples (see `answers_like_examples`).
CUE_TOKENS = 2


def answers_like_examples(request: Request, placed: list[PlacedSegment]) -> bool:
    """Whether the question ends the way at least half of the stored chunks do somewhere inside them: the chunks
    are solved examples whose format the answer will continue ('Dialogue: ... Summary:' in every example of a
    few-shot prompt and in the question), not passages to look facts up in. Then the answer copies the examples
    nearest it, whose recomputed rows help, while the rows whose stored KV deviates most do not (on SAMSum they
    move first-token KL further from full prefill than loading them as stored: docs/RESULTS.md)."""
    cue = request.question_ending(CUE_TOKENS)
    chunks = [p.segment.token_ids for _, p in _chunk_hits(placed)]
    if len(cue) < CUE_TOKENS or len(chunks) < 2:
        return False
    holding = sum(any(ids[i : i + len(cue)] == cue for i in range(len(ids) - len(cue) + 1)) for ids in chunks)
    return 2 * holding >= len(chunks)


def _union(*selections: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    merged: dict[int, torch.Tensor] = {}
    for selection in selections:
        for i, rows in selection.items():
            merged[i] = torch.cat([merged[i], rows]).unique() if i in merged else rows
    return merged


@dataclass(frozen=True)
class LegoLink(Method):
    sink_tokens: int = 16
    recent_tokens: int = 0

    def recompute(self, placed: list[PlacedSegment]) -> dict[int, torch.Tensor]:
        return _union(sink_rows(placed, self.sink_tokens), recent_rows(placed, self.recent_tokens))


def shares_of(sizes: list[int], ratio: float) -> list[int]:
    """`ratio` of all the rows (halves rounded up), split across chunks in proportion to their sizes by largest
    remainder: a short chunk's share is not rounded away on its own, so the request recomputes its ratio."""
    quotas = [ratio * n for n in sizes]
    counts = [math.floor(q) for q in quotas]
    total = math.floor(ratio * sum(sizes) + 0.5)
    largest_remainder_first = sorted(range(len(sizes)), key=lambda i: counts[i] - quotas[i])
    for i in largest_remainder_first[: total - sum(counts)]:
        counts[i] += 1
    return counts


@dataclass(frozen=True)
class CacheTune(Method):
    ratio: float = 0.15
    needs_ranking = True

    def recompute(self, placed: list[PlacedSegment]) -> dict[int, torch.Tensor]:
        missing = [p.segment.start for _, p in _chunk_hits(placed) if p.ranking is None]
        if missing:
            raise ValueError(f"cachetune needs the frequency ranking stored with each chunk (none at row {missing[0]})")
        hits = _chunk_hits(placed)
        counts = shares_of([p.ranking.numel() for _, p in hits], self.ratio)
        return {i: p.ranking.topk(count).indices for (i, p), count in zip(hits, counts)}


@dataclass(frozen=True)
class CacheBlend(Method):
    ratio: float = 0.15
    check_layers: tuple[int, ...] = (1, 2)
    first_check_factor: float = 1.5  # gradual filtering: keep this many times r at the first check layer

    def plan(self, request: Request, placed: list[PlacedSegment]) -> FusionPlan:
        # layer 0 is recomputed in full, but the check layers compare against every stored row
        return plan_from_rows(
            self.name, request, placed, _every_chunk_row(placed), narrowing=self.schedule(), load_recomputed=True
        )

    def schedule(self) -> list[Narrowing]:
        first = min(1.0, self.ratio * self.first_check_factor)
        keeps = [first] + [self.ratio] * (len(self.check_layers) - 1)
        return [Narrowing(layer, keep) for layer, keep in zip(self.check_layers, keeps)]


@dataclass(frozen=True)
class Guarded(Method):
    """CacheBlend's layer-0 recompute and deviation check at layer 1, with the kept rows chosen by the deviation
    left on the dropped ones (Narrowing.max_residual) instead of a fixed ratio. With `example_window`, a prompt
    whose chunks are solved examples (`answers_like_examples`) recomputes the chunk rows among the last
    `example_window` before the question instead of the deviating ones."""

    max_residual: float = 5e-4
    check_layer: int = 1
    query_aware: bool = False
    sink_tokens: int = 0  # pinned: recomputed whatever their deviation (see sink_rows and recent_rows)
    recent_tokens: int = 0
    example_window: int = 0

    def plan(self, request: Request, placed: list[PlacedSegment]) -> FusionPlan:
        if self.example_window and answers_like_examples(request, placed):
            rows = _union(sink_rows(placed, self.sink_tokens), recent_rows(placed, self.example_window))
            return plan_from_rows(self.name, request, placed, rows)
        check = Narrowing(self.check_layer, 0.0, self.max_residual, self.query_aware)
        pinned = _union(sink_rows(placed, self.sink_tokens), recent_rows(placed, self.recent_tokens))
        return plan_from_rows(self.name, request, placed, _every_chunk_row(placed), narrowing=[check],
                              load_recomputed=True, pinned=pinned)


DEFAULT_MAX_KL = 0.15


@dataclass(frozen=True)
class Auto(Method):
    """Not a plan policy but a quality floor: the engine's controller replaces it, per request, by a method."""

    max_kl: float | None = DEFAULT_MAX_KL
    min_agreement: float | None = None

    def plan(self, request: Request, placed: list[PlacedSegment]) -> FusionPlan:
        raise RuntimeError("method auto must be resolved to a method by the engine's controller before planning")


def _auto(spec: str, arg: str) -> Auto:
    if not arg:
        return Auto(spec)
    measure, named, value = arg.rpartition("=")
    bound = _positive(spec, value)
    if measure == "kl" or not named:
        return Auto(spec, max_kl=bound)
    if measure == "agreement":
        if bound > 1:
            raise ValueError(f"method {spec}: an agreement floor is at most 1, got {bound}")
        return Auto(spec, max_kl=None, min_agreement=bound)
    raise ValueError(f"method {spec}: a floor is kl=X or agreement=X, got {measure!r}")


# A decimal as a method spec writes one: ASCII digits, an optional point and exponent. float() alone also takes
# '0_1' (digit grouping: 0.1 read as 1, a full recompute), full-width digits and 'inf'.
DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)


def _decimal(text: str) -> float | None:
    return float(text) if DECIMAL.fullmatch(text) else None


def _positive(spec: str, text: str) -> float:
    value = _decimal(text)
    if value is None:
        raise ValueError(f"method {spec}: floor {text!r} is not a number")
    if not value > 0:
        raise ValueError(f"method {spec}: floor must be positive, got {value}")
    return value


def _unit(name: str, text: str, what: str = "ratio") -> float:
    """A parameter in [0, 1]: a ratio, or guarded's residual."""
    value = _decimal(text)
    if value is None:
        raise ValueError(f"method {name}: {what} {text!r} is not a number")
    if not 0 <= value <= 1:
        raise ValueError(f"method {name}: {what} must be in [0, 1], got {value}")
    return value


def _count(name: str, text: str) -> int:
    if not (text.isascii() and text.isdigit()):  # str.isdigit alone takes '²' (which int() refuses) and '١٦'
        raise ValueError(f"method {name}: token count {text!r} must be a whole number >= 0")
    return int(text)


def _options(name: str, arg: str, allowed: tuple[str, ...]) -> tuple[str, dict[str, int]]:
    """'16:recent=192' -> ('16', {'recent': 192}): the main parameter, then named token counts."""
    main, *named = arg.split(":")
    options = {}
    for option in named:
        key, found, value = option.partition("=")
        if not found or key not in allowed:
            known = ", ".join(f"{a}=N" for a in allowed)
            raise ValueError(f"method {name}: unknown option {option!r}; options: {known}")
        if key in options:
            raise ValueError(f"method {name}: option {key} given twice")
        options[key] = _count(name, value)
    return main, options


def _legolink(spec: str, arg: str) -> LegoLink:
    sinks, options = _options("legolink", arg, ("recent",))
    return LegoLink(spec, sink_tokens=_count("legolink", sinks or "16"), recent_tokens=options.get("recent", 0))


def _guarded(name: str, default: str, query_aware: bool = False):
    def make(spec: str, arg: str) -> Guarded:
        residual, options = _options(name, arg, ("sinks", "recent", "examples"))
        return Guarded(spec, max_residual=_unit(name, residual or default, "residual"), query_aware=query_aware,
                       sink_tokens=options.get("sinks", 0), recent_tokens=options.get("recent", 0),
                       example_window=options.get("examples", 0))
    return make


METHODS = {
    "full": lambda spec, arg: Full(spec),
    "prefix": lambda spec, arg: PrefixOnly(spec),
    "naive": lambda spec, arg: Method(spec),
    "legolink0": lambda spec, arg: Method(spec, compile_mode(LEGOLINK0_DUMMY_TOKENS)),
    "legolink": _legolink,
    "cacheblend": lambda spec, arg: CacheBlend(spec, ratio=_unit("cacheblend", arg or "0.15")),
    "cachetune": lambda spec, arg: CacheTune(spec, ratio=_unit("cachetune", arg or "0.15")),
    "guarded": _guarded("guarded", "5e-4"),
    "guarded-query": _guarded("guarded-query", "2e-3", query_aware=True),
    "auto": _auto,
}
TAKES_ARGUMENT = {"legolink", "cacheblend", "cachetune", "guarded", "guarded-query", "auto"}


def parse_method(spec: str | None) -> Method:
    """'cacheblend:0.15' -> CacheBlend(ratio=0.15); the parameter may be omitted for its default."""
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"method: expected a method name such as 'cacheblend:0.15', got {spec!r}")
    spec = DEFAULT_METHOD if spec is None else spec.strip()
    if not spec:
        raise ValueError("method: empty; expected a method name such as 'cacheblend:0.15' (None for the default)")
    name, _, arg = spec.partition(":")
    if name not in METHODS:
        raise ValueError(f"method: unknown method {name!r}; known: {', '.join(METHODS)}")
    if arg and name not in TAKES_ARGUMENT:
        raise ValueError(f"method: {name} takes no parameter, got {spec!r}")
    return METHODS[name](spec, arg)


def parse_method_list(spec: str, check: Callable[[str], object] = parse_method) -> list[str]:
    """'naive,cacheblend:0.15' -> ['full', 'naive', 'cacheblend:0.15']: the methods a comparison runs, full always
    there and first (the reference). Each entry is checked (by default by the engine's own parser), so a typo
    fails before any model loads."""
    methods = [m.strip() for m in spec.split(",")]
    for method in methods:
        if not method:
            raise ValueError(f"--methods: empty entry in {spec!r}; expected e.g. full,naive,cacheblend:0.15")
        try:
            check(method)
        except ValueError as e:
            raise ValueError(f"--methods: {e}") from None
    duplicates = sorted({m for m in methods if methods.count(m) > 1})
    if duplicates:
        raise ValueError(f"--methods: {', '.join(duplicates)} listed more than once")
    return ["full"] + [m for m in methods if m != "full"]
