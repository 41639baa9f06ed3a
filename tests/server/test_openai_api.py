"""The official openai client against a real server: chat, completions, streaming, documents, cache ids, tenants,
automatic prefix reuse, per-request methods, metrics."""

from __future__ import annotations

import time

import openai
import pytest

from kvreuse.engine.sampling import SamplingParams
from kvreuse.fusion.segments import chat_request, chunk_ids

from .conftest import MODEL_NAME, PREFIX_BLOCK

QUESTION = [{"role": "user", "content": "Which river runs through the city?"}]
DOCUMENTS = ["The city lies on both banks of a wide river called the Vell.", "Its old bridge dates from 1420."]
GREEDY = dict(model=MODEL_NAME, temperature=0, max_tokens=8)


def kvreuse_usage(usage) -> dict:
    return usage.model_extra["kvreuse"]


def test_models_lists_the_served_name(client, server):
    (card,) = client.models.list().data
    assert card.id == MODEL_NAME and card.owned_by == "kvreuse"
    assert card.model_extra["max_model_len"] == server.service.max_model_len


def test_chat_answers_what_the_engine_answers(client, tiny_chat_engine):
    response = client.chat.completions.create(messages=QUESTION, extra_body={"kvreuse": {"method": "full"}}, **GREEDY)
    tokenizer = tiny_chat_engine.tokenizer
    request = chat_request(tokenizer, [], [], QUESTION[0]["content"])
    expected = tiny_chat_engine.generate(request, "full", SamplingParams(max_tokens=8))
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    usage = response.usage
    assert usage.prompt_tokens == len(request) and usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert kvreuse_usage(usage)["method"] == "full" and kvreuse_usage(usage)["ttft_seconds"] > 0


def test_vllms_sampling_parameters_reach_the_engine(client, server, monkeypatch):
    """vLLM's sampling parameters (and a negative seed), as a client written for vLLM sends them, are the job's
    (their effects: tests/engine/test_sampling.py and test_text_stream.py)."""
    sent = dict(top_k=20, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.25,
                stop_token_ids=[7, 9], min_tokens=2, include_stop_str_in_output=True, seed=-5)
    jobs, submit_all = [], server.service.scheduler.submit_all
    monkeypatch.setattr(server.service.scheduler, "submit_all", lambda batch: jobs.extend(batch) or submit_all(batch))
    client.chat.completions.create(messages=QUESTION, model=MODEL_NAME, max_tokens=4, extra_body=sent)
    (job,) = jobs
    assert {name: getattr(job.sampling, name) for name in sent} == sent


def test_logit_bias_steers_the_answer_as_the_engine_does(client, tiny_chat_engine):
    request = chat_request(tiny_chat_engine.tokenizer, [], [], QUESTION[0]["content"])
    greedy = tiny_chat_engine.generate(request, "full", SamplingParams(max_tokens=6, ignore_eos=True))
    boosted = next(t for t in range(100, 200) if t not in greedy.token_ids)
    biases = {greedy.token_ids[0]: -100.0, boosted: 6.0}
    expected = tiny_chat_engine.generate(request, "full", SamplingParams(max_tokens=6, ignore_eos=True,
                                                                         logit_bias=biases))
    assert expected.token_ids != greedy.token_ids
    response = client.chat.completions.create(messages=QUESTION, model=MODEL_NAME, max_tokens=6, temperature=0,
                                              logit_bias={str(t): b for t, b in biases.items()},
                                              extra_body={"ignore_eos": True, "kvreuse": {"method": "full"}})
    assert response.choices[0].message.content == expected.text


def test_a_stop_token_ends_a_chat_and_is_its_stop_reason(client, tiny_chat_engine):
    request = chat_request(tiny_chat_engine.tokenizer, [], [], QUESTION[0]["content"])
    greedy = tiny_chat_engine.generate(request, "full", SamplingParams(max_tokens=12, ignore_eos=True))
    stop_token = greedy.token_ids[4]
    response = client.chat.completions.create(messages=QUESTION, model=MODEL_NAME, max_tokens=12, temperature=0,
                                              extra_body={"stop_token_ids": [stop_token], "ignore_eos": True})
    (choice,) = response.choices
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop_token)
    assert response.usage.completion_tokens == greedy.token_ids.index(stop_token) + 1


