"""The client's side of one request as ``proxy.py`` (and ``relay.py``) see it, whichever HTTP server carries it.

Two servers carry client requests in the router process: the lean front (``front.py``) for the completion
endpoints and aiohttp for everything else (and for completions on connections aiohttp already owns). The
proxy answers through this interface so it does not care which: a complete ``Reply``, or a stream it
``start``s (status 200 and headers) and then ``write``s SSE events to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Reply:
    """A complete response: status, body and headers (``Content-Type`` among them)."""

    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


def json_reply(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(status, body, {"Content-Type": "application/json", **(headers or {})})


def http_chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk (size line, data, CRLF), as aiohttp also frames a streamed body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class Downstream(Protocol):
    """A client connection the proxy may stream a response to (one per request)."""

    @property
    def started(self) -> bool:
        """Whether the status line and headers went out (after that only events can follow)."""
        ...

    @property
    def chunked(self) -> bool:
        """Whether the body is framed in HTTP/1.1 chunks (HTTP/1.0 clients get it unframed)."""
        ...

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's transport, which ``relay.Pump`` writes relayed events to directly."""
        ...

    async def start(self, headers: Mapping[str, str]) -> None:
        """Send status 200 and ``headers``; raises ``ConnectionError`` if the client went away."""
        ...

    async def write(self, data: bytes) -> None:
        """Send body bytes (waits while the client reads slowly); ``ConnectionError`` if it went away."""
        ...
