"""The runner pd-router serves with: aiohttp's ``AppRunner`` whose sites accept connections through the lean
front (``front.py``) first.

Called by ``cli.py`` (``make_runner``) and the router unit tests (``FrontRunner``), in the router process.
``Front`` stands in for aiohttp's ``Server`` towards the runner: it makes a ``front.Connection`` per accepted
connection, hands the connections it does not serve to aiohttp's server, and shuts both down together.
"""

from __future__ import annotations

import asyncio
from typing import cast

from aiohttp import web
from aiohttp.web_server import Server

from router.app import STATE, RouterState
from router.front import Connection, Dates


class Front:
    """The protocol factory the runner's sites listen with: a ``Connection`` per accepted connection.

    Stands in for aiohttp's ``Server`` towards ``BaseRunner`` (which calls it, ``pre_shutdown`` and
    ``shutdown``) and hands connections it does not serve to that server.
    """

    def __init__(self, aiohttp_server: Server, state: RouterState) -> None:
        self._aiohttp = aiohttp_server
        self.state = state
        self.max_body = state.cfg.server.max_body_bytes
        self.keepalive_s = state.cfg.server.keepalive_s
        self.dates = Dates()
        self.connections: set[Connection] = set()

    def __call__(self) -> asyncio.Protocol:
        return Connection(self)

    def aiohttp_protocol(self) -> asyncio.Protocol:
        return self._aiohttp()

    @property
    def requests_count(self) -> int:
        return self._aiohttp.requests_count

    def pre_shutdown(self) -> None:
        for conn in list(self.connections):
            conn.stop()
        self._aiohttp.pre_shutdown()

    async def shutdown(self, timeout: float | None = None) -> None:
        await asyncio.gather(self._finish(timeout), self._aiohttp.shutdown(timeout))

    async def _finish(self, timeout: float | None) -> None:
        """Let requests in flight end (up to ``timeout`` seconds), then cancel what is left."""
        in_flight = [task for conn in list(self.connections) if (task := conn.stop()) is not None]
        if in_flight:
            await asyncio.wait(in_flight, timeout=timeout)
        for conn in list(self.connections):
            conn.close()


class FrontRunner(web.AppRunner):
    """aiohttp's ``AppRunner`` whose sites accept connections through the front (``Front``)."""

    async def _make_server(self) -> Server:
        aiohttp_server = await super()._make_server()
        # The runner and its sites use a server only as a protocol factory with pre_shutdown/shutdown.
        return cast(Server, Front(aiohttp_server, self.app[STATE]))


def make_runner(app: web.Application) -> FrontRunner:
    """The runner ``cli.py`` serves the router with: the ``[server]`` timeouts apply to both servers."""
    server = app[STATE].cfg.server
    return FrontRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=server.keepalive_s,
        shutdown_timeout=server.shutdown_timeout_s,
    )