def test_the_stop_string_that_ended_a_stream_is_its_stop_reason(client):
    whole = client.chat.completions.create(messages=QUESTION, **GREEDY)
    stop = whole.choices[0].message.content[2:4]
    chunks = list(client.chat.completions.create(messages=QUESTION, stream=True, stop=stop, **GREEDY))
    finish = chunks[-1].choices[0]
    assert (finish.finish_reason, finish.model_extra["stop_reason"]) == ("stop", stop)
    kept = client.completions.create(prompt="Once upon a time", **GREEDY)
    stop = kept.choices[0].text[3:5]
    cut = client.completions.create(prompt="Once upon a time", stop=stop, **GREEDY,
                                    extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text == kept.choices[0].text[:kept.choices[0].text.index(stop) + len(stop)]


def test_streamed_chat_is_the_same_text_with_usage_last(client):
    whole = client.chat.completions.create(messages=QUESTION, **GREEDY)
    chunks = list(client.chat.completions.create(messages=QUESTION, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    finish, usage = chunks[-2], chunks[-1]
    assert finish.choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    unasked = list(client.chat.completions.create(messages=QUESTION, stream=True,
                                                  stream_options={"include_usage": None}, **GREEDY))
    assert all(c.usage is None for c in unasked) and len(unasked) == len(chunks) - 1  # null: not asked for


def test_chat_logprobs_are_the_models_own_for_each_token(client, tiny_chat_engine):
    """Each generated token with its log-probability and the 3 most likely at its step: the first token's from a
    full prefill's logits, the chosen one (greedy) the most likely; as many as completion_tokens."""
    tokenizer = tiny_chat_engine.tokenizer
    request = chat_request(tokenizer, [], [], QUESTION[0]["content"])
    expected = tiny_chat_engine.generate(request, "full", SamplingParams(max_tokens=8))
    first = tiny_chat_engine.prefill(request, "full").logits.float().log_softmax(-1)
    response = client.chat.completions.create(messages=QUESTION, logprobs=True, top_logprobs=3,
                                              extra_body={"kvreuse": {"method": "full"}}, **GREEDY)
    content = response.choices[0].logprobs.content
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in expected.token_ids]
    assert len(content) == response.usage.completion_tokens
    assert content[0].logprob == pytest.approx(float(first[expected.token_ids[0]]), abs=1e-5)
    top = first.topk(3)
    assert [alt.token for alt in content[0].top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()]
    assert [alt.logprob for alt in content[0].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the most likely
        assert [alt.logprob for alt in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs),
                                                                    reverse=True)
    streamed = list(client.chat.completions.create(messages=QUESTION, logprobs=True, top_logprobs=3, stream=True,
                                                   extra_body={"kvreuse": {"method": "full"}}, **GREEDY))
    assert [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content] \
        == content
    plain = client.chat.completions.create(messages=QUESTION, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_the_older_form(client):
    """Tokens, their log-probabilities, where each token's text starts, and the 2 most likely beside the chosen
    one; the stream's chunks add up to the same, their offsets going on from chunk to chunk."""
    whole = client.completions.create(prompt="Once upon a time", logprobs=2, **GREEDY)
    form = whole.choices[0].logprobs
    assert len(form.tokens) == len(form.token_logprobs) == len(form.top_logprobs) == whole.usage.completion_tokens
    assert form.text_offset == [sum(map(len, form.tokens[:i])) for i in range(len(form.tokens))]
    for token, logprob, top in zip(form.tokens, form.token_logprobs, form.top_logprobs):
        assert top[token] == logprob == max(top.values()) and 1 <= len(top) <= 2
    streamed = list(client.completions.create(prompt="Once upon a time", logprobs=2, stream=True, **GREEDY))
    forms = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for f in forms for t in f.tokens] == form.tokens
    assert [o for f in forms for o in f.text_offset] == form.text_offset
    assert [p for f in forms for p in f.token_logprobs] == form.token_logprobs
    alone = client.completions.create(prompt="Once upon a time", logprobs=0, **GREEDY).choices[0].logprobs
    assert alone.top_logprobs == [{t: p} for t, p in zip(form.tokens, form.token_logprobs)]  # the chosen, always


def test_n_choices_are_sampled_from_one_prompt_each_with_its_seed(client, tiny_chat_engine):
    """vLLM's n: choice i is what a request of seed + i gives alone; the usage counts the prompt once and every
    choice's tokens; a stream carries each choice's text, end and role under its index, and the usage once."""
    request = chat_request(tiny_chat_engine.tokenizer, [], [], QUESTION[0]["content"])
    sampled = dict(model=MODEL_NAME, max_tokens=6, temperature=1.0, seed=5,
                   extra_body={"ignore_eos": True, "kvreuse": {"method": "full"}})
    response = client.chat.completions.create(messages=QUESTION, n=3, **sampled)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        alone = tiny_chat_engine.generate(request, "full", SamplingParams(max_tokens=6, temperature=1.0,
                                                                          seed=5 + choice.index, ignore_eos=True))
        assert choice.message.content == alone.text
    assert response.usage.prompt_tokens == len(request) and response.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(messages=QUESTION, n=3, stream=True,
                                                 stream_options={"include_usage": True}, **sampled))
    streamed = {index: "".join(c.choices[0].delta.content or "" for c in chunks
                               if c.choices and c.choices[0].index == index) for index in range(3)}
    assert streamed == {c.index: c.message.content for c in response.choices}
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(e.index for e in ends) == [0, 1, 2] and {e.finish_reason for e in ends} == {"length"}
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [18] and chunks[-1].usage is not None


def test_n_completions_stream_each_choices_logprob_offsets_from_its_own_start(client):
    whole = client.completions.create(prompt="Once upon a time", n=2, logprobs=1, **GREEDY)
    assert [c.index for c in whole.choices] == [0, 1] and whole.choices[0].text == whole.choices[1].text  # greedy
    chunks = list(client.completions.create(prompt="Once upon a time", n=2, logprobs=1, stream=True, **GREEDY))
    for choice in whole.choices:
        offsets = [o for c in chunks if c.choices and c.choices[0].index == choice.index and c.choices[0].logprobs
                   for o in c.choices[0].logprobs.text_offset]
        assert offsets == choice.logprobs.text_offset and offsets[0] == 0


def test_method_autos_choice_and_its_prediction_are_in_the_usage(client, server, monkeypatch):
    from kvreuse.controller.auto import AutoController
    from kvreuse.controller.fidelity import Fidelity, FidelityTable
    from kvreuse.controller.profile import ComputeProfile, MachineProfile, TierProfile

    engine = server.service.engine
    compute = ComputeProfile([64, 2048], [64e-5, 2048e-5], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    profile = MachineProfile(engine.fingerprint, "float32", engine.model.num_layers, 64, compute,
                             {"memory": TierProfile("memory", 1e10, 0.0)})
    table = FidelityTable(engine.fingerprint, {"naive": Fidelity(0.05, 0.9)})
    monkeypatch.setattr(engine, "_controller", AutoController(profile, table))
    options = dict(messages=QUESTION, **GREEDY)
    chosen = kvreuse_usage(client.chat.completions.create(
        **options, extra_body={"documents": DOCUMENTS, "kvreuse": {"method": "auto:kl=0.1"}}).usage)
    auto = chosen["auto"]
    assert auto["requested_method"] == "auto:kl=0.1" and set(auto["candidates"]) == {"naive", "prefix"}
    assert auto["predicted_ttft_seconds"] == auto["candidates"][chosen["method"]]
    assert kvreuse_usage(client.chat.completions.create(**options).usage)["auto"] is None


def test_completions_plain_and_streamed(client):
    whole = client.completions.create(prompt="Once upon a time", **GREEDY)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 8
    streamed = list(client.completions.create(prompt="Once upon a time", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    by_ids = client.completions.create(prompt=[9, 10, 11, 12], **GREEDY)
    assert by_ids.usage.prompt_tokens == 4


def test_an_echoed_completion_starts_with_its_prompt(client, tiny_chat_engine):
    """OpenAI's echo: the prompt's text, then the completion, in each choice; a stream sends it first."""
    plain = client.completions.create(prompt="Once upon a time", **GREEDY).choices[0].text
    echoed = client.completions.create(prompt="Once upon a time", echo=True, n=2, **GREEDY)
    assert [c.text for c in echoed.choices] == ["Once upon a time" + plain] * 2
    chunks = list(client.completions.create(prompt="Once upon a time", echo=True, stream=True, **GREEDY))
    assert chunks[0].choices[0].text == "Once upon a time"
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    ids = tiny_chat_engine.tokenizer.encode(" the river Vell")
    by_ids = client.completions.create(prompt=ids, echo=True, **GREEDY).choices[0].text
    assert by_ids.startswith(tiny_chat_engine.tokenizer.decode(ids))


def test_a_batch_of_prompts_is_one_request_their_choices_numbered_in_order(client):
    """vLLM's batch: prompt i's choice j is choice i x n + j, each as the prompt alone gives it; the usage counts
    every prompt; a stream's chunks carry those indices, an echoed prompt first in each."""
    prompts = ["Once upon a time", "The river"]
    alone = [client.completions.create(prompt=p, **GREEDY) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    assert kvreuse_usage(batch.usage) is None  # each prompt's KV came its own way
    chunks = list(client.completions.create(prompt=prompts, echo=True, stream=True, **GREEDY))
    for index, prompt in enumerate(prompts):
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index]
        assert texts[0] == prompt and "".join(texts) == prompt + alone[index].choices[0].text
    by_ids = client.completions.create(prompt=[[9, 10, 11], [12, 13]], **GREEDY)
    assert len(by_ids.choices) == 2 and by_ids.usage.prompt_tokens == 5
    with_documents = dict(extra_body={"documents": DOCUMENTS, "kvreuse": {"method": "full"}}, **GREEDY)
    alone = [client.completions.create(prompt=p, **with_documents) for p in prompts]
    batch = client.completions.create(prompt=prompts, **with_documents)  # the documents come before every prompt
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def chat_until(client, predicate, attempts: int = 40, **options):
    """Repeat a request until `predicate(usage)` holds: chunks are written back off the request's path."""
    for _ in range(attempts):
        response = client.chat.completions.create(messages=QUESTION, **GREEDY, **options)
        if predicate(kvreuse_usage(response.usage)):
            return response
        time.sleep(0.1)
    pytest.fail(f"never reached: last usage {kvreuse_usage(response.usage)}")


def test_documents_are_reused_chunks_on_the_next_request(client, tiny_chat_engine):
    body = {"documents": DOCUMENTS, "kvreuse": {"method": "naive"}, "cache_salt": "documents-test"}
    first = kvreuse_usage(client.chat.completions.create(messages=QUESTION, **GREEDY, extra_body=body).usage)
    assert first["chunks"] == 2 and first["chunk_hits"] == 0
    again = chat_until(client, lambda u: u["chunk_hits"] == 2, extra_body=body)
    document_tokens = sum(len(chunk_ids(tiny_chat_engine.tokenizer, d)) for d in DOCUMENTS)
    assert again.usage.prompt_tokens_details.cached_tokens >= document_tokens
    assert kvreuse_usage(again.usage)["loaded_tokens_by_tier"] == {"memory": kvreuse_usage(again.usage)["reused_tokens"]}


def test_a_tenant_never_reuses_another_tenants_entries(client):
    mine = {"documents": ["A passage only tenant one has sent."], "cache_salt": "tenant-one"}
    chat_until(client, lambda u: u["chunk_hits"] == 1, extra_body=mine)
    theirs = client.chat.completions.create(messages=QUESTION, **GREEDY, extra_body={**mine, "cache_salt": "tenant-two"})
    assert kvreuse_usage(theirs.usage)["chunk_hits"] == 0


def test_conversation_history_is_reused_as_an_exact_prefix(client, server):
    history = [{"role": "system", "content": "You answer in one word."},
               {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    options = {"extra_body": {"cache_salt": "history-test", "kvreuse": {"method": "prefix"}}}
    messages = [*history, {"role": "user", "content": "And of Spain?"}]
    first = client.chat.completions.create(messages=messages, **GREEDY, **options)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the history's blocks are written back off the request's path, between the engine's steps: behind whatever
    # earlier tests left queued, so wait for them rather than for a number of retries
    server.service.engine.wait_for_write_back()
    again = client.chat.completions.create(messages=[*history, {"role": "user", "content": "Of Italy?"}],
                                           **GREEDY, **options)
    # the history's whole blocks were found and restored; how many of their rows were loaded rather than computed
    # is the restorer's choice by the costs it measured on earlier requests (on this tiny model a row computes
    # about as fast as it loads, so that share moves with the machine's load: it once computed all 40 rows)
    assert kvreuse_usage(again.usage)["restored_prefix_tokens"] >= 2 * PREFIX_BLOCK


def test_a_request_chooses_its_method_and_ratio(client):
    response = client.chat.completions.create(messages=QUESTION, **GREEDY,
                                              extra_body={"kvreuse": {"method": "cacheblend", "ratio": 0.3}})
    assert kvreuse_usage(response.usage)["method"] == "cacheblend:0.3"
    spaced = client.chat.completions.create(messages=QUESTION, **GREEDY,
                                            extra_body={"kvreuse": {"method": " cacheblend ", "ratio": 0.3}})
    assert kvreuse_usage(spaced.usage)["method"] == "cacheblend:0.3"  # the name read as the engine reads it


def test_context_cache_api_and_cache_ids(client, http):
    created = http.post("/v1/caches", json={"text": "A manual of the Vell river's bridges.", "cache_salt": "c1"})
    assert created.status_code == 200, created.text
    cache = created.json()
    assert cache["object"] == "kvreuse.cache" and cache["stored"] and cache["tokens"] > 0
    assert http.get(f"/v1/caches/{cache['id']}", params={"cache_salt": "c1"}).json() == cache
    assert http.post("/v1/caches", json={"text": "A manual of the Vell river's bridges.", "cache_salt": "c1"}
                     ).json()["id"] == cache["id"]  # same tenant and text: same cache

    body = {"cache_ids": [cache["id"]], "documents": DOCUMENTS, "cache_salt": "c1", "kvreuse": {"method": "naive"}}
    usage = kvreuse_usage(client.chat.completions.create(messages=QUESTION, **GREEDY, extra_body=body).usage)
    assert usage["chunks"] == 3 and usage["chunk_hits"] == 1  # compiled when created: a hit at once
    with pytest.raises(openai.NotFoundError, match="no cache with id"):
        client.chat.completions.create(messages=QUESTION, **GREEDY, extra_body={**body, "cache_salt": "c2"})

    deleted = http.delete(f"/v1/caches/{cache['id']}", params={"cache_salt": "c1"})
    assert deleted.json() == {"id": cache["id"], "object": "kvreuse.cache.deleted", "deleted": True}
    assert http.get(f"/v1/caches/{cache['id']}", params={"cache_salt": "c1"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(messages=QUESTION, **GREEDY, extra_body=body)


def test_deleting_a_cache_removes_its_kv_in_every_compile_mode_a_request_stored(server, client, http):
    """A request using the cache with legolink0 stored the cache's KV in that mode too: the delete answered
    "deleted" and left it, and the same text kept hitting it."""
    text = "The ferry timetable of the Vell, chapter 3. " * 4
    cache = http.post("/v1/caches", json={"text": text, "cache_salt": "d1"}).json()
    body = {"cache_ids": [cache["id"]], "cache_salt": "d1", "kvreuse": {"method": "legolink0"}}
    client.chat.completions.create(messages=QUESTION, **GREEDY, extra_body=body)
    server.service.engine.wait_for_write_back()
    keys = server.service.engine.chunk_keys(chunk_ids(server.service.engine.tokenizer, text), "d1")
    assert len(keys) >= 2 and all(server.service.engine.store.contains(key) for key in keys)
    assert http.delete(f"/v1/caches/{cache['id']}", params={"cache_salt": "d1"}).json()["deleted"]
    assert not any(server.service.engine.store.contains(key) for key in keys)
    again = {"documents": [text], "cache_salt": "d1", "kvreuse": {"method": "legolink0"}}
    usage = kvreuse_usage(client.chat.completions.create(messages=QUESTION, **GREEDY, extra_body=again).usage)
    assert usage["chunk_hits"] == 0


def test_a_cache_from_token_ids(http):
    cache = http.post("/v1/caches", json={"token_ids": [5, 6, 7, 8, 9]}).json()
    assert cache["tokens"] == 5 and cache["stored"]


def test_health(http):
    assert http.get("/health").json()["status"] == "ok"


def test_tokenize_gives_the_prompt_a_request_of_the_same_body_runs(client, http, tiny_chat_engine):
    """vLLM's /tokenize, with kvreuse's documents and cached documents: its count is the request's prompt_tokens."""
    cache_id = http.post("/v1/caches", json={"text": DOCUMENTS[1]}).json()["id"]
    parts = {"documents": DOCUMENTS[:1], "cache_ids": [cache_id]}
    chat = http.post("/tokenize", json={"messages": QUESTION, **parts}).json()
    answer = client.chat.completions.create(messages=QUESTION, extra_body=parts, **GREEDY)
    assert chat["count"] == len(chat["tokens"]) == answer.usage.prompt_tokens
    tokenizer = tiny_chat_engine.tokenizer
    expected = chat_request(tokenizer, [], [chunk_ids(tokenizer, DOCUMENTS[1]), chunk_ids(tokenizer, DOCUMENTS[0])],
                            QUESTION[0]["content"])
    assert chat["tokens"] == expected.token_ids.tolist() and chat["max_model_len"] > chat["count"]
    completion = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()
    assert completion["tokens"] == tokenizer.encode("Once upon a time")
    assert http.post("/detokenize", json={"tokens": completion["tokens"]}).json() == {"prompt": "Once upon a time"}

