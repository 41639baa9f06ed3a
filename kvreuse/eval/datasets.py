"""Benchmark JSONL files turned into chunked prompts: reusable chunks, then fresh text (instruction + question).

The prompt conventions are fixed so that numbers stay comparable across runs and with the papers (see the
datasets' README): one chunk per passage for multi-document QA, one chunk per solved example for few-shot
SAMSum (as in LongBench). The files are read from a path given by the caller; the package ships none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

Task = Literal["qa", "summary"]

QA_INSTRUCTION = (
    "Answer the question based on the given passages. "
    "Only give me the answer and do not output any other words."
)
SAMSUM_INSTRUCTION = "Summarize the dialogue into a few short sentences, as in the examples above."
MULTINEWS_INSTRUCTION = "You are given several news passages above. Write a one-page summary of all the news."
# About 1.7K tokens of context with SmolLM2's tokenizer (a solved example averages 167 tokens).
SAMSUM_SHOTS = 10


class DatasetError(ValueError):
    """A dataset file is missing, malformed or of a schema this harness does not know."""


@dataclass(frozen=True)
class ChunkedPrompt:
    id: str
    chunks: list[str]  # reusable: each one is tokenized and cached on its own
    question: str  # fresh text placed after the chunks, instruction included
    answers: list[str]  # gold answers (QA) or reference summaries
    task: Task


@dataclass(frozen=True)
class Dataset:
    name: str
    task: Task
    prompts: list[ChunkedPrompt]
    max_tokens: int  # default generation budget (LongBench's: 32 for QA, 128 SAMSum, 512 Multi-News)
    first_line: bool  # score only the output's first line (as LongBench does for QA and SAMSum)


@dataclass(frozen=True)
class Chunking:
    """How a context is cut into reusable chunks: its natural pieces, or pieces of `size` tokens."""

    size: int | None = None  # None: one chunk per passage / solved example

    @classmethod
    def parse(cls, spec: str) -> Chunking:
        if spec == "passage":
            return cls()
        match = re.fullmatch(r"fixed:(\d+)", spec)
        if not match or int(match[1]) < 1:
            raise DatasetError(f"chunking {spec!r} is neither 'passage' nor 'fixed:N' with N >= 1 tokens")
        return cls(int(match[1]))


def fixed_chunks(text: str, size: int, tokenizer) -> list[str]:
    """Cut `text` every `size` tokens. The pieces are exact substrings (cut at token offsets, not decoded),
    stripped because the engine puts its own separator after every chunk."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    starts = [offsets[i][0] for i in range(0, len(offsets), size)] + [len(text)]
    pieces = (text[a:b].strip() for a, b in zip(starts, starts[1:]))
    return [p for p in pieces if p]


def _chunk(pieces: list[str], chunking: Chunking, tokenizer) -> list[str]:
    """Natural pieces as they are, or all of them joined and cut into fixed-size token pieces."""
    if chunking.size is None:
        return pieces
    return fixed_chunks("\n\n".join(pieces), chunking.size, tokenizer)


class _Example(NamedTuple):
    id: str
    pieces: list[str]  # the context's natural pieces: passages, solved examples, a whole document
    question: str
    answers: list[str]


def _qa_examples(rows: list[dict]) -> list[_Example]:
    return [
        _Example(
            row["id"],
            [f"Passage {i}: {p['title']}\n{p['text']}" for i, p in enumerate(row["passages"], 1)],
            f"{QA_INSTRUCTION}\n\nQuestion: {row['question']}\nAnswer:",
            list(row["answers"]),
        )
        for row in rows
    ]


def _samsum_examples(rows: list[dict]) -> list[_Example]:
    """Test dialogue k gets the solved examples k*SHOTS .. k*SHOTS+SHOTS-1 of the train+validation pool
    (wrapping around): fixed, yet not the same few shots for every question."""
    shots = [f"Dialogue: {r['dialogue']}\nSummary: {r['summary']}" for r in rows if r["split"] != "test"]
    tests = [r for r in rows if r["split"] == "test"]
    if len(shots) < SAMSUM_SHOTS:
        raise DatasetError(f"SAMSum needs at least {SAMSUM_SHOTS} train/validation rows, found {len(shots)}")
    return [
        _Example(
            row["id"],
            [shots[(k * SAMSUM_SHOTS + j) % len(shots)] for j in range(SAMSUM_SHOTS)],
            f"{SAMSUM_INSTRUCTION}\n\nDialogue: {row['dialogue']}\nSummary:",
            [row["summary"]],
        )
        for k, row in enumerate(tests)
    ]


