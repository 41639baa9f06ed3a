"""Settings: defaults < YAML < KVREUSE_* environment < flags; bad settings name themselves. And `kvreuse serve`
itself, started as a user would."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvreuse.cli import build_parser
from kvreuse.cli.serve import config_from_args
from kvreuse.server.config import ServerConfig, load_config
from kvreuse.server.service import EngineService


def test_each_source_overrides_the_one_before(tmp_path):
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("port: 9001\nmax-queue: 7\nstore: disk:/tmp/kv\nmethod: naive\n")
    environ = {"KVREUSE_PORT": "9002", "KVREUSE_SERVED_MODEL_NAME": "a, b", "KVREUSE_CACHE_DIR": "/elsewhere"}
    config = load_config({"method": "full", "host": None}, str(config_file), environ)
    assert (config.port, config.max_queue, config.store, config.method) == (9002, 7, "disk:/tmp/kv", "full")
    assert config.served_model_name == ["a", "b"] and config.host == ServerConfig.host


def test_the_config_file_may_come_from_the_environment(tmp_path):
    (tmp_path / "c.yaml").write_text("max_concurrency: 3\n")
    assert load_config({}, None, {"KVREUSE_CONFIG": str(tmp_path / "c.yaml")}).max_concurrency == 3


def test_flags_reach_the_config():
    args = build_parser().parse_args(["serve", "some/model", "--port", "0", "--max-concurrency", "2",
                                      "--served-model-name", "x", "y", "--decode-pool", "512MiB",
                                      "--max-token-gap-ms", "40"])
    config = config_from_args(args)
    assert (config.model, config.port, config.max_concurrency, config.served_model_name, config.decode_pool,
            config.max_token_gap_ms) == ("some/model", 0, 2, ["x", "y"], "512MiB", 40.0)


def test_the_token_gap_reaches_the_scheduler_in_seconds_and_is_off_by_default(tiny_chat_engine):
    service = EngineService(tiny_chat_engine, ServerConfig(max_token_gap_ms=40))
    assert service.scheduler.max_token_gap == pytest.approx(0.04)
    assert EngineService(tiny_chat_engine, ServerConfig()).scheduler.max_token_gap is None


@pytest.mark.parametrize("method, measured", [("auto", True), ("auto:kl=0.1", True), ("naive", False)])
def test_a_server_whose_default_is_auto_has_its_machine_profile_before_its_first_request(
        tiny_chat_engine, monkeypatch, method, measured):
    from kvreuse.controller import measure

    profiles = []
    monkeypatch.setattr(measure, "ensure_profile", lambda *args: profiles.append(args) or None)
    monkeypatch.setattr("kvreuse.controller.auto.AutoController.__init__", lambda self, *args: None)
    monkeypatch.setattr(tiny_chat_engine, "_controller", None)
    service = EngineService(tiny_chat_engine, ServerConfig(method=method))
    service.start()
    service.scheduler.stop()
    assert bool(profiles) == measured


@pytest.mark.parametrize(
    "yaml_text, environ, message",
    [
        ("colour: red\n", {}, "unknown setting(s) colour"),
        ("- a list\n", {}, "expected a mapping"),
        ("port: [1\n", {}, "not valid YAML"),
        ("", {"KVREUSE_PORT": "eighty"}, "KVREUSE_PORT: port must be int"),
        ("", {"KVREUSE_MAX_CONCURRENCY": "0"}, "max_concurrency: invalid value 0"),
        ("decode_pool: lots\n", {}, "decode_pool: invalid value 'lots'"),
        ("decode_weights: int4\n", {}, "decode_weights: invalid value 'int4'; expected one of model, int8"),
        ("", {"KVREUSE_MAX_TOKEN_GAP_MS": "-1"}, "max_token_gap_ms: invalid value -1.0"),
        ("port: true\n", {}, "port must be int, got True"),  # not port 1
        ("port: 8000.9\n", {}, "port must be int, got 8000.9"),  # not port 8000
        ("request_timeout: false\n", {}, "request_timeout must be float, got False"),
        ("", {"KVREUSE_API_KEY": ""}, "api_key: invalid value ''"),  # an unset secret: not an open API
        ("api_key: '  '\n", {}, "api_key: invalid value ''"),
        ("api_key:\n", {}, "api_key is empty; give the key"),  # a templated secret left unset: not an open API
        ("method: bogus\n", {}, "method: unknown method 'bogus'"),
        ("", {"KVREUSE_DTYPE": "bf16"}, "dtype: invalid value 'bf16'; expected one of float32, bfloat16, float16"),
        ("log_level: loud\n", {}, "log_level: invalid value 'loud'"),
        ("store: memory:0\n", {}, "store: bad store spec 'memory:0': bad size '0'"),
        ("", {"KVREUSE_STORE": "throttled:floppy:memory:1GB"}, "store: bad store spec 'throttled:floppy"),
    ],
)
def test_bad_settings_name_themselves(tmp_path, yaml_text, environ, message):
    (tmp_path / "c.yaml").write_text(yaml_text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config({}, str(tmp_path / "c.yaml"), environ)


def test_a_config_file_that_is_not_text_is_named(tmp_path):
    (tmp_path / "c.yaml").write_bytes(b"port: \xd0\xff\n")
    with pytest.raises(ValueError, match=r"config .*c\.yaml: not valid YAML: 'utf-8' codec"):
        load_config({}, str(tmp_path / "c.yaml"), {})


def test_a_setting_left_empty_in_the_file_keeps_its_default(tmp_path):
    (tmp_path / "c.yaml").write_text("port:\nmax_concurrency: null\n")
    assert load_config({}, str(tmp_path / "c.yaml"), {}) == ServerConfig()


def test_an_api_key_read_with_a_newline_is_the_key_clients_send():
    """A key from a secret file ends in a newline; clients send it without: every request was a 401."""
    assert ServerConfig(api_key=" s3cret\n").api_key == "s3cret"
    assert load_config({}, None, {"KVREUSE_API_KEY": "s3cret\n"}).api_key == "s3cret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_kvreuse_serve_starts_from_the_command_line(tiny_model_dir, tmp_path):
    port = free_port()
    (tmp_path / "serve.yaml").write_text(f"served_model_name: tiny-cli\nstore: disk:{tmp_path / 'kv'}\n")
    env = {**os.environ, "KVREUSE_PORT": str(port), "KVREUSE_CONFIG": str(tmp_path / "serve.yaml"),
           "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "kvreuse.cli", "serve", str(tiny_model_dir)], env=env,
                               cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "kvreuse serve did not answer within 120 s"
                time.sleep(0.5)
        assert [m["id"] for m in models["data"]] == ["tiny-cli"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_kvreuse_serve_refuses_bad_settings_before_loading_anything(capsys):
    from kvreuse.cli import main

    assert main(["serve", "--max-queue", "-1"]) == 2
    assert "max_queue: invalid value -1" in capsys.readouterr().err
    assert main(["serve", "--method", "bogus"]) == 2  # was the server's start-up failing, after the model loaded
    assert "method: unknown method 'bogus'" in capsys.readouterr().err


def _serve_without_a_server(monkeypatch, argv: list[str], on_run=lambda: None) -> tuple[dict, list]:
    """Run `kvreuse serve argv` with the engine's load, the service and the HTTP server replaced: what the load
    was handed, and the uvicorn configs the server was made with (`on_run` called where it would serve)."""
    import uvicorn

    from kvreuse.engine import reuse
    from kvreuse.server import app, service

    loaded = {}

    def load(*args, **kwargs):
        loaded.update(args=args, kwargs=kwargs)
        return object()

    monkeypatch.setattr(reuse.ReuseEngine, "load", load)
    monkeypatch.setattr(service, "EngineService", lambda engine, config: None)
    monkeypatch.setattr(app, "create_app", lambda engine_service: None)
    served = []

    class NoServer:
        def __init__(self, config: uvicorn.Config, service) -> None:
            served.append(config)

        def run(self) -> None:
            on_run()

    monkeypatch.setattr(app, "GracefulServer", NoServer)
    args = build_parser().parse_args(["serve", *argv])
    try:
        assert args.func(args) == 0
    finally:
        gc.unfreeze()  # what serve froze goes back to the collector: this process goes on with other tests
    return loaded, served


def test_serve_loads_the_engine_with_the_config_s_model_settings(monkeypatch):
    """What `kvreuse serve` hands the engine it loads (the server itself is not started)."""
    loaded, served = _serve_without_a_server(monkeypatch, ["some/model", "--dtype", "float32", "--decode-weights",
                                                           "int8", "--prefix-block-size", "64", "--shutdown-timeout",
                                                           "3"])
    assert served[0].timeout_graceful_shutdown == 3
    assert loaded["args"] == ("some/model", "memory:4GB", "float32", "int8")
    assert loaded["kwargs"]["prefix_block_size"] == 64


def test_serve_freezes_what_its_start_made_before_it_serves(monkeypatch):
    """The start's objects (the model, its tokenizer, the modules) out of the collector's full passes."""
    assert gc.get_freeze_count() == 0
    frozen_when_serving = []
    _serve_without_a_server(monkeypatch, ["some/model"], lambda: frozen_when_serving.append(gc.get_freeze_count()))
    assert frozen_when_serving[0] > 10_000 and gc.get_freeze_count() == 0
