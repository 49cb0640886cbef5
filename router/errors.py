"""OpenAI-style error bodies (the shape vLLM returns) and the exception that carries them to the client.

Raised anywhere while handling a request; ``app.py`` and ``front.py`` turn an ``ApiError`` into a JSON
response (``reply``; ``aiohttp_response`` for aiohttp). The body is ``{"error": {"message", "type", "param",
"code"}}``, which the official ``openai`` client parses into its typed exceptions.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from router.downstream import Reply, json_reply


class ErrorDetail(msgspec.Struct, omit_defaults=False):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An error the client should see with this HTTP status (4xx for its mistakes, 5xx for ours)."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> bytes:
        detail = ErrorDetail(self.message, _TYPES.get(self.status, "Error"), self.param, self.status)
        return msgspec.json.encode(ErrorBody(detail))

    def reply(self) -> Reply:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return json_reply(self.status, self.body(), headers)


def aiohttp_response(reply: Reply) -> web.Response:
    """A reply as an aiohttp response (for aiohttp's handlers)."""
    return web.Response(status=reply.status, body=reply.body, headers=reply.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def overloaded(message: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, retry_after_s=max(1, retry_after_s))
