"""Generation on the real model: chat template, stop conditions, TTFT reported."""

import pytest

from kvreuse.engine.generate import chat_prompt_ids, generate
from kvreuse.engine.sampling import SamplingParams

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def prompt_ids(embedded_model):
    return chat_prompt_ids(embedded_model.tokenizer, QUESTION)


def test_chat_template_wraps_the_message(embedded_model, prompt_ids):
    text = embedded_model.tokenizer.decode(prompt_ids)
    assert "Name three colours" in text and text.rstrip().endswith("assistant")


def test_max_tokens_bounds_the_answer(embedded_model, prompt_ids):
    result = generate(embedded_model, prompt_ids, SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    assert 0 < result.ttft <= result.total_seconds


def test_stop_string_cuts_the_text(embedded_model, prompt_ids):
    free = generate(embedded_model, prompt_ids, SamplingParams(max_tokens=12))
    words = free.text.split()
    assert len(words) >= 3, free.text
    stopped = generate(embedded_model, prompt_ids, SamplingParams(max_tokens=12, stop=[words[2]]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(words[2])]


def test_seeded_sampling_is_reproducible(embedded_model, prompt_ids):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=3)
    assert generate(embedded_model, prompt_ids, params).text == generate(embedded_model, prompt_ids, params).text
