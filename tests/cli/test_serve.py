"""`kvreuse serve` as a user runs it: a process of its own, stopped by a signal."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


@pytest.mark.timeout(120)
def test_a_stream_running_when_the_server_stops_ends_with_an_error_event_and_done(tiny_model_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "kvreuse.cli", "serve", str(tiny_model_dir), "--port", str(port),
         "--shutdown-timeout", "2", "--store", "memory:64MB", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.TransportError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8000, "ignore_eos": True,
                "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 3:  # tokens are coming: stop the server mid-stream
                        server.send_signal(signal.SIGINT)
        output = server.communicate(timeout=60)[0]
    finally:
        server.kill()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    assert server.returncode == 0 and "Traceback" not in output, output
