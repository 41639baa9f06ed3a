"""Shared fixtures. redis_server: a private redis-server on a free loopback port, started once per session."""

from __future__ import annotations

import pytest

from kvreuse.store.redis_server import LocalRedis


def start_redis() -> LocalRedis:
    # CI installs redis-server (make system-deps); a missing server is a set-up failure, never a silent skip.
    try:
        return LocalRedis()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def redis_server():
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def own_redis_server():
    """A server of this test's own, for tests that kill it."""
    server = start_redis()
    yield server
    server.stop()
