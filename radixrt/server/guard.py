"""What every radixrt HTTP app (`radixrt serve`'s and `radixrt router`'s) does the same way
before and around its endpoints: OpenAI-style error responses, the API-key and body-size guard
(a middleware), and reading a JSON-object body.

Invariant: every error leaves as `{"error": {"message", "type", "param", "code"}}` with the
`ApiError`'s status and headers; only `open_paths` are served without the API key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixrt.server.protocol import ApiError, bad

OPEN_PATHS = ("/health", "/metrics")


def error_response(err: ApiError) -> JSONResponse:
    """The OpenAI-style JSON response of `err`."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def too_large(max_request_bytes: int) -> ApiError:
    return ApiError(413, f"request body larger than {max_request_bytes} bytes",
                    code="request_too_large")


def add_guard(app: FastAPI, api_key: str | None, max_request_bytes: int,
              open_paths: Sequence[str] = OPEN_PATHS) -> None:
    """A middleware that answers 401 without `Authorization: Bearer <api_key>` (when a key is
    set; `open_paths` excepted), 413 when the declared body exceeds `max_request_bytes`, and
    turns an `ApiError` raised by an endpoint into its response."""

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path not in open_paths:
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(ApiError(401, "invalid or missing API key",
                                               type="authentication_error",
                                               code="invalid_api_key"))
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            return error_response(too_large(max_request_bytes))
        try:
            return await call_next(request)
        except ApiError as e:
            return error_response(e)


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
