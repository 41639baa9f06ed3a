"""benchmarks/token_gap.py on the tiny chat engine: prompts arriving beside a decoding stream are timed, and the
gap setting reaches the scheduler (between every two layers, the stream waits less than the prompt's TTFT); two
prompts arriving together are admitted as one batch, and the stream decodes between them."""

from __future__ import annotations

from benchmarks.token_gap import arrive, gap_seconds
from kvreuse.eval.datasets import ChunkedPrompt


def test_a_prompt_arriving_beside_a_stream_is_timed(tiny_chat_engine):
    prompt = ChunkedPrompt("p", ["A passage about lighthouses. " * 40, "Another about the sea. " * 40],
                           "Who keeps the light?", [], "qa")
    whole = arrive(tiny_chat_engine, [prompt], gap_seconds("none"), warmup_tokens=3)
    paused = arrive(tiny_chat_engine, [prompt], gap_seconds("0"), warmup_tokens=3)
    assert whole.prompt_tokens == paused.prompt_tokens and whole.prompt_tokens[0] > 160
    assert whole.longest_gap >= whole.ttft * 0.9  # the stream waited for the whole prompt
    assert paused.longest_gap < paused.ttft  # it decoded between the prompt's two layers


def test_prompts_arriving_together_are_timed_each(tiny_chat_engine):
    prompts = [ChunkedPrompt(f"p{i}", [f"Passage {i} about lighthouses. " * 40], "Who keeps the light?", [], "qa")
               for i in range(2)]
    batch = arrive(tiny_chat_engine, prompts, gap_seconds("none"), warmup_tokens=3)
    assert len(batch.prompt_tokens) == len(batch.ttfts) == 2 and batch.ttfts[0] < batch.ttfts[1]
    assert batch.longest_gap < batch.ttfts[1]  # the stream decoded between the two prompts
