"""Bad input over raw HTTP: a 4xx with an OpenAI-style body naming the problem, never a 500, and the server keeps
serving. Admission control, timeouts, cancellation and the API key on servers of their own."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvreuse.engine.scheduler import ShuttingDown

from .conftest import MODEL_NAME

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello?"}]


def chat_body(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}


def assert_error(response, status: int, param: str | None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


@pytest.mark.parametrize(
    "body, param, words",
    [
        (chat_body(kvreuse={"method": "naive", "colour": "red"}), "kvreuse.colour", ["Extra inputs"]),
        (chat_body(kvreuse={"method": "blend"}), "kvreuse.method", ["unknown method 'blend'"]),
        (chat_body(kvreuse={"method": ""}), "kvreuse.method", ["is empty"]),  # not the server's default, silently
        (chat_body(kvreuse={"method": "legolink:\u00b2"}), "kvreuse.method", ["whole number"]),
        (chat_body(kvreuse={"method": "naive", "ratio": 0.2}), "kvreuse.ratio", ["naive takes no ratio"]),
        (chat_body(kvreuse={"ratio": 1.5}), "kvreuse.ratio", ["less than or equal to 1"]),
        (chat_body(temperature="hot"), "temperature", ["valid number"]),
        (chat_body(max_tokens=0), "max_tokens", ["greater than or equal to 1"]),
        (chat_body(messages=[]), "messages", ["at least 1"]),
        (chat_body(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role", []),
        (chat_body(messages=[*MESSAGES, {"role": "assistant", "content": "Hi."}]), "messages", ["user's"]),
        (chat_body(documents=["fine", ""]), "documents[1]", ["at least 1 character"]),
        (chat_body(cache_salt=""), "cache_salt", ["at least 1 character"]),
        (chat_body(documents="not a list"), "documents", []),
        (chat_body(n=9), "n", ["n: at most 8 choices (the server's --max-concurrency), got 9"]),
        (chat_body(top_logprobs=2), "top_logprobs", ["needs logprobs set to true"]),
        (chat_body(logprobs=True, top_logprobs=21), "top_logprobs", ["less than or equal to 20"]),
        (chat_body(max_tokens=10**6), "messages", ["maximum context length"]),
        (chat_body(messages=[{"role": "user", "content": "word " * 9000}]), "messages", ["maximum context length"]),
        (chat_body(cache_ids=["../../etc/passwd"]), "cache_ids[0]", ["not a cache id"]),
        ({"model": MODEL_NAME}, "messages", ["Field required"]),
        (chat_body(stop=["x"] * 17), "stop", ["at most 16 stop strings, got 17"]),
        (chat_body(stop=["x", "y" * 1001]), "stop", ["stop string 1 has 1001 characters; at most 1000"]),
        (chat_body(stop="y" * 1001), "stop", ["stop string 0 has 1001 characters"]),
        (chat_body(tool_choice="required"), "tool_choice", ["not supported"]),
        (chat_body(functions=[{"name": "f", "parameters": {}}]), "functions", ["not supported"]),
        (chat_body(function_call={"name": "f"}), "function_call", ["not supported"]),
        (chat_body(modalities=["text", "audio"]), "modalities", ["only text"]),
        (chat_body(audio={"voice": "alloy", "format": "wav"}), "audio", ["not supported"]),
        (chat_body(prediction={"type": "content", "content": "x"}), "prediction", ["not supported"]),
        (chat_body(guided_json={"type": "object"}), "guided_json", ["guided decoding is not supported"]),
        (chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages[0].content", ["only text content parts are supported, got a part of type 'image_url'"]),
        (chat_body(guided_choice=["a", "b"]), "guided_choice", ["guided decoding is not supported"]),
        (chat_body(min_tokens=5), "min_tokens", ["min_tokens must be in [0, max_tokens=4], got 5"]),
        (chat_body(top_k=-2), "top_k", ["greater than or equal to -1"]),
        (chat_body(repetition_penalty=0), "repetition_penalty", ["greater than 0"]),
        (chat_body(stop_token_ids=[10**9]), "stop_token_ids", ["outside the vocabulary"]),
        (chat_body(logit_bias={"10": 1, "the": 5}), "logit_bias", ["'the' is not a token id"]),
        (chat_body(logit_bias={"-3": 5}), "logit_bias", ["'-3' is not a token id"]),
        (chat_body(logit_bias={"0" * 4400 + "1": 5}), "logit_bias", ["is not a token id", "at most 18 digits"]),
        (chat_body(logit_bias={"10": 100.5}), "logit_bias", ["token 10's bias 100.5 is outside [-100, 100]"]),
        (chat_body(logit_bias={"10": "x"}), "logit_bias.10", ["valid number"]),
        (chat_body(logit_bias={str(10**9): 1}), "logit_bias", ["token id 1000000000 is outside the vocabulary"]),
        (chat_body(stream_options={"include_usage": True}), "stream_options", ["only allowed when stream is true"]),
    ],
)
def test_bad_chat_requests_get_400_naming_the_field(http, body, param, words):
    error = assert_error(http.post(CHAT, json=body), 400, param, *words)
    assert error["type"] == "invalid_request_error"


def test_options_sent_as_null_take_their_defaults(http):
    nulls = dict.fromkeys(["n", "stream", "logprobs", "ignore_eos", "documents", "cache_ids", "stop", "tool_choice",
                           "modalities", "top_logprobs", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
                           "min_tokens", "include_stop_str_in_output", "guided_json"])
    answer = http.post(CHAT, json=chat_body(**nulls, stream_options=None, temperature=0))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == \
        http.post(CHAT, json=chat_body(temperature=0)).json()["choices"][0]["message"]["content"]
    completion = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2,
                                                    "n": None, "stream": None, "echo": None})
    assert completion.status_code == 200, completion.text


def test_malformed_json_and_wrong_body_type(http):
    assert_error(http.post(CHAT, content=b'{"model": ', headers={"content-type": "application/json"}),
                 400, "body", "not valid JSON")
    assert_error(http.post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"}), 400, "body")


def test_unknown_model_cache_and_route_are_404(http):
    error = assert_error(http.post(CHAT, json=chat_body(model="gpt-9")), 404, "model", "gpt-9")
    assert error["code"] == "model_not_found"
    assert_error(http.post(CHAT, json=chat_body(cache_ids=["kvc-0123"])), 404, "cache_ids[0]", "no cache")
    assert_error(http.get("/v1/caches/kvc-0123"), 404, "cache_id")
    assert_error(http.get("/v1/nothing-here"), 404, None)
    not_allowed = http.put("/v1/models")
    assert_error(not_allowed, 405, None)
    assert not_allowed.headers["allow"] == "GET"
    assert http.head("/health").status_code == 200


def test_bad_cache_creation(http):
    assert_error(http.post("/v1/caches", json={}), 400, "text", "exactly one")
    assert_error(http.post("/v1/caches", json={"text": "a", "token_ids": [1]}), 400, "text", "exactly one")
    assert_error(http.post("/v1/caches", json={"token_ids": [10**9]}), 400, "token_ids", "outside the vocabulary")
    assert_error(http.post("/v1/caches", json={"text": "a", "size": 3}), 400, "size", "Extra inputs")


def test_bad_completion_prompts(http):
    url = "/v1/completions"
    assert_error(http.post(url, json={"model": MODEL_NAME, "prompt": ""}), 400, "prompt", "must not be empty")
    assert_error(http.post(url, json={"model": MODEL_NAME, "prompt": [-1, 5]}), 400, "prompt", "token id -1")
    assert_error(http.post(url, json={"model": MODEL_NAME, "prompt": ["a"] * 265}), 400, "prompt",
                 "265 prompts of n=1; at most 264 in one request")
    # 8 running slots hold 4 prompts of n=2 at once, 256 more wait: 261 could never be queued (a 429 for ever)
    assert_error(http.post(url, json={"model": MODEL_NAME, "prompt": ["a"] * 261, "n": 2}), 400, "prompt",
                 "261 prompts of n=2; at most 260")
    assert_error(http.post(url, json={"model": MODEL_NAME, "prompt": ["a", ""]}), 400, "prompt[1]",
                 "must not be empty")
    assert_error(http.post(url, json={"model": MODEL_NAME, "prompt": [[5], [7, 10**9]]}), 400, "prompt[1]",
                 "token id 1000000000")
    assert_error(http.post(url, json={"model": MODEL_NAME, "prompt": {"text": "a"}}), 400, "prompt")
    assert_error(http.post(url, json={"model": MODEL_NAME, "prompt": "a", "logprobs": 21}), 400, "logprobs",
                 "less than or equal to 20")
    assert_error(http.post(url, json={"model": MODEL_NAME, "prompt": "a", "echo": True, "logprobs": 1}), 400,
                 "echo", "echo with logprobs is not supported")


def test_text_the_tokenizer_turns_into_ids_the_model_lacks_is_a_400(server, http, monkeypatch):
    """A tokenizer larger than the model's embedding (tokens added without resizing it): a 500 from the engine
    thread for every text request before; a 400 that says so now."""
    monkeypatch.setattr(server.service, "vocab_size", 300)
    why = "outside the model's vocabulary [0, 300): its tokenizer does not match its weights"
    assert_error(http.post(CHAT, json=chat_body()), 400, "messages", why)
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Paris, in the spring"}), 400,
                 "prompt", why)
    assert_error(http.post("/v1/caches", json={"text": "Paris, in the spring"}), 400, "text", why)


def test_the_server_keeps_serving_after_bad_input(http, client):
    http.post(CHAT, content=b"\xff\xfe garbage", headers={"content-type": "application/json"})
    assert client.chat.completions.create(messages=MESSAGES, model=MODEL_NAME, max_tokens=2).choices


def test_a_full_queue_answers_429_and_a_closed_stream_is_cancelled(make_server):
    server = make_server(max_concurrency=1, max_queue=0)
    client = server.client()
    long_stream = client.chat.completions.create(messages=MESSAGES, model=MODEL_NAME, max_tokens=4000,
                                                 stream=True, extra_body={"ignore_eos": True})
    chunks = iter(long_stream)
    next(chunks), next(chunks)  # the role, then a token: it is running
    with pytest.raises(openai.RateLimitError, match="at capacity") as refused:
        client.chat.completions.create(messages=MESSAGES, model=MODEL_NAME, max_tokens=2)
    assert refused.value.response.headers["retry-after"] == "1"
    long_stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while server.service.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.service.scheduler.running == 0
    assert client.chat.completions.create(messages=MESSAGES, model=MODEL_NAME, max_tokens=2).choices


def test_a_request_over_its_time_gets_408(make_server):
    server = make_server(request_timeout=0.3)
    with server.http() as http:
        body = chat_body(max_tokens=7000, ignore_eos=True)
        assert_error(http.post(CHAT, json=body), 408, None, "timed out")
        streamed = http.post(CHAT, json={**body, "stream": True}).text
        assert '"timeout_error"' in streamed and streamed.endswith("data: [DONE]\n\n")


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_a_batch_of_prompts_an_idle_server_could_queue_is_taken_and_a_larger_one_is_a_400(make_server):
    """2 running slots hold one prompt of n=2 at a time and 1 more may wait: 2 prompts fit, 3 never would."""
    server = make_server(max_concurrency=2, max_queue=1)
    with server.http() as http:
        body = {"model": MODEL_NAME, "n": 2, "max_tokens": 2}
        assert len(http.post("/v1/completions", json={**body, "prompt": ["a", "b"]}).json()["choices"]) == 4
        assert_error(http.post("/v1/completions", json={**body, "prompt": ["a", "b", "c"]}), 400, "prompt",
                     "3 prompts of n=2; at most 2")


def test_cache_creations_are_bounded_timed_and_dropped_when_their_client_goes(make_server, monkeypatch):
    server = make_server(max_concurrency=1, request_timeout=3.0)
    service, compiled = server.service, []
    compile_ = service._compile
    monkeypatch.setattr(service, "_compile", lambda ids, salt: compiled.append(ids) or compile_(ids, salt))
    body = {"model": MODEL_NAME, "text": "A passage to keep."}
    with server.http() as http, ThreadPoolExecutor(2) as threads, service.scheduler.held():
        gone = threads.submit(lambda: httpx.post(f"{server.url}/v1/caches", json=body, timeout=0.3))
        with pytest.raises(httpx.TimeoutException):
            gone.result()
        wait_until(lambda: service._compiling == 0, timeout=2.0)  # its client went: dropped before its timeout
        waiting = threads.submit(http.post, "/v1/caches", json=body)
        wait_until(lambda: service._compiling == 1)
        refused = http.post("/v1/caches", json=body)
        assert_error(refused, 429, None, "caches are being created")
        assert refused.headers["retry-after"] == "1"
        assert_error(waiting.result(), 408, None, "not created within 3 s")
    with server.http() as http:
        assert http.post("/v1/caches", json=body).status_code == 200
    assert len(compiled) == 1  # none of the abandoned creations ran once the engine went on


def test_a_cache_creation_whose_client_goes_while_it_compiles_stops_at_the_next_layer(make_server, monkeypatch):
    """Once started, a compilation its client abandoned ran every layer, holding the engine (and every stream)
    for a prompt's time; it now stops between two layers, as a prompt does, and stores nothing."""
    server = make_server()
    model, layers_run, release = server.service.engine.model, [], threading.Event()
    step = model.step

    def held_at_the_first_layer(layer, *args):
        layers_run.append(layer)
        if layer == 0:
            release.wait(30)
        return step(layer, *args)

    monkeypatch.setattr(model, "step", held_at_the_first_layer)
    body = {"model": MODEL_NAME, "text": "A passage its client does not wait for."}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/caches", json=body, timeout=0.3)
    wait_until(lambda: server.service._compiling == 0)  # the service saw its client go
    release.set()
    wait_until(lambda: server.service.scheduler.call(lambda: True).result(timeout=30))
    monkeypatch.setattr(model, "step", step)
    assert layers_run == [0] and model.num_layers > 1
    with server.http() as http:
        assert http.post("/v1/caches", json=body).json()["stored"]


