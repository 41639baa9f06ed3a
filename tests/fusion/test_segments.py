"""How requests are laid out as segments: a chat template split around the user's text, a base model's plain-text
prompt."""

from __future__ import annotations

import pytest

from kvreuse.fusion.segments import SENTINEL, Request, Segment, SegmentKind, build_request, chat_request, chunk_ids


class BaseModelTokenizer:
    """A tokenizer with no chat template (a base model's), one id per byte and a BOS of its own."""

    chat_template = None
    bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 3 for b in text.encode()]


def test_a_base_model_gets_bos_and_plain_paragraphs_instead_of_a_chat_template():
    tokenizer = BaseModelTokenizer()
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    request = chat_request(tokenizer, history, [[10, 11], [12]], "Q?\nAnswer:")
    kinds = [s.kind for s in request.segments]
    assert kinds == [SegmentKind.PREFIX, SegmentKind.CHUNK, SegmentKind.CHUNK, SegmentKind.FRESH]
    assert request.segments[0].token_ids == [1, *tokenizer.encode("Be brief.\n\nHi\n\n")]
    assert request.segments[-1].token_ids == tokenizer.encode("Q?\nAnswer:")  # no template tail after it
    assert chat_request(tokenizer, [], [[10]], "Q").segments[0].token_ids == [1]


class ChatTokenizer(BaseModelTokenizer):
    """The byte tokenizer with a chat template whose assistant header starts with a special token (id 2)."""

    chat_template = "<chat>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        head, marker, tail = text.partition("<end>")
        return super().encode(head) + ([2, *super().encode(tail)] if marker else [])

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        return "".join(f"[{m['role']}] {m['content']}" for m in messages) + "<end>assistant:"


def test_the_question_ending_stops_before_the_chat_templates_tail():
    tokenizer = ChatTokenizer()
    request = chat_request(tokenizer, [], [[10, 11]], "Q?\nAnswer:")
    assert request.template_tail == len(tokenizer.encode("<end>assistant:"))
    assert request.question_ending(3) == tokenizer.encode("er:")
    plain = chat_request(BaseModelTokenizer(), [], [[10]], "Q?\nAnswer:")
    assert (plain.template_tail, plain.question_ending(2)) == (0, BaseModelTokenizer().encode("r:"))


def test_an_earlier_turn_quoting_the_template_sentinel_stays_in_the_prefix():
    tokenizer = ChatTokenizer()
    history = [{"role": "user", "content": f"pasted {SENTINEL} text"}, {"role": "assistant", "content": "ok"}]
    request = chat_request(tokenizer, history, [], "the question")
    assert request.segments[0].token_ids == tokenizer.encode(f"[user] pasted {SENTINEL} text[assistant] ok[user] ")
    assert request.segments[-1].token_ids == tokenizer.encode("the question<end>assistant:")


def test_a_chunk_ends_with_the_separator_tokenized_with_it(embedded_tokenizer):
    """'\n\n' tokenized with the chunk (one token on SmolLM2), not as the joined text has it before a word ('\n',
    '\n'): the two-token form made every reuse method stray further from full prefill (chunk_ids)."""
    assert chunk_ids(embedded_tokenizer, "Paris.") == embedded_tokenizer.encode("Paris.\n\n", add_special_tokens=False)
    assert build_request(embedded_tokenizer, ["Paris.", "Berlin."], "Which?").segments[1].token_ids[-1:] == \
        embedded_tokenizer.encode("\n\n", add_special_tokens=False)


def test_token_ids_that_are_not_whole_numbers_are_refused_not_cut():
    with pytest.raises(TypeError, match="chunk segment at position 2 must be whole numbers, got torch.float32"):
        Request([Segment(SegmentKind.FRESH, [3, 4]), Segment(SegmentKind.CHUNK, [1.7, 2.2])])
