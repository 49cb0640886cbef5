"""The floor of any relay in Python on uvloop: bytes in, the same bytes out, no HTTP, no routing.

    python -m benchmarks.byte_relay LISTEN_PORT UPSTREAM_PORT

``benchmarks.router`` runs it as a fourth target beside pd-router and sglang-router, pinned to the routers'
core: every client connection gets its own upstream connection (TCP_NODELAY on both), and whatever arrives on
one side is written to the other in the same read callback. What it adds over calling the upstream directly is
what the extra process hop itself costs on this host (two loopback hops, waking the relay's core, uvloop's
read and write), with none of a router's work; a router's added latency minus this is what its HTTP handling,
routing and relaying cost on top.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import cast

import uvloop


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Upstream(asyncio.Protocol):
    """The relay's connection to the upstream: its bytes go to the client unchanged."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    """One client connection; bytes that arrive before the upstream connection is up wait in ``_early``."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._connecting: asyncio.Task[None] | None = None  # held: the loop keeps only a weak reference
        self._upstream: asyncio.Transport | None = None
        self._early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        client = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        _nodelay(client)
        self._connecting = asyncio.get_running_loop().create_task(self._connect(client))

    async def _connect(self, client: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(
                lambda: _Upstream(client), "127.0.0.1", self._upstream_port
            )
        except OSError as exc:
            print(f"byte_relay: cannot reach the upstream: {exc}", file=sys.stderr)
            client.close()
            return
        _nodelay(upstream)
        self._upstream = upstream
        for data in self._early:
            upstream.write(data)
        self._early.clear()

    def data_received(self, data: bytes) -> None:
        if self._upstream is None:
            self._early.append(data)
        else:
            self._upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._upstream is not None:
            self._upstream.close()


async def serve(listen_port: int, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream_port), "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m benchmarks.byte_relay LISTEN_PORT UPSTREAM_PORT", file=sys.stderr)
        return 2
    uvloop.run(serve(int(args[0]), int(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
