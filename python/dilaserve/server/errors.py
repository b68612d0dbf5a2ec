"""HTTP errors with OpenAI-style bodies: every failure a client sees has the shape
`{"error": {"message", "type", "param", "code"}}`, converted once from the engine's
exceptions at this boundary."""

from __future__ import annotations

import json

from aiohttp import web

from dilaserve.engine import (
    BadRequestError,
    EngineError,
    EngineStoppedError,
    OverloadedError,
    RequestFailedError,
)


class APIError(Exception):
    """An error answer: HTTP status, OpenAI error type, message, offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            text=json.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_engine(error: EngineError) -> APIError:
    """The one mapping from engine exceptions to HTTP answers."""
    if isinstance(error, BadRequestError):
        return bad_request(str(error))
    if isinstance(error, OverloadedError):
        retry = max(1, round(error.retry_after_s))
        return APIError(
            429,
            str(error),
            type="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": str(retry)},
        )
    if isinstance(error, EngineStoppedError):
        return APIError(503, str(error), type="server_error", code="unavailable")
    if isinstance(error, RequestFailedError):
        return APIError(500, str(error), type="server_error", code="request_failed")
    return APIError(500, str(error), type="server_error")
