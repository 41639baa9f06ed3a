"""The engine's token log-probabilities in the API's two forms: chat's (a list of tokens, each with its
alternatives) and the completions API's older one (parallel lists, alternatives keyed by their text).

A token's text is what it decodes to alone, as vLLM reports it: a byte-level token holding part of a character
reads as U+FFFD."""

from __future__ import annotations

from collections.abc import Sequence

from kvreuse.engine.sampling import TokenLogprob
from kvreuse.server import protocol


class TokenTexts:
    """Token ids to their text, remembered: a stream asks for the same few thousand ids again and again."""

    def __init__(self, tokenizer):
        self._decode = tokenizer.decode
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._decode([token])
        return text

    def top(self, token: int, logprob: float) -> protocol.TopLogprob:
        text = self(token)
        return protocol.TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> protocol.ChatLogprobs:
    return protocol.ChatLogprobs(content=[
        protocol.ChatTokenLogprob(**texts.top(e.token, e.logprob).model_dump(),
                              top_logprobs=[texts.top(token, logprob) for token, logprob in e.top])
        for e in entries])


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int
                        ) -> protocol.CompletionLogprobs:
    """`offset`: where the first entry's text starts in the choice's whole text (a stream's earlier chunks)."""
    tokens = [texts(e.token) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return protocol.CompletionLogprobs(
        text_offset=offsets, token_logprobs=[e.logprob for e in entries], tokens=tokens,
        top_logprobs=[{**{texts(token): logprob for token, logprob in e.top}, texts(e.token): e.logprob}
                      for e in entries])
