"""A real server on a free loopback port (uvicorn in a thread of the test process), over the tiny model with the
real tokenizer, and clients for it."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.server.app import create_app
from kvreuse.server.config import ServerConfig
from kvreuse.server.service import EngineService

MODEL_NAME = "tiny"
PREFIX_BLOCK = 8  # small prefix blocks, so that a short test conversation spans several


@dataclass
class RunningServer:
    url: str
    service: EngineService
    _server: uvicorn.Server
    _thread: threading.Thread

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=options.pop("api_key", "unused"), max_retries=0,
                             **options)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def start_server(model_dir, **settings) -> RunningServer:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = ServerConfig(model=str(model_dir), served_model_name=[MODEL_NAME], port=sock.getsockname()[1],
                          **{"store": "memory:256MB", **settings})
    engine = ReuseEngine.load(config.model, config.store, prefix_block_size=config.prefix_block_size,
                              batch_restore=config.batch_restore)
    service = EngineService(engine, config)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return RunningServer(f"http://127.0.0.1:{config.port}", service, server, thread)


@pytest.fixture(scope="session")
def make_server(tiny_model_dir):
    """Factory of servers with their own settings, stopped at the end of the session."""
    servers = []

    def make(**settings) -> RunningServer:
        servers.append(start_server(tiny_model_dir, **settings))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(make_server) -> RunningServer:
    return make_server(prefix_block_size=PREFIX_BLOCK)


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture
def http(server):
    with server.http() as client:
        yield client
