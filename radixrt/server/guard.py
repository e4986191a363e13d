"""What every radixrt HTTP app (`radixrt serve`'s and `radixrt router`'s) does the same way
before and around its endpoints: OpenAI-style error responses, the API-key and body-size guard
(an ASGI middleware), and reading a JSON-object body.

Invariant: every error leaves as `{"error": {"message", "type", "param", "code"}}` with the
`ApiError`'s status and headers; only `open_paths` are served without the API key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from radixrt.server.protocol import ApiError, bad

OPEN_PATHS = ("/health", "/metrics")


def error_response(err: ApiError) -> JSONResponse:
    """The OpenAI-style JSON response of `err`."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# OpenAI routes a client may try that radixrt does not serve, with where to go instead.
NOT_SERVED = {
    "/v1/conversations": "the Conversations API is not served; continue a conversation with "
                         "'previous_response_id' on /v1/responses, or send its messages to "
                         "/v1/chat/completions",
}


def routing_error(method: str, path: str, status: int, detail: object) -> ApiError:
    """The OpenAI-style error for a request no endpoint took: an unknown URL (404), a known one
    with another method (405), or any other HTTP error the framework raised before an
    endpoint ran."""
    if status == 404:
        hint = NOT_SERVED.get(path.rstrip("/"))
        return ApiError(404, f"unknown URL: {method} {path}" + (f"; {hint}" if hint else ""),
                        code="unknown_url")
    if status == 405:
        return ApiError(405, f"method {method} is not allowed on {path}",
                        code="method_not_allowed")
    return ApiError(status, str(detail))


def too_large(max_request_bytes: int) -> ApiError:
    return ApiError(413, f"request body larger than {max_request_bytes} bytes",
                    code="request_too_large")


class Guard:
    """ASGI middleware: 401 without `Authorization: Bearer <api_key>` (when a key is set;
    `open_paths` excepted), 413 when the declared body exceeds `max_request_bytes`; anything
    else goes to the app untouched. Plain ASGI rather than Starlette's `@app.middleware("http")`
    (BaseHTTPMiddleware), which passes every chunk of a streamed response through a memory
    stream between two tasks: per token of every stream, in the process that also shares the
    scheduler's cores."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int,
                 open_paths: Sequence[str]):
        self.app = app
        self.auth = f"Bearer {api_key}".encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.open_paths = frozenset(open_paths)

    def refusal(self, scope: Scope) -> ApiError | None:
        headers = dict(scope.get("headers") or ())
        if self.auth is not None and scope.get("path") not in self.open_paths:
            if headers.get(b"authorization", b"") != self.auth:
                return ApiError(401, "invalid or missing API key", type="authentication_error",
                                code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return too_large(self.max_request_bytes)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            err = self.refusal(scope)
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_guard(app: FastAPI, api_key: str | None, max_request_bytes: int,
              open_paths: Sequence[str] = OPEN_PATHS) -> None:
    """The API-key and body-size guard (`Guard`) around `app`; an `ApiError` raised by an
    endpoint, and the framework's own HTTP errors (unknown URL, wrong method), answered as
    OpenAI-style responses."""
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes,
                       open_paths=tuple(open_paths))

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    app.add_exception_handler(ApiError, api_error)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        err = routing_error(request.method, request.url.path, exc.status_code, exc.detail)
        err.headers = dict(exc.headers or {})  # 405's Allow
        return error_response(err)

    app.add_exception_handler(HTTPException, http_error)


async def json_body(request: Request, max_request_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its JSON object; `ApiError` 413 when too large, 400 (`invalid_json`)
    when it is not JSON or not an object."""
    raw = await request.body()
    if len(raw) > max_request_bytes:
        raise too_large(max_request_bytes)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad(None, f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, "the JSON body must be an object", code="invalid_json")
    return raw, body
