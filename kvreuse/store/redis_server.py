"""Start and stop a private redis-server on a free loopback port (tests and `kvreuse cache bench`)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis

INSTALL_HINT = "install it with `apt-get install redis-server` (or `make system-deps`)"


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServerError(OSError):
    """A private redis-server could not be started (not installed, exited, never answered)."""


class LocalRedis:
    """A throw-away redis-server: loopback only, no persistence, its files in a temp dir."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerError(f"redis-server is not installed: {INSTALL_HINT}")
        self.dir = tempfile.TemporaryDirectory(prefix="kvreuse-redis-")
        self.port = free_loopback_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            self._wait_ready()
        except BaseException:  # not ready, or interrupted meanwhile: the server must not outlive the caller
            self.stop()
            raise

    def _wait_ready(self, timeout: float = 10.0) -> None:
        client = redis.Redis(port=self.port, host="127.0.0.1", socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerError(f"redis-server exited with code {self.proc.returncode} on port {self.port}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
            finally:
                client.close()
        raise RedisServerError(f"redis-server did not answer on port {self.port} within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.dir.cleanup()

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
