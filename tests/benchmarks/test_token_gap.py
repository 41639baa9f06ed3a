"""benchmarks/token_gap.py on the tiny chat engine: a prompt arriving beside a decoding stream is timed, and the
gap setting reaches the scheduler (between every two layers, the stream waits less than the prompt's TTFT)."""

from __future__ import annotations

from benchmarks.token_gap import arrive, gap_seconds
from kvreuse.eval.datasets import ChunkedPrompt


def test_a_prompt_arriving_beside_a_stream_is_timed(tiny_chat_engine):
    prompt = ChunkedPrompt("p", ["A passage about lighthouses. " * 40, "Another about the sea. " * 40],
                           "Who keeps the light?", [], "qa")
    whole = arrive(tiny_chat_engine, prompt, gap_seconds("none"), warmup_tokens=3)
    paused = arrive(tiny_chat_engine, prompt, gap_seconds("0"), warmup_tokens=3)
    assert whole.prompt_tokens == paused.prompt_tokens > 160
    assert whole.longest_gap >= whole.ttft * 0.9  # the stream waited for the whole prompt
    assert paused.longest_gap < paused.ttft  # it decoded between the prompt's two layers
