"""RAG prompts of a chosen length and number of chunks, built at bench time.

The text comes from a dataset file given on the command line (its passages, or solved examples, read in order)
or, without one, from seeded synthetic sentences: the product needs no data set to run its benchmark.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from itertools import cycle, islice

from kvreuse.eval.datasets import QA_INSTRUCTION, fixed_chunks, load_dataset
from kvreuse.fusion.segments import Request, SegmentKind, build_request

SYNTHETIC_WORDS = (
    "the a of to and in is was for on that with as by at from his her it an were are which this be has had "
    "river city station history population century council museum railway company album film season team "
    "village district province school church bridge island mountain festival library university army treaty "
    "built founded named located released played elected opened served known called became moved won lost"
).split()
SYNTHETIC_QUESTION = "Which of the places named in the passages above was founded first?"
WINDOW_MARGIN = 16  # tokens a prompt leaves free in the context window: the first generated token and spares


@dataclass(frozen=True)
class Shape:
    tokens: int  # target prompt length
    chunks: int


@dataclass
class Workload:
    shape: Shape
    index: int  # which prompt of this shape
    request: Request

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.token_ids.tolist()

    @property
    def exact_prefix_ids(self) -> list[int]:
        """The longest exact prefix an earlier request had computed: the template head and the first chunk, as
        the compiling request ([head][chunk]) saw them. All that prefix caching can reuse here."""
        first_chunk = next(i for i, s in enumerate(self.request.segments) if s.kind == SegmentKind.CHUNK)
        return [t for s in self.request.segments[: first_chunk + 1] for t in s.token_ids]

    @property
    def chunk_requests_ids(self) -> list[list[int]]:
        """Each chunk behind the template head: the requests that first brought the chunks in."""
        head = [t for s in self.request.of_kind(SegmentKind.PREFIX) for t in s.token_ids]
        return [head + s.token_ids for s in self.request.of_kind(SegmentKind.CHUNK)]


class TextSource:
    """Context text and questions, from a dataset's rows or synthetic; prompt `index` starts at its own row."""

    def __init__(self, dataset: str | None, seed: int = 0):
        self.prompts = load_dataset(dataset).prompts if dataset else []
        self.seed = seed
        self.name = dataset or "synthetic text"

    def context(self, index: int, min_chars: int) -> str:
        if not self.prompts:
            rng = random.Random(self.seed + index)
            words = max(1, min_chars // 5)
            return " ".join(rng.choice(SYNTHETIC_WORDS) for _ in range(words)) + "."
        pieces: list[str] = []
        rows = islice(cycle(self.prompts), index, None)
        while sum(map(len, pieces)) < min_chars:
            pieces += next(rows).chunks
        return "\n\n".join(pieces)

    def question(self, index: int) -> str:
        if not self.prompts:
            return f"{QA_INSTRUCTION}\n\nQuestion: {SYNTHETIC_QUESTION}\nAnswer:"
        return self.prompts[index % len(self.prompts)].question


def build_workload(tokenizer, source: TextSource, shape: Shape, index: int, window: int) -> Workload:
    """A prompt of about `shape.tokens` tokens (at most the window less a margin): template head, `shape.chunks`
    equal chunks of context, the question."""
    if shape.tokens < 1 or shape.chunks < 1:
        raise ValueError(f"workload shape: tokens and chunks must be >= 1, got {shape}")
    target = min(shape.tokens, window - WINDOW_MARGIN)
    question = source.question(index)
    overhead = len(build_request(tokenizer, [], question))
    per_chunk = (target - overhead) // shape.chunks - 1  # the engine appends a one-token separator to each chunk
    if per_chunk < 1:
        raise ValueError(f"lengths: {shape.tokens} tokens leave no room for {shape.chunks} chunks after the "
                         f"{overhead}-token template and question")
    # about 4 characters a token; twice that so the cut never runs out of text
    text = source.context(index, min_chars=8 * target)
    request = build_request(tokenizer, fixed_chunks(text, per_chunk, tokenizer)[: shape.chunks], question)
    # The template around chunks can take a token more than around none (the question's separator): cut again.
    while (excess := len(request) - target) > 0 and per_chunk > 1:
        per_chunk = max(1, per_chunk - math.ceil(excess / shape.chunks))
        request = build_request(tokenizer, fixed_chunks(text, per_chunk, tokenizer)[: shape.chunks], question)
    return Workload(shape, index, request)
