"""Requests that arrive together with a stored conversation prefix have their prefixes restored together, as
CacheFlow restores a batch (`--batch-restore on`; auto does so only for tiers whose reads wait, which the memory
tier's do not); /metrics says so, and every answer equals the one the request gets alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import MODEL_NAME, PREFIX_BLOCK
from .test_metrics import samples

HISTORY = [{"role": "system", "content": "You are a careful assistant who answers questions about rivers."},
           {"role": "user", "content": "Which river runs through Paris?"},
           {"role": "assistant", "content": "The Seine runs through Paris, from east to west."}]
QUESTIONS = ["And through Rome?", "And through Vienna?", "And through London?", "And through Cairo?"]


def ask(client, question: str) -> tuple[str, dict]:
    response = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=6, messages=[*HISTORY, {"role": "user", "content": question}],
        extra_body={"kvreuse": {"method": "prefix"}, "cache_salt": "batch-restore-test"})
    return response.choices[0].message.content, response.usage.model_extra["kvreuse"]


def restorations(http) -> dict[str, float]:
    """Restorations counted by /metrics, by mode (summed over strategies)."""
    by_mode: dict[str, float] = {}
    for labels, value in samples(http, "kvreuse_prefix_restorations_total").items():
        by_mode[dict(labels)["mode"]] = by_mode.get(dict(labels)["mode"], 0) + value
    return by_mode


@pytest.fixture
def server(make_server):
    return make_server(prefix_block_size=PREFIX_BLOCK, max_concurrency=4, max_prefill_batch=4, batch_restore="on")


def test_concurrent_requests_restore_their_stored_prefixes_together_and_answer_as_alone(server):
    client = server.client()
    for _ in range(40):  # the history's blocks are written back off the request's path
        if ask(client, "And through Berlin?")[1]["restored_prefix_tokens"]:
            break
        time.sleep(0.1)
    scheduler = server.service.scheduler
    gate = threading.Event()
    scheduler.call(lambda: gate.wait(60))  # hold the engine thread so that all four requests wait together
    with server.http() as http, ThreadPoolExecutor(len(QUESTIONS)) as pool:
        before = restorations(http)
        assert before == {"alone": 1}  # the warm-up requests that found nothing stored are not restorations
        together = [pool.submit(ask, client, q) for q in QUESTIONS]
        deadline = time.monotonic() + 30
        while scheduler.waiting < len(QUESTIONS) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scheduler.waiting == len(QUESTIONS)
        gate.set()
        together = [f.result(timeout=120) for f in together]
        after = restorations(http)
        assert after.get("batch", 0) - before.get("batch", 0) == len(QUESTIONS)
        assert after.get("alone", 0) == before.get("alone", 0)
        for question, (text, usage) in zip(QUESTIONS, together):
            assert usage["restored_prefix_tokens"] >= 2 * PREFIX_BLOCK
            alone_text, alone_usage = ask(client, question)
            assert alone_usage["restored_prefix_tokens"] == usage["restored_prefix_tokens"]
            assert text == alone_text
        assert restorations(http)["alone"] - after.get("alone", 0) == len(QUESTIONS)