def test_a_cache_creation_pending_when_the_server_stops_answers_503(make_server):
    server = make_server()
    service = server.service
    body = {"model": MODEL_NAME, "text": "A passage the stopping server never compiles."}
    with server.http() as http, ThreadPoolExecutor(1) as threads:
        with service.scheduler.held():
            pending = threads.submit(http.post, "/v1/caches", json=body)
            wait_until(lambda: service._compiling == 1)
            service.scheduler.end_all(ShuttingDown("the server is shutting down"))
        error = assert_error(pending.result(), 503, None, "shutting down")
    assert error["code"] == "shutting_down"


def test_the_api_key_guards_everything_but_health_and_metrics(make_server):
    server = make_server(api_key="secret")
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert server.client(api_key="secret").models.list().data
    with server.http() as http:
        assert http.get("/health").status_code == http.get("/metrics").status_code == 200
        for path in ("/openapi.json", "/docs", "/v1/nothing-here"):
            refused = http.get(path)
            assert_error(refused, 401, None, "API key")
            assert refused.headers["www-authenticate"] == "Bearer"
        assert http.get("/openapi.json", headers={"authorization": "Bearer secret"}).json()["paths"]
        assert http.get("/v1/models", headers={"authorization": "bearer secret"}).status_code == 200
        for wrong in ("Bearer secre", "Bearer secrets", "Basic secret", "secret", "Bearer"):
            assert_error(http.get("/v1/models", headers={"authorization": wrong}), 401, None, "API key")


