"""/metrics accounts for every request exactly once, whatever ended it: finished, refused (4xx by code),
rejected by a full queue, cancelled mid-stream, failed on the server; and shows the store's fault counters."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.engine import write_back as write_back_module

from .conftest import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Hello?"}]
KEY = {"authorization": "Bearer secret"}


def samples(http, name: str) -> dict[tuple, float]:
    text = http.get("/metrics").text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def requests_counted(http) -> dict[tuple[str, str, str], float]:
    return {(labels["endpoint"], labels["outcome"], labels["code"]): value
            for labels, value in ((dict(k), v) for k, v in samples(http, "kvreuse_requests_total").items())}


def body(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **fields}


@pytest.fixture
def server(make_server):
    return make_server(api_key="secret", max_concurrency=1, max_queue=0, max_request_bytes=4096)


def test_every_request_is_counted_once_by_endpoint_outcome_and_code(server, monkeypatch):
    client = server.client(api_key="secret")
    with server.http() as http:
        http.headers.update(KEY)
        client.chat.completions.create(**body())
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
        client.models.list()
        assert http.post("/v1/chat/completions", json=body(temperature="hot")).status_code == 400
        assert http.post("/v1/chat/completions", json=body(model="gpt-9")).status_code == 404
        assert http.post("/v1/chat/completions", json=body(documents=["w " * 3000])).status_code == 413
        assert http.post("/v1/chat/completions", json=body(), headers={"authorization": "Bearer no"}).status_code == 401
        stream = client.chat.completions.create(**body(max_tokens=4000, stream=True), extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks), next(chunks)  # running: the only slot is taken
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(**body())
        stream.close()  # the client goes away mid-stream
        wait_until_idle(server)
        monkeypatch.setattr(server.service.engine, "prefill", broken)
        assert http.post("/v1/chat/completions", json=body()).status_code == 500
        streamed_failure = http.post("/v1/chat/completions", json=body(stream=True))
        assert '"server_error"' in streamed_failure.text
        counted = requests_counted(http)
        assert counted == {
            ("chat", "finished", "200"): 1, ("completions", "finished", "200"): 1, ("models", "finished", "200"): 1,
            ("chat", "client_error", "400"): 1, ("chat", "client_error", "404"): 1,
            ("chat", "client_error", "413"): 1, ("chat", "client_error", "401"): 1,
            ("chat", "queue_full", "429"): 1, ("chat", "cancelled", "499"): 1, ("chat", "server_error", "500"): 2,
        }
        assert samples(http, "kvreuse_queue_rejections_total") == {(): 1.0}
        assert samples(http, "kvreuse_generation_tokens_total")[()] >= 4


def broken(*args, **kwargs):
    raise RuntimeError("device lost")


def wait_until_idle(server) -> None:
    deadline = time.monotonic() + 30
    while server.service.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.service.scheduler.running == 0


def test_store_faults_are_counted_by_tier(make_server, tmp_path):
    server = make_server(store=f"memory:64MB,disk:{tmp_path}")
    disk = server.service.engine.store.tiers[1]
    disk._write("0" * 64, b"not an entry")
    assert disk.get("0" * 64) is None
    with server.http() as http:
        events = {dict(k)["event"]: v for k, v in samples(http, "kvreuse_store_events_total").items()
                  if dict(k)["tier"] == disk.name}
        memory = {dict(k)["event"] for k in samples(http, "kvreuse_store_events_total") if dict(k)["tier"] == "memory"}
    assert events["damaged"] == 1 and events["unavailable"] == 0
    assert memory == {"damaged", "unavailable", "write_errors", "wrong_model", "evictions"}


def test_store_writes_waiting_for_the_engine_thread_and_dropped_are_shown(server, monkeypatch):
    write_back = server.service.engine.write_back
    monkeypatch.setattr(write_back_module, "MAX_PENDING", 2)
    release = threading.Event()
    write_back.submit("a slow write", release.wait)  # the engine thread takes it and waits there
    deadline = time.monotonic() + 30
    while write_back.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    for key in ("first", "next", "last"):  # the third finds two waiting: the oldest is dropped
        write_back.submit(key, lambda: None)
    with server.http() as http:
        dropped = samples(http, "kvreuse_write_back_dropped_total")[()]
        assert samples(http, "kvreuse_write_back_pending") == {(): 2.0}
        release.set()
        write_back.wait()
        assert samples(http, "kvreuse_write_back_pending") == {(): 0.0}
    assert dropped == write_back.dropped == 1
    write_back.submit("asked once", lambda: None, second_ask=True)  # remembered, not queued
    with server.http() as http:
        assert samples(http, "kvreuse_write_back_held_back_total") == {(): write_back.held_back} != {(): 0.0}


def histogram(http, name: str) -> tuple[float, float, float]:
    """A histogram's count, sum, and count in its first bucket (le=0.001: the pauses' "nothing ran")."""
    text = http.get("/metrics").text
    found = {s.name[len(name):] + s.labels.get("le", ""): s.value for family in text_string_to_metric_families(text)
             for s in family.samples if s.name.startswith(name)}
    return found["_count"], found["_sum"], found.get("_bucket0.001", 0.0)


@pytest.mark.parametrize("gap_ms", [None, 0])
def test_a_first_token_s_wait_is_split_into_queue_prefill_and_pauses(make_server, monkeypatch, gap_ms):
    """Each finished request adds its queueing, its prompt's own computation and the work run between its layers
    (decoding a running stream there: gap 0) to three histograms, the figures its usage reports."""
    server = make_server(max_concurrency=2, max_token_gap_ms=gap_ms)
    decode_batch = server.service.engine.model.decode_batch
    # a decoding step that takes the time of a real one (the tiny model's may take less than the first bucket)
    monkeypatch.setattr(server.service.engine.model, "decode_batch", lambda *a: time.sleep(0.005) or decode_batch(*a))
    client = server.client()
    with server.http() as http:
        stream = client.chat.completions.create(**body(max_tokens=4000, stream=True), extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks), next(chunks)  # decoding
        usage = http.post("/v1/chat/completions", json=body(messages=[{"role": "user", "content": "Hi " * 40}]))
        usage = usage.json()["usage"]["kvreuse"]
        stream.close()
        wait_until_idle(server)
        queue_count, queue_sum, _ = histogram(http, "kvreuse_request_queue_time_seconds")
        prefill_count, prefill_sum, _ = histogram(http, "kvreuse_request_prefill_time_seconds")
        paused_count, paused_sum, unpaused = histogram(http, "kvreuse_request_prefill_paused_seconds")
    assert queue_count == prefill_count == paused_count == 1  # the stream was cancelled: not a finished one
    assert queue_sum == pytest.approx(usage["queue_seconds"])
    assert prefill_sum >= usage["compute_seconds"] > 0
    assert paused_sum == pytest.approx(usage["paused_seconds"])
    assert unpaused == (0 if gap_ms == 0 else 1)


def test_a_batch_of_prompts_counts_each_prompt_and_choice(make_server):
    server = make_server()
    with server.http() as http:
        before = (samples(http, "kvreuse_prompt_tokens_total")[()],
                  histogram(http, "kvreuse_time_to_first_token_seconds"),
                  samples(http, "kvreuse_generation_tokens_total")[()])
        answer = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [[9, 10, 11], [12, 13]], "n": 2,
                                                    "max_tokens": 3, "ignore_eos": True}).json()
        assert samples(http, "kvreuse_prompt_tokens_total")[()] - before[0] == 5 == answer["usage"]["prompt_tokens"]
        assert histogram(http, "kvreuse_time_to_first_token_seconds")[0] - before[1][0] == 2  # one each prompt
        assert samples(http, "kvreuse_generation_tokens_total")[()] - before[2] == 12  # 2 prompts x 2 choices x 3
