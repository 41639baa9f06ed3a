"""TextStream: stop conditions, and streamed text that is never taken back."""

from kvreuse.engine.generate import TextStream
from kvreuse.engine.sampling import SamplingParams

EOS = 0


class CharTokenizer:
    """Token id i is the character chr(i); id 1 renders as U+FFFD unless id 2 follows (a split character)."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(chr(i) for i in ids)
        return text.replace(chr(1) + chr(2), "é").replace(chr(1), "\ufffd")


def stream(stop=(), max_tokens=50) -> TextStream:
    return TextStream(CharTokenizer(), SamplingParams(max_tokens=max_tokens, stop=list(stop)), {EOS})


def feed(s: TextStream, text: str) -> list[str]:
    deltas = []
    for ch in text:
        s.add(ord(ch))
        deltas.append(s.new_text())
    return deltas


def test_a_stop_string_cuts_the_text_and_its_start_is_never_streamed():
    s = stream(stop=["END"])
    deltas = feed(s, "abcEN")
    assert "".join(deltas) == "abc" and s.finish_reason is None  # "EN" may begin the stop string: held back
    assert s.add(ord("D")) and s.finish_reason == "stop"
    assert s.text == "abc" and s.new_text() == ""


def test_a_held_back_start_that_is_not_a_stop_string_is_released():
    s = stream(stop=["END"])
    assert "".join(feed(s, "abENx")) == "abENx"


def test_a_half_decoded_character_waits_for_its_last_token():
    s = stream()
    s.add(ord("a"))
    s.add(1)
    assert s.new_text() == "a"
    s.add(2)
    assert s.new_text() == "é"


def test_eos_and_max_tokens_finish():
    s = stream(max_tokens=3)
    assert not s.add(ord("a")) and not s.add(ord("b")) and s.add(ord("c"))
    assert s.finish_reason == "length" and s.new_text() == "abc"
    s = stream()
    assert s.add(EOS) and s.finish_reason == "stop" and s.token_ids == []
    assert s.generation(prompt_tokens=4, ttft=0.1, total_seconds=0.2).finish_reason == "stop"
