"""The private redis-server tests and benchmarks start: it never outlives its starter."""

from __future__ import annotations

import subprocess

import pytest

from kvreuse.store.redis_server import LocalRedis


def test_a_server_interrupted_while_starting_is_stopped(monkeypatch):
    """Ctrl-C (or SIGTERM turned into SystemExit) while waiting for the server: it is killed, not orphaned."""
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    monkeypatch.setattr(LocalRedis, "_wait_ready", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        LocalRedis()
    [server] = started
    assert server.poll() is not None  # exited: killed and reaped


def test_a_missing_redis_server_is_a_one_line_error(monkeypatch, capsys):
    from kvreuse.cli import main

    monkeypatch.setattr("shutil.which", lambda name: None)
    assert main(["cache", "bench", "--entries", "1", "--layers", "2", "--tokens", "8", "--emulate", ""]) == 2
    assert "kvreuse: error: redis-server is not installed" in capsys.readouterr().err