def _multinews_examples(rows: list[dict]) -> list[_Example]:
    """The articles of a cluster are concatenated without a separator, so 'passage' chunking keeps the
    whole document as one chunk; 'fixed:N' is the useful setting here."""
    question = f"{MULTINEWS_INSTRUCTION}\n\nSummary:"
    return [_Example(row["id"], [row["document"]], question, [row["summary"]]) for row in rows]


def _text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _texts(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(map(_text, value))


def _passages(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(p, dict) and isinstance(p.get("title"), str) and _text(p.get("text")) for p in value)


@dataclass(frozen=True)
class _Schema:
    fields: dict[str, tuple[Callable[[object], bool], str]]  # each field's check, and what it must be
    task: Task
    max_tokens: int
    first_line: bool
    examples: Callable[[list[dict]], list[_Example]]

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self.fields)

    def problem(self, row: dict) -> str | None:
        """What is wrong with a row of this schema, or None."""
        missing = sorted(self.keys - set(row))
        if missing:
            return f"row lacks field(s) {', '.join(missing)}"
        for name, (check, what) in self.fields.items():
            if not check(row[name]):
                return f"{name} must be {what}, got {json.dumps(row[name])[:80]}"
        return None


_ID = (lambda v: isinstance(v, (str, int)) and not isinstance(v, bool) and str(v).strip() != "", "a string or number")
_TEXT = (_text, "non-empty text")

# Recognised by the fields of the first row; the most specific schema comes first.
SCHEMAS = {
    "qa": _Schema({"id": _ID, "question": _TEXT, "answers": (_texts, "a non-empty list of non-empty texts"),
                   "passages": (_passages, 'a non-empty list of {"title": ..., "text": ...} objects')},
                  "qa", 32, True, _qa_examples),
    "samsum": _Schema({"id": _ID, "split": _TEXT, "dialogue": _TEXT, "summary": _TEXT},
                      "summary", 128, True, _samsum_examples),
    "multinews": _Schema({"id": _ID, "document": _TEXT, "summary": _TEXT}, "summary", 512, False, _multinews_examples),
}


def _numbered_rows(path: Path) -> list[tuple[int, object]]:
    """The file's rows with their line numbers (blank lines skipped)."""
    if path.is_dir():
        raise DatasetError(f"dataset file {str(path)!r} is a folder: name a JSONL file in it")
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    rows = []
    with path.open("rb") as f:  # decoded line by line, so that a line that is not UTF-8 is named
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM some editors write first
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{number}: not UTF-8 text (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise DatasetError(f"{path}:{number}: JSON nested too deeply") from None
    if not rows:
        raise DatasetError(f"dataset file {str(path)!r} holds no rows")
    return rows


def read_jsonl(path: Path) -> list[dict]:
    return [row for _, row in _numbered_rows(path)]


def detect_schema(path: Path, rows: list[dict]) -> _Schema:
    fields = set(rows[0]) if isinstance(rows[0], dict) else set()
    for schema in SCHEMAS.values():
        if schema.keys <= fields:
            return schema
    known = "; ".join(f"{name}: {', '.join(sorted(s.keys))}" for name, s in SCHEMAS.items())
    raise DatasetError(f"{path}: unknown dataset schema (fields {', '.join(sorted(fields))}); known schemas: {known}")


def _checked_rows(path: Path) -> tuple[_Schema, list[dict]]:
    """The file's rows, each an object of one schema with fields of the right types, and no id twice."""
    numbered = _numbered_rows(path)
    schema = detect_schema(path, [row for _, row in numbered])
    seen: dict[str, int] = {}
    for line, row in numbered:
        problem = "a row must be a JSON object" if not isinstance(row, dict) else schema.problem(row)
        if problem:
            raise DatasetError(f"{path}:{line}: {problem}")
        if str(row["id"]) in seen:
            raise DatasetError(f"{path}:{line}: id {row['id']!r} is already the id of line {seen[str(row['id'])]}")
        seen[str(row["id"])] = line
    return schema, [row for _, row in numbered]


def load_dataset(
    path: str | Path, chunking: Chunking = Chunking(), tokenizer=None, limit: int | None = None
) -> Dataset:
    """Read a normalised dataset file into prompts; `limit` keeps the first rows (of the test split, for SAMSum)."""
    path = Path(path)
    schema, rows = _checked_rows(path)
    if chunking.size is not None and tokenizer is None:
        raise DatasetError("fixed-size chunking needs a tokenizer")
    prompts = [
        ChunkedPrompt(str(e.id), _chunk(e.pieces, chunking, tokenizer), e.question, e.answers, schema.task)
        for e in schema.examples(rows)[:limit]
    ]
    if not prompts:
        evaluated = "test rows" if schema is SCHEMAS["samsum"] else "rows"
        raise DatasetError(f"{path}: no examples to evaluate (no {evaluated})")
    return Dataset(path.stem, schema.task, prompts, schema.max_tokens, schema.first_line)
