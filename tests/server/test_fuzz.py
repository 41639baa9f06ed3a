"""A schema fuzz run: schemathesis generates requests from the OpenAPI spec the server serves, valid ones and
ones that break it, for every operation; none may get a 5xx, and every error has an OpenAI-style body. Then
hostile string contents (lone surrogates, control characters, NUL, very long text) in every text field: never a
5xx, and the same connection serves a normal request afterwards."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES_PER_OPERATION_AND_MODE = 20  # the whole run stays well under a minute on two cores


@pytest.fixture(scope="module")
def schema(make_server):
    # Short budgets keep each generated request quick; a request over its time gets a 408, never a 5xx.
    server = make_server(max_model_len=256, default_max_tokens=8, request_timeout=5, max_concurrency=2)
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def operations(schema, mode) -> list:
    """The spec's operations; for invalid input, only those that take any (a parameterless GET has none)."""
    found = [result.ok() for result in schema.get_all_operations()]
    if mode == schemathesis.GenerationMode.NEGATIVE:
        found = [op for op in found if list(op.iter_parameters()) or list(op.body)]
    return found


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_no_input_gets_a_server_error(schema, mode):
    tested = []
    for operation in operations(schema, mode):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_OPERATION_AND_MODE, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def no_server_error(case):
            response = case.call(timeout=30)
            assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text}"
            if response.status_code >= 400:
                assert response.json()["error"]["message"], response.text

        no_server_error()
        tested.append(operation.label)
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/caches"} <= set(tested)


NASTY_PIECES = ["\ud800", "\udfff", "\x00", "\x1b[31m", "\u202e", "\ufeff", "\r\n", "a", " ", "é", "😀", "{{", "%s"]
NASTY_TEXT = st.one_of(st.lists(st.sampled_from(NASTY_PIECES), max_size=30).map("".join), st.text(max_size=50),
                       st.sampled_from(["x" * 200_000, "\ud800" * 10_000]))
# (endpoint, a valid body, a setter of one text field in it)
TEXT_FIELDS = {
    "messages[0].content": ("/v1/chat/completions", lambda b, t: b["messages"][0].update(content=t)),
    "messages[0].name": ("/v1/chat/completions", lambda b, t: b["messages"][0].update(name=t)),
    "system content": ("/v1/chat/completions", lambda b, t: b["messages"].insert(0, {"role": "system", "content": t})),
    "documents[0]": ("/v1/chat/completions", lambda b, t: b.update(documents=[t])),
    "stop": ("/v1/chat/completions", lambda b, t: b.update(stop=[t])),
    "user": ("/v1/chat/completions", lambda b, t: b.update(user=t)),
    "cache_salt": ("/v1/chat/completions", lambda b, t: b.update(cache_salt=t)),
    "model": ("/v1/chat/completions", lambda b, t: b.update(model=t)),
    "kvreuse.method": ("/v1/chat/completions", lambda b, t: b.update(kvreuse={"method": t})),
    "prompt": ("/v1/completions", lambda b, t: b.update(prompt=t)),
    "prompt, echoed": ("/v1/completions", lambda b, t: b.update(prompt=t, echo=True, n=2)),
    "logit_bias key": ("/v1/chat/completions", lambda b, t: b.update(logit_bias={t: 1.0})),
    "caches text": ("/v1/caches", lambda b, t: b.update(text=t)),
}


def valid_body(url: str) -> dict:
    if url == "/v1/caches":
        return {"text": "A passage."}
    if url == "/v1/completions":
        return {"prompt": "Hello", "max_tokens": 2}
    return {"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def fuzz_http(make_server):
    server = make_server(max_model_len=256, default_max_tokens=2, request_timeout=5)
    with server.http() as http:
        yield http


@given(field=st.sampled_from(sorted(TEXT_FIELDS)), text=NASTY_TEXT)
@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_string_in_any_text_field_gets_a_server_error(fuzz_http, field, text):
    url, set_field = TEXT_FIELDS[field]
    body = valid_body(url)
    set_field(body, text)
    response = fuzz_http.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert response.status_code < 500, f"{field}={text[:40]!r}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    follow_up = fuzz_http.post("/v1/completions", json=valid_body("/v1/completions"))  # same connection
    assert follow_up.status_code == 200, follow_up.text
