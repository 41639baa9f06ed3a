"""OpenAI-style error bodies for every failure, so a client library raises its usual exception and bad input
always gets a 4xx that names the problem."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvreuse.server.protocol import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    @property
    def body(self) -> ErrorResponse:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorResponse(error=ErrorDetail(message=self.message, type=kind, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _field_path(loc: tuple) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _common_prefix(locs: list[tuple]) -> tuple:
    prefix = locs[0]
    for loc in locs[1:]:
        prefix = prefix[: next((i for i, (a, b) in enumerate(zip(prefix, loc)) if a != b), min(len(prefix), len(loc)))]
    return prefix


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # A union's forms each fail: the message of a check of ours (a ValueError) says more than "not a string".
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('msg')}", "body")
    loc = tuple(first.get("loc", ()))
    # A value matching no form of a union fails once per form, each under the form's name: name the field.
    locations = [tuple(e.get("loc", ())) for e in errors]
    param = _field_path(_common_prefix([where for where in locations if where[:2] == loc[:2]]))
    if not param or param == "body":
        return bad_request(f"the body must be a JSON object (Content-Type: application/json): {first.get('msg')}",
                           "body")
    return bad_request(f"{param}: {first.get('msg')}", param)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI's only 400 is a body it could not parse (not UTF-8, nested too deeply for the parser)
        param = "body" if exc.status_code == 400 else None
        # Starlette's own headers kept: a 405's Allow lists the methods the path takes
        return APIError(exc.status_code, f"{exc.detail}" + (f": {exc.__cause__}" if exc.__cause__ else ""),
                        param, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()
