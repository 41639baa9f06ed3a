"""Tenant isolation through every way a request can hit the cache: documents, cache ids, the exact prefix (a
system prompt's blocks) and conversation history. Within a salt, the second request reuses what the first
stored; under another salt, or none, nothing is reused, and not even `cached_tokens` tells that it was stored."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from .conftest import MODEL_NAME, PREFIX_BLOCK

GREEDY = dict(model=MODEL_NAME, temperature=0, max_tokens=2)


def unique(text: str) -> str:
    """`text` led by words no other test sends, so its chunks and prefix blocks are this test's alone."""
    return f"Tag {uuid.uuid4().hex} says: {text}"


def reused(usage) -> dict:
    """What a response says it reused: OpenAI's cached tokens and ours, per way of reuse."""
    ours = usage.model_extra["kvreuse"]
    return {"cached_tokens": usage.prompt_tokens_details.cached_tokens, "chunk_hits": ours["chunk_hits"],
            "restored_prefix_tokens": ours["restored_prefix_tokens"]}


NOTHING = {"cached_tokens": 0, "chunk_hits": 0, "restored_prefix_tokens": 0}


@pytest.fixture
def ask(server) -> Callable[..., dict]:
    client = server.client()

    def ask(salt: str | None, messages: list[dict], **extra) -> dict:
        """One chat request under `salt`; its write-back is finished before this returns."""
        body = dict(extra, **({"cache_salt": salt} if salt else {}))
        response = client.chat.completions.create(messages=messages, **GREEDY, extra_body=body)
        server.service.engine.wait_for_write_back()
        return reused(response.usage)

    return ask


def check_isolated(ask: Callable[..., dict], messages: list[dict], stored: Callable[[dict], bool], **extra):
    """Tenant A's second request reuses what its first stored (`stored` holds); another tenant's and a request
    without a salt reuse nothing of it."""
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    ask(tenant, messages, **extra)
    assert stored(ask(tenant, messages, **extra))
    assert ask(f"other-{uuid.uuid4().hex[:8]}", messages, **extra) == NOTHING
    assert ask(None, messages, **extra) == NOTHING


def question() -> list[dict]:
    return [{"role": "system", "content": unique("Answer briefly.")},
            {"role": "user", "content": "Which river runs through the city?"}]


def test_documents_do_not_cross_a_salt(ask):
    documents = [unique("The city lies on the Vell."), unique("Its bridge dates from 1420.")]
    check_isolated(ask, question(), lambda r: r["chunk_hits"] == 2 and r["cached_tokens"] > 0, documents=documents,
                   kvreuse={"method": "naive"})


def test_a_system_prompts_blocks_do_not_cross_a_salt(ask):
    system = unique("You are the archivist of the Vell valley. " * 12)  # several prefix blocks long
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who are you?"}]
    check_isolated(ask, messages, lambda r: r["restored_prefix_tokens"] >= 4 * PREFIX_BLOCK,
                   kvreuse={"method": "prefix"})


def test_conversation_history_does_not_cross_a_salt(ask):
    history = [*question(), {"role": "assistant", "content": "The Vell, which crosses the old town from east to west."}]
    messages = [*history, {"role": "user", "content": "And its bridge?"}]
    check_isolated(ask, messages, lambda r: r["restored_prefix_tokens"] >= 2 * PREFIX_BLOCK,
                   kvreuse={"method": "prefix"})


def test_a_cache_id_and_its_stored_chunk_do_not_cross_a_salt(server, ask):
    text = unique("A manual of the Vell river's bridges, chapter one.")
    with server.http() as http:
        created = http.post("/v1/caches", json={"text": text, "cache_salt": "cache-owner"})
        assert created.status_code == 200, created.text
        cache_id = created.json()["id"]
        assert ask("cache-owner", question(), cache_ids=[cache_id], kvreuse={"method": "naive"})["chunk_hits"] == 1
        for salt in ("cache-thief", None):
            refused = http.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": question(), "max_tokens": 2, "cache_ids": [cache_id],
                **({"cache_salt": salt} if salt else {})})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "cache_not_found"
            assert http.get(f"/v1/caches/{cache_id}", params={"cache_salt": salt} if salt else {}).status_code == 404
            assert http.delete(f"/v1/caches/{cache_id}", params={"cache_salt": salt} if salt else {}).status_code == 404
    # the same text sent as a document by another tenant is computed, not found under the owner's key
    assert ask("cache-thief", question(), documents=[text], kvreuse={"method": "naive"}) == NOTHING


def test_the_access_log_hides_a_tenants_cache_salt():
    """The context-cache API takes the salt in the query, which uvicorn's access log shows at info level: the one
    key to a tenant's caches, hidden there by the server it runs."""
    import logging

    import uvicorn

    from kvreuse.server.app import GracefulServer

    GracefulServer(uvicorn.Config(app=None), service=None)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/caches/kvc-1?cache_salt=acme-42&x=1", "1.1", 200), None)
    assert all(f.filter(record) for f in logging.getLogger("uvicorn.access").filters)
    assert record.getMessage() == '127.0.0.1:5 - "GET /v1/caches/kvc-1?cache_salt=***&x=1 HTTP/1.1" 200'
