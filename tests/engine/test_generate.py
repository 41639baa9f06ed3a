"""Generation on the real model: chat template, stop conditions, TTFT reported (full prefill, then decoding)."""

import pytest

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.engine.sampling import SamplingParams
from kvreuse.store.spec import open_store

pytestmark = pytest.mark.real_model

QUESTION = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def engine(embedded_model):
    engine = ReuseEngine(embedded_model, open_store("memory:256MB"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def request_(engine):
    return engine.build_request([], QUESTION)


def generate(engine, request, params):
    return engine.generate(request, "full", params)


def test_chat_template_wraps_the_message(engine, request_):
    text = engine.tokenizer.decode(request_.token_ids)
    assert "Name three colours" in text and text.rstrip().endswith("assistant")


def test_max_tokens_bounds_the_answer(engine, request_):
    result = generate(engine, request_, SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    assert 0 < result.ttft <= result.total_seconds


def test_stop_string_cuts_the_text(engine, request_):
    free = generate(engine, request_, SamplingParams(max_tokens=12))
    words = free.text.split()
    assert len(words) >= 3, free.text
    stopped = generate(engine, request_, SamplingParams(max_tokens=12, stop=[words[2]]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(words[2])]


def test_seeded_sampling_is_reproducible(engine, request_):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=3)
    assert generate(engine, request_, params).text == generate(engine, request_, params).text
