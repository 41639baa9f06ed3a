"""/metrics accounts for every request exactly once, whatever ended it: finished, refused (4xx by code),
rejected by a full queue, cancelled mid-stream, failed on the server; and shows the store's fault counters."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

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


def test_store_writes_waiting_for_the_engine_thread_are_shown(server):
    write_back = server.service.engine.write_back
    release = threading.Event()
    write_back.submit("a slow write", release.wait)  # the engine thread takes it and waits there
    write_back.submit("next", lambda: None)
    write_back.submit("last", lambda: None)
    deadline = time.monotonic() + 30
    while write_back.pending > 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    with server.http() as http:
        assert samples(http, "kvreuse_write_back_pending") == {(): 2.0}
        release.set()
        write_back.wait()
        assert samples(http, "kvreuse_write_back_pending") == {(): 0.0}
