"""ASGI middleware around the app, outermost first: every /v1 request counted once by outcome, the API key
required everywhere but /health and /metrics, and request bodies capped in size before anything reads them.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which buffers and detaches streamed responses."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from kvreuse.server.errors import APIError
from kvreuse.server.metrics import Metrics

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/metrics"})
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}
OUTCOME_STATE = "kvreuse_outcome"  # scope state key: how a stream really ended, when its 200 header says less


def endpoint_of(path: str) -> str:
    if path in ENDPOINTS:
        return ENDPOINTS[path]
    return "caches" if path.startswith("/v1/caches") else "other"


def outcome_of(status: int) -> str:
    if status == 200:
        return "finished"
    return {499: "cancelled", 408: "timeout", 429: "queue_full"}.get(
        status, "client_error" if status < 500 else "server_error")


def set_outcome(scope: Scope, status: int) -> None:
    """Record that the request ended with `status` although its response began as 200 (a streamed error or a
    client that went away mid-stream)."""
    scope.setdefault("state", {})[OUTCOME_STATE] = status


class RequestMetrics:
    """Counts every /v1 request exactly once, by endpoint, outcome and status, whatever ended it."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = 500  # unless a response starts: an exception escaping the app is a server error

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            status = scope.get("state", {}).get(OUTCOME_STATE, status)
            self.metrics.request(endpoint_of(scope["path"]), outcome_of(status), status)


class RequireAPIKey:
    """With a key configured, every path but the open ones (health, metrics) needs `Authorization: Bearer KEY`,
    the OpenAPI schema and its docs page included."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app, self.expected = app, api_key.encode() if api_key else None

    def _authorized(self, header: bytes | None) -> bool:
        scheme, _, key = (header or b"").partition(b" ")
        # The scheme is case-insensitive (RFC 7235); the key compared in constant time, so that the time an
        # answer takes says nothing about how much of a guess was right.
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.expected and scope["path"] not in OPEN_PATHS:
            if not self._authorized(dict(scope["headers"]).get(b"authorization")):
                error = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # RFC 6750
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses a body over `max_bytes` with a 413: at once when Content-Length says so, else as soon as the
    chunks received pass it. The body is read here, up to the limit, and handed on whole: the app's own body
    parsing would turn any error raised while it reads into a 400."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        body, message = bytearray(), await receive()
        while message["type"] == "http.request":
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": bytes(body), "more_body": False}
                break
            message = await receive()
        first = [message]

        async def replay() -> Message:
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body exceeds the server's limit of {self.max_bytes} bytes", "body",
                         "request_too_large")
        await error.response()(scope, receive, send)