def test_allowed_origins_answer_a_browsers_preflight_before_its_key_is_asked(make_server, http):
    """A web page calling the API from a browser sends OPTIONS first, without the key: it got 405 (or 401)."""
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type, x-stainless-os"}
    assert http.options(CHAT, headers=preflight).status_code == 405  # no origin allowed: no CORS
    server = make_server(api_key="secret", allowed_origins=["https://app.example"])
    with server.http() as browser:
        answered = browser.options(CHAT, headers=preflight)
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in answered.headers["access-control-allow-methods"]
        assert "x-stainless-os" in answered.headers["access-control-allow-headers"]
        assert browser.options(CHAT, headers={**preflight, "origin": "https://evil.example"}).status_code == 400
        listed = browser.get("/v1/models", headers={"origin": "https://app.example", "authorization": "Bearer secret"})
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "https://app.example"
        refused = browser.get("/v1/models", headers={"origin": "https://app.example"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"


def post_json(http, url: str, body: dict):
    """POST `body` as JSON escaped to ASCII, as any client may send it: a lone surrogate travels as \\ud800."""
    return http.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


LONE = "caf\ud800"


@pytest.mark.parametrize("url, body, param", [
    (CHAT, chat_body(messages=[{"role": "user", "content": LONE}]), "messages[0].content"),
    (CHAT, chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
     "messages[0].content"),  # no form of the union fits: the field is named
    (CHAT, chat_body(messages=[{"role": "user", "content": "hi", "name": LONE}]), "messages[0].name"),
    (CHAT, chat_body(documents=["fine", LONE]), "documents[1]"),
    (CHAT, chat_body(stop=LONE), "stop"),
    (CHAT, chat_body(user=LONE), "user"),
    (CHAT, chat_body(cache_salt=LONE), "cache_salt"),
    (CHAT, chat_body(kvreuse={"method": LONE}), "kvreuse.method"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": LONE}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [LONE]}, "prompt"),
    ("/v1/caches", {"text": LONE}, "text"),
])
def test_a_lone_surrogate_in_any_text_field_is_a_400_and_the_connection_goes_on(http, client, url, body, param):
    assert_error(post_json(http, url, body), 400, param)
    assert http.post(CHAT, json=chat_body()).status_code == 200  # the same keep-alive connection


def test_bodies_the_parser_cannot_read_name_the_body(http):
    assert_error(http.post(CHAT, content=b'{"model": "\xff"}', headers={"content-type": "application/json"}),
                 400, "body", "utf-8")
    nested = b"[" * 100_000 + b"]" * 100_000
    assert_error(http.post(CHAT, content=nested, headers={"content-type": "application/json"}), 400, "body")


def test_a_body_over_the_limit_is_a_413_declared_or_streamed(make_server):
    server = make_server(max_request_bytes=4096)
    with server.http() as http:
        big = chat_body(documents=["word " * 1000])
        error = assert_error(http.post(CHAT, json=big), 413, "body", "4096 bytes")
        assert error["code"] == "request_too_large"
        chunked = (json.dumps(big)[i : i + 1000].encode() for i in range(0, len(json.dumps(big)), 1000))
        assert_error(http.post(CHAT, content=chunked, headers={"content-type": "application/json"}), 413, "body")
        assert http.post(CHAT, json=chat_body()).status_code == 200


def test_text_too_long_for_the_context_is_refused_before_it_is_tokenized(server, http, monkeypatch):
    """A few MB of text would hold a tokenizer thread for seconds; no token spans more characters than the
    longest vocabulary entry, so such a text is refused by its length alone."""
    service = server.service
    calls = []
    real_encode = service.engine.tokenizer.encode
    monkeypatch.setattr(service.engine.tokenizer, "encode", lambda *a, **k: calls.append(a) or real_encode(*a, **k))
    huge = "x" * (service.max_prompt_chars + 1)
    assert_error(http.post(CHAT, json=chat_body(documents=[huge])), 400, "messages", "characters")
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": huge}), 400, "prompt")
    assert_error(http.post("/v1/caches", json={"text": huge}), 400, "text", "characters")
    assert calls == []


def test_long_texts_are_tokenized_apart_a_few_at_a_time(server, http, monkeypatch):
    """One client's dozens of long texts (each a 400 only once tokenized) held both tokenizer threads: another
    client's one-token request waited 2.6 s instead of 0.07. They take a thread of their own, and past a few
    waiting they are a 429."""
    import kvreuse.server.service as service_module

    threads = []
    encode = server.service.engine.tokenizer.encode
    monkeypatch.setattr(server.service.engine.tokenizer, "encode",
                        lambda *a, **k: threads.append(threading.current_thread().name) or encode(*a, **k))
    monkeypatch.setattr(service_module, "LONG_TEXT_CHARACTERS", 40)
    long_prompt = {"model": MODEL_NAME, "prompt": "word " * 10, "max_tokens": 1}
    assert http.post("/v1/completions", json=long_prompt).status_code == 200
    assert http.post("/v1/completions", json={**long_prompt, "prompt": "word"}).status_code == 200
    assert threads[0].startswith("kv-tokenize-long") and not threads[-1].startswith("kv-tokenize-long")
    monkeypatch.setattr(service_module, "MAX_LONG_TEXTS", 0)
    refused = http.post("/v1/completions", json=long_prompt)
    assert_error(refused, 429, None, "texts of over 40 characters are being tokenized")
    assert refused.headers["retry-after"] == "1"
    assert http.post("/v1/completions", json={**long_prompt, "prompt": "word"}).status_code == 200
    assert_error(http.post("/detokenize", json={"tokens": [5] * (server.service.max_model_len + 1)}), 400,
                 "tokens", "more than the maximum context length")


def test_a_non_streaming_client_that_disconnects_frees_its_slot(make_server):
    server = make_server()
    body = json.dumps(chat_body(max_tokens=8000, ignore_eos=True)).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                     + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while not server.service.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.service.scheduler.running == 1
    gone = time.monotonic()
    while server.service.scheduler.running and time.monotonic() < gone + 30:
        time.sleep(0.05)
    assert time.monotonic() - gone < 3  # not the whole generation's time


def test_a_conversation_the_chat_template_refuses_is_a_400(make_server):
    server = make_server()
    server.service.engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with server.http() as http:
        assert_error(http.post(CHAT, json=chat_body()), 400, "messages", "roles must alternate")


def test_a_value_error_inside_the_engine_is_a_500_not_the_clients_fault(server, http, monkeypatch):
    """Every client error is found before a job starts; a ValueError raised in the engine is a bug."""
    def broken(*args, **kwargs):
        raise ValueError("an internal shape check")

    monkeypatch.setattr(server.service.engine, "prefill", broken)
    response = http.post(CHAT, json=chat_body())
    assert response.status_code == 500, response.text
    assert response.json()["error"]["message"] == "generation failed: ValueError"


def test_tokenize_refuses_what_a_request_would(http):
    assert_error(http.post("/tokenize", json={"messages": [{"role": "assistant", "content": "Hi."}]}), 400,
                 "messages", "the last message must be the user's")
    assert_error(http.post("/tokenize", json={"prompt": "x", "cache_ids": ["kvc-missing"]}), 404, "cache_ids[0]")
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens", "outside the vocabulary")
    assert_error(http.post("/tokenize", json={"model": "other", "prompt": "x"}), 404, "model")
    assert http.post("/tokenize", json={"text": "x"}).status_code == 400
