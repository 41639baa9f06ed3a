"""TextStream: stop conditions, streamed text that is never taken back, and text that is the whole decode's
from windows of a few tokens."""

import random

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from kvreuse.engine.generate import StopMatcher, TextStream
from kvreuse.engine.sampling import SamplingParams, TokenLogprob

EOS = 0


class CharTokenizer:
    """Token id i is the character chr(i); id 1 renders as U+FFFD unless id 2 follows (a split character)."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(chr(i) for i in ids)
        return text.replace(chr(1) + chr(2), "é").replace(chr(1), "\ufffd")


def stream(stop=(), max_tokens=50, **params) -> TextStream:
    return TextStream(CharTokenizer(), SamplingParams(max_tokens=max_tokens, stop=list(stop), **params), {EOS})


def feed(s: TextStream, text: str) -> list[str]:
    """The deltas of the text's characters as tokens, up to the one that finishes the stream."""
    deltas = []
    for ch in text:
        finished = s.add(ord(ch))
        deltas.append(s.new_text())
        if finished:
            break
    return deltas


def test_a_stop_string_cuts_the_text_and_its_start_is_never_streamed():
    s = stream(stop=["END"])
    deltas = feed(s, "abcEN")
    assert "".join(deltas) == "abc" and s.finish_reason is None  # "EN" may begin the stop string: held back
    assert s.add(ord("D")) and s.finish_reason == "stop"
    assert s.text == "abc" and s.new_text() == ""


def test_the_stop_string_that_ended_it_is_its_stop_reason_and_may_stay_in_the_text():
    s = stream(stop=["END", "xy"])
    feed(s, "abxyEND")
    assert (s.text, s.finish_reason, s.stop_reason) == ("ab", "stop", "xy")
    assert s.generation(prompt_tokens=4, ttft=0.1, total_seconds=0.2).stop_reason == "xy"
    kept = stream(stop=["END"], include_stop_str_in_output=True)
    assert "".join(feed(kept, "abENDcd")) == "abEND" and kept.stop_reason == "END"


def test_a_stop_token_ends_it_with_its_text_and_is_its_stop_reason():
    s = stream(stop_token_ids=[ord("!")])
    assert "".join(feed(s, "ab!cd")) == "ab!" and (s.finish_reason, s.stop_reason) == ("stop", ord("!"))
    s = stream()
    s.add(EOS)
    assert (s.finish_reason, s.stop_reason) == ("stop", None)  # EOS has none, as in vLLM


def test_stop_strings_are_looked_for_from_the_min_tokens_th_token_on():
    s = stream(stop=["b"], min_tokens=3)
    assert "".join(feed(s, "abcb")) == "abc" and s.token_ids == [ord(c) for c in "abcb"]


def test_a_held_back_start_that_is_not_a_stop_string_is_released():
    s = stream(stop=["END"])
    assert "".join(feed(s, "abENx")) == "abENx"


def test_a_stop_matcher_knows_the_longest_start_of_its_stop_the_text_ends_with_and_where_the_stop_is():
    rng = random.Random(0)
    for _ in range(2000):
        stop = "".join(rng.choices("ab", k=rng.randrange(1, 9)))
        matcher, text = StopMatcher(stop), ""
        while len(text) < 30:
            piece = "".join(rng.choices("ab", k=rng.randrange(0, 4)))
            found = matcher.feed(piece, len(text))
            text += piece
            if stop in text:
                assert found == text.find(stop), (stop, text)
                break
            assert found == -1
            assert matcher.matched == max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


def test_a_half_decoded_character_waits_for_its_last_token():
    s = stream()
    s.add(ord("a"))
    s.add(1)
    assert s.new_text() == "a"
    s.add(2)
    assert s.new_text() == "é"


def test_logprobs_are_kept_for_each_token_of_the_text_and_handed_out_once():
    s = stream(logprobs=0)
    entries = {t: TokenLogprob(t, -float(t), []) for t in map(ord, "ab")}
    assert not s.add(ord("a"), entries[ord("a")])
    assert s.new_logprobs() == [entries[ord("a")]] and s.new_logprobs() == []
    assert not s.add(ord("b"), entries[ord("b")])
    assert s.add(EOS, TokenLogprob(EOS, -0.1, []))  # EOS ends the text, and is not one of its tokens
    assert s.new_logprobs() == [entries[ord("b")]]
    assert s.generation(prompt_tokens=1, ttft=0.1, total_seconds=0.2).logprobs == list(entries.values())
    assert stream().new_logprobs() is None  # not asked for


