"""A request as segments: an exact prefix, reusable chunks, fresh tokens.

The application says where the chunks are; each chunk is tokenized on its own, so its tokens (and so its cache
key) never depend on the text around it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import torch

WHOLE_NUMBERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # token ids as torch reads them


def outside_vocabulary(token_ids: Iterable[int] | torch.Tensor, vocab_size: int) -> int | None:
    """The first token id not in [0, vocab_size), or None: what the embedding would fail on, deep in torch."""
    if isinstance(token_ids, torch.Tensor) and (
            not token_ids.numel() or 0 <= int(token_ids.min()) <= int(token_ids.max()) < vocab_size):
        return None  # the bounds first: a prompt's thousands of ids are not walked one by one unless one is out
    return next((int(t) for t in token_ids if not 0 <= t < vocab_size), None)


class SegmentKind(str, Enum):
    PREFIX = "prefix"  # exact: same tokens at the same positions as when stored (template header, system prompt,
    # earlier turns of the conversation)
    CHUNK = "chunk"  # reusable at any position (documents, few-shot examples)
    FRESH = "fresh"  # never cached (the question, the template tail)


@dataclass
class Segment:
    kind: SegmentKind
    token_ids: list[int]
    start: int = 0  # first row (= global position) in the prompt; set by Request

    @property
    def rows(self) -> range:
        return range(self.start, self.start + len(self.token_ids))


@dataclass(eq=False)  # a request is one client's: two with equal tokens are still two requests
class Request:
    segments: list[Segment]
    # The tenant (cache salt) whose store entries the request may read and write: every key it touches is
    # derived from it, so requests of different salts never share a chunk, a prefix block or a cache.
    salt: str | None = None
    # Tokens at the end of the prompt that the chat template puts after the user's text (the assistant's header):
    # what comes before them is where the user's question ends.
    template_tail: int = 0
    token_ids: torch.Tensor = field(init=False)  # the whole prompt, [n]

    def __post_init__(self) -> None:
        if not self.segments or not self.segments[-1].token_ids:
            raise ValueError("a request must end with at least one fresh or chunk token")
        start = 0
        for segment in self.segments:
            if not segment.token_ids:
                raise ValueError(f"empty {segment.kind.value} segment at position {start}")
            segment.start = start
            start += len(segment.token_ids)
        token_ids = torch.tensor([t for s in self.segments for t in s.token_ids])
        if token_ids.dtype not in WHOLE_NUMBERS:  # dtype=long would cut 1.7 to 1 without a word
            segment = next(s for s in self.segments if torch.tensor(s.token_ids).dtype not in WHOLE_NUMBERS)
            raise TypeError(f"token ids of the {segment.kind.value} segment at position {segment.start} must be "
                            f"whole numbers, got {token_ids.dtype}")
        self.token_ids = token_ids.long()

    def __len__(self) -> int:
        return self.token_ids.numel()

    def of_kind(self, kind: SegmentKind) -> list[Segment]:
        return [s for s in self.segments if s.kind == kind]

    def question_ending(self, tokens: int) -> list[int]:
        """The last `tokens` tokens of the user's text: the cue the answer follows (e.g. 'Answer:'). Only the
        trailing fresh segment holds the user's text: an empty question has no ending, not its last chunk's."""
        last = self.segments[-1]
        if last.kind != SegmentKind.FRESH:
            return []
        end = len(self) - self.template_tail
        return self.token_ids[max(last.start, end - tokens) : end].tolist()


SENTINEL = "\x00KVREUSE_CONTENT\x00"


def split_template(tokenizer, history: list[dict]) -> tuple[str, str]:
    """The chat template's text before and after the content of a user message that follows `history` (system
    prompt, earlier turns), found by rendering it around a sentinel that cannot occur in real text (so the
    application never has to type a magic separator)."""
    messages = [*history, {"role": "user", "content": SENTINEL}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head, found, tail = rendered.rpartition(SENTINEL)  # the last: an earlier turn may quote the sentinel
    if not found:
        raise ValueError("the chat template does not place the user's content verbatim")
    return head, tail


def chunk_ids(tokenizer, text: str, chunk_separator: str = "\n\n") -> list[int]:
    """A chunk's tokens: tokenized alone, `chunk_separator` appended so chunks do not run into each other.

    Tokenized with the chunk, '\n\n' is one token on SmolLM2, where the joined text before a word has '\n', '\n':
    the prompt is not its text's tokenization at chunk boundaries. Kept on purpose: with the two-token form every
    reuse method strayed further from full prefill (hotpotqa, 15 examples: first-token KL of cacheblend:0.15 worse
    on 14, the default's on 11; docs/RESULTS.md, "The chunk separator")."""
    return tokenizer.encode(text + chunk_separator, add_special_tokens=False)


def chat_request(tokenizer, history: list[dict], chunks: list[list[int]], question: str, salt: str | None = None
                 ) -> Request:
    """[template head with `history` (system prompt, earlier turns): the exact prefix] [chunk]... [question +
    template tail]; `chunks` are token ids (see `chunk_ids`), so stored chunks can be placed by their tokens.

    A base model (a tokenizer with no chat template) gets plain text instead: [BOS, then each earlier message's
    content as a paragraph] [chunk]... [question]."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    if getattr(tokenizer, "chat_template", None) is None:
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        head_ids, tail = bos + encode("".join(f"{m['content']}\n\n" for m in history)), ""
    else:
        head, tail = split_template(tokenizer, history)
        head_ids = encode(head)
    segments = [Segment(SegmentKind.PREFIX, head_ids)]
    segments += [Segment(SegmentKind.CHUNK, list(ids)) for ids in chunks]
    fresh = encode(question + tail)
    segments.append(Segment(SegmentKind.FRESH, fresh))
    tail_ids = encode(tail) if tail else []
    # The tail counts only where the question's tokens end cleanly before it (templates open it with a special token).
    template_tail = len(tail_ids) if tail_ids and fresh[-len(tail_ids):] == tail_ids else 0
    return Request([s for s in segments if s.token_ids], salt, template_tail)


def describe(value: object) -> str:
    """A value as an error message shows what was given instead: its type, then its start."""
    return f"{type(value).__name__} {value!r}"[:80]


def build_request(
    tokenizer,
    chunks: list[str],
    question: str,
    system: str | None = None,
    chunk_separator: str = "\n\n",
    history: list[dict] | None = None,
    salt: str | None = None,
) -> Request:
    """Chat-templated request: [template head] [chunk]... [question + template tail].

    The head (system prompt and the conversation's earlier turns, `history`) is the exact prefix: as the
    conversation grows, its stored blocks are reused. Each chunk is tokenized alone (with `chunk_separator`
    appended, so chunks do not run into each other).
    """
    # A list or tuple only: an iterator checked here would be used up before the chunks are tokenized (a request
    # without them, silently), and a dict's keys or a set's order are not chunks in an order.
    if not isinstance(chunks, (list, tuple)) or not all(isinstance(c, str) for c in chunks):
        raise TypeError(f"chunks: expected a list of texts, got {describe(chunks)}")
    if not isinstance(question, str):
        raise TypeError(f"question: expected text, got {describe(question)}")
    if system is not None and not isinstance(system, str):
        raise TypeError(f"system: expected text, got {describe(system)}")
    if history is not None and not isinstance(history, (list, tuple)):
        raise TypeError(f"history: expected a list of messages, got {describe(history)}")
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"salt: expected text, got {describe(salt)}")
    if any(not c.strip() for c in chunks):
        raise ValueError("chunks: every chunk must contain text")
    if not question.strip():
        raise ValueError("question: must contain text")
    if any(not isinstance(m, dict) or not {"role", "content"} <= m.keys() or not isinstance(m["content"], str)
           for m in history or []):
        raise ValueError("history: every message must be a dict with 'role' and a text 'content'")
    messages = ([{"role": "system", "content": system}] if system else []) + list(history or [])
    return chat_request(tokenizer, messages, [chunk_ids(tokenizer, c, chunk_separator) for c in chunks], question,
                        salt)
