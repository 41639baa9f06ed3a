"""The load benchmark runs against the same in-process test server as the server's own tests."""

from ..server.conftest import make_server  # noqa: F401  (a fixture, used by name)