def test_eos_and_max_tokens_finish():
    s = stream(max_tokens=3)
    assert not s.add(ord("a")) and not s.add(ord("b")) and s.add(ord("c"))
    assert s.finish_reason == "length" and s.new_text() == "abc"
    s = stream()
    assert s.add(EOS) and s.finish_reason == "stop" and s.token_ids == []
    assert s.generation(prompt_tokens=4, ttft=0.1, total_seconds=0.2).finish_reason == "stop"


def test_a_half_decoded_character_that_ends_the_stream_is_kept_as_the_whole_decode_has_it():
    s = stream(max_tokens=2)
    s.add(ord("a"))
    assert s.add(1) and s.finish_reason == "length" and s.text == "a\ufffd" and s.new_text() == "a\ufffd"
    s = stream()
    s.add(ord("a"))
    s.add(1)
    assert s.add(EOS) and s.text == "a\ufffd"


class CountingTokenizer(CharTokenizer):
    def __init__(self):
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


def test_each_token_decodes_a_window_of_a_few_tokens_not_the_whole_stream():
    tokenizer = CountingTokenizer()
    s = TextStream(tokenizer, SamplingParams(max_tokens=2000), {EOS})
    rng = random.Random(0)
    text = "".join(rng.choice(["a", "b", "c", "\x01\x02", "\x01a", "\x02"]) for _ in range(1000))
    for ch in text:
        s.add(ord(ch))
    assert s.text == CharTokenizer().decode([ord(ch) for ch in text])
    assert tokenizer.longest <= 4


def _streamed(tokenizer, ids: list[int]) -> tuple[str, str]:
    s = TextStream(tokenizer, SamplingParams(max_tokens=len(ids)), set())
    deltas = []
    for token in ids:
        s.add(token)
        deltas.append(s.new_text())
    return "".join(deltas), s.text


def test_the_embedded_tokenizers_streamed_text_is_its_whole_decode(embedded_tokenizer):
    """A byte-level BPE: characters split over tokens (accents, CJK, emoji), special tokens skipped, and random
    ids whose bytes need not form characters at all."""
    tok = embedded_tokenizer
    text = "Café naïve – 東京の夜 🚀🌍 done. <|im_end|> Ünïcødé ½ × ∑ «quoted» … " * 3
    rng = random.Random(1)
    for ids in (tok.encode(text), [rng.randrange(len(tok)) for _ in range(400)]):
        whole = tok.decode(ids, skip_special_tokens=True)
        assert _streamed(tok, ids) == (whole, whole)


def test_a_sentencepiece_tokenizers_leading_spaces_are_the_whole_decodes():
    """Llama's decoder: "▁" as a space, byte tokens fused, the text's first space stripped: a token's text
    depends on whether a token precedes it."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, ",": 3, "▁caf": 4, "<0xC3>": 5, "<0xA9>": 6, "!": 7}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    for ids in ([1, 3, 2, 7], [4, 5, 6, 1, 2], [2, 2, 5, 5, 6, 3, 1], [5, 6]):
        whole = tok.decode(ids, skip_special_tokens=True)
        assert _streamed(tok, ids) == (whole, whole), ids


def test_eos_after_a_held_back_half_character_still_applies_the_stop_strings():
    """The text the last token completes may be held back (half a character); EOS must settle it through the
    stop strings as the last token max_tokens allows does, not append it past them."""
    for finish in ([EOS], [ord("z")]):
        s = stream(stop=["a\ufffd"], max_tokens=3)
        feed(s, "a\x01")
        assert s.text == "a" and s.finish_reason is None  # the half character waits
        s.add(finish[0])
        assert (s.text, s.finish_reason) == ("", "stop"), finish


def test_ignore_eos_takes_eos_as_any_other_token():
    s = TextStream(CharTokenizer(), SamplingParams(max_tokens=3, ignore_eos=True), {EOS})
    assert not s.add(ord("a")) and not s.add(EOS) and s.add(ord("b"))
    assert (s.token_ids, s.finish_reason) == ([ord("a"), EOS, ord("b")], "length")
