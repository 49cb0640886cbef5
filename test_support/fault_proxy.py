"""A fault-injecting TCP proxy on loopback: delay, stalls, connection resets and garbage bytes on a seeded
schedule, for the chaos benchmark and the transfer engine's failure tests.

Why: this kernel has no ``tc netem``, and the faults that hurt a P/D pair are on its connections (D's control
connection to P's side channel, P's TCP data connection into D). Put ``FaultProxy`` between them, both ends on
loopback, and the connections it relays get the faults its ``Schedule`` names, reproducibly from a seed.

Who calls it: a test or ``benchmarks.chaos`` (the caller starts and stops it; nothing here is a daemon of its
own). The proxy listens on ``127.0.0.1`` (or another loopback address), dials ``target`` (loopback only: it is
not a tool to reach beyond the host) for every connection it accepts, and relays both ways on its own asyncio
I/O thread (``pd_connector.transport.loop_thread.LoopThread``), so synchronous tests use it as it is::

    with FaultProxy(("127.0.0.1", port), Schedule.fixed({0: Fault("reset", after_bytes=4096)})) as proxy:
        dial(proxy.address)         # the first connection is reset after 4 KiB toward the target
    proxy.reset_connections()   # or: reset every connection relayed now, at a moment the caller picks
    proxy.stall_connections(6)  # relay nothing for 6 s from now (held, not dropped)
    proxy.delay_connections(5, 0.05)  # for 5 s from now, every chunk waits 50 ms
    proxy.injected              # Counter of the faults that struck, by kind

A ``Fault`` strikes one connection once ``after_bytes`` bytes went through it in its ``direction``:
- ``delay``: from then on every chunk in that direction waits ``seconds`` before it is relayed (latency);
- ``stall``: nothing more is relayed in that direction for ``seconds``, then relaying resumes (a peer that
  hangs for a while: compare ``seconds`` with the heartbeat timeout and the leases);
- ``reset``: both sides of the connection are closed with a TCP RST (``SO_LINGER`` 0) at that byte;
- ``garbage``: ``garbage_bytes`` seeded random bytes are sent in that direction, then relaying continues.
Bytes before the fault, and every byte of a connection without one, are relayed exactly and in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
import socket
import struct
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Literal

from pd_connector.transport.loop_thread import LoopThread

FaultKind = Literal["delay", "stall", "reset", "garbage"]
FAULT_KINDS: tuple[FaultKind, ...] = ("delay", "stall", "reset", "garbage")
#: Which way a fault acts: bytes from the dialling client to the target, or back.
Direction = Literal["to_target", "to_client"]
_CHUNK = 64 * 1024
_LINGER_RST = struct.pack("ii", 1, 0)


@dataclass(frozen=True)
class Fault:
    """One fault on one connection: ``kind`` strikes once ``after_bytes`` went through in ``direction``."""

    kind: FaultKind
    after_bytes: int = 0
    direction: Direction = "to_target"
    #: ``delay``: per chunk, ``stall``: the one pause, in seconds.
    seconds: float = 0.0
    #: ``garbage``: how many random bytes are sent.
    garbage_bytes: int = 64

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {FAULT_KINDS}")
        if self.after_bytes < 0 or self.seconds < 0 or self.garbage_bytes <= 0:
            raise ValueError(f"{self}: after_bytes and seconds must be >= 0, garbage_bytes > 0")
        if self.kind in ("delay", "stall") and self.seconds <= 0:
            raise ValueError(f"a {self.kind} fault needs seconds > 0")


class Schedule:
    """Which fault, if any, each accepted connection gets, by accept order (0, 1, ...): the same every run.

    ``fixed({index: Fault})``: exactly those. ``seeded(seed, menu, probability)``: each connection, with
    ``probability``, gets one fault drawn from ``menu`` with its ``after_bytes`` drawn uniformly from
    ``[0, after_bytes]`` (so a fault strikes at varied moments of a transfer), from a generator seeded with
    ``seed`` and the connection's index.
    """

    def __init__(self, plan: Callable[[int], Fault | None]) -> None:
        self._plan = plan

    def fault(self, index: int) -> Fault | None:
        return self._plan(index)

    @classmethod
    def none(cls) -> Schedule:
        return cls(lambda index: None)

    @classmethod
    def fixed(cls, faults: Mapping[int, Fault]) -> Schedule:
        table = dict(faults)
        return cls(table.get)

    @classmethod
    def seeded(cls, seed: int, menu: Sequence[Fault], probability: float = 1.0) -> Schedule:
        if not menu or not 0.0 <= probability <= 1.0:
            raise ValueError("a seeded schedule needs a non-empty menu and a probability in [0, 1]")
        faults = tuple(menu)

        def plan(index: int) -> Fault | None:
            rng = random.Random(f"{seed}:{index}")
            if rng.random() >= probability:
                return None
            fault = rng.choice(faults)
            return replace(fault, after_bytes=rng.randint(0, fault.after_bytes))

        return cls(plan)


def _loopback(host: str, what: str) -> None:
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise ValueError(
            f"FaultProxy {what} {host!r} is not a loopback address: it proxies on this host only"
        )


class FaultProxy:
    """Relays TCP connections from ``address`` to ``target``, injecting the ``schedule``'s faults.

    ``start``/``stop`` (or ``with``) run it on its own I/O thread; ``stop`` closes the listener and every relayed
    connection and is idempotent. ``seed`` also seeds the garbage bytes. Counters are read from any thread.
    """

    def __init__(
        self,
        target: tuple[str, int],
        schedule: Schedule | None = None,
        listen_host: str = "127.0.0.1",
        seed: int = 0,
        listen_port: int = 0,
    ) -> None:
        _loopback(target[0], "target")
        _loopback(listen_host, "listen host")
        self.target = target
        self.schedule = schedule or Schedule.none()
        self._listen_host = listen_host
        self._listen_port = listen_port  # 0: an ephemeral one
        self._seed = seed
        # Loop times until which every connection relays nothing / delays each chunk by _delay_s
        # (stall_connections, delay_connections); read and written on the I/O thread only.
        self._stalled_until = 0.0
        self._delayed_until = 0.0
        self._delay_s = 0.0
        self._io: LoopThread | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()  # relaying now
        #: Connections accepted so far (the next one's schedule index).
        self.accepted = 0
        #: Faults that struck, by kind.
        self.injected: Counter[str] = Counter()
        #: Bytes relayed exactly, per direction (garbage not included).
        self.relayed: Counter[str] = Counter()
        self.address = ""

    # ---- caller's thread ----------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 5.0) -> str:
        """Listen on ``listen_port`` (default: an ephemeral loopback port; a fixed one when a peer must be told
        it before the proxy starts); returns ``host:port`` to dial instead of the target."""
        if self._io is not None:
            raise RuntimeError("FaultProxy already started")
        self._io = LoopThread("fault-proxy")
        self._server = self._io.run(
            asyncio.start_server(self._accept, self._listen_host, self._listen_port), timeout_s
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.address

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def relaying(self) -> int:
        """Connections being relayed now (a test waits for 0 to know every relayed byte is delivered or
        dropped)."""
        return len(self._tasks)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and reset every relayed connection; join the I/O thread (idempotent)."""
        io, self._io = self._io, None
        if io is None:
            return
        try:
            io.run(self._close(), timeout_s)
        finally:
            io.stop(timeout_s)

    def reset_connections(self, timeout_s: float = 5.0) -> int:
        """Reset every connection relayed now (both sides get an RST), for a fault at a moment the caller
        picks rather than at a byte; counted as ``reset``. Returns how many connections were reset."""
        if self._io is None:
            raise RuntimeError("FaultProxy is not running")
        return self._io.run(self._reset_all(), timeout_s)

    def stall_connections(self, seconds: float, timeout_s: float = 5.0) -> int:
        """Relay nothing, either way and on any connection, for ``seconds`` from now (a path that stops
        moving bytes, at a moment the caller picks): bytes are held, not dropped, and relayed in order after.
        Counted as ``stall`` once per connection relayed now; returns how many."""
        return self._hold("stall", seconds, 0.0, timeout_s)

    def delay_connections(self, seconds: float, per_chunk_s: float, timeout_s: float = 5.0) -> int:
        """For ``seconds`` from now, every chunk relayed (either way, any connection) waits ``per_chunk_s``
        first (added latency, at a moment the caller picks). Counted as ``delay`` once per connection relayed
        now; returns how many."""
        return self._hold("delay", seconds, per_chunk_s, timeout_s)

    def _hold(self, kind: FaultKind, seconds: float, per_chunk_s: float, timeout_s: float) -> int:
        if self._io is None:
            raise RuntimeError("FaultProxy is not running")
        if seconds <= 0 or per_chunk_s < 0 or (kind == "delay" and per_chunk_s <= 0):
            raise ValueError(f"{kind}: seconds must be > 0 and per_chunk_s > 0 for a delay")
        return self._io.run(self._hold_all(kind, seconds, per_chunk_s), timeout_s)

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- I/O thread ---------------------------------------------------------------------------------------------
    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            _reset(writer)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _reset_all(self) -> int:
        pairs = list(self._pairs)
        for pair in pairs:
            for end in pair:
                _reset(end)
        self.injected["reset"] += len(pairs)
        return len(pairs)

    async def _hold_all(self, kind: FaultKind, seconds: float, per_chunk_s: float) -> int:
        until = asyncio.get_running_loop().time() + seconds
        if kind == "stall":
            self._stalled_until = max(self._stalled_until, until)
        else:
            self._delayed_until, self._delay_s = until, per_chunk_s
        self.injected[kind] += len(self._pairs)
        return len(self._pairs)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.accepted
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        ends = [writer]
        self._writers.add(writer)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                _reset(writer)
                return
            ends.append(up_writer)
            self._writers.add(up_writer)
            fault = self.schedule.fault(index)
            rng = random.Random(f"{self._seed}:garbage:{index}")
            pair = (writer, up_writer)
            self._pairs.add(pair)
            await asyncio.gather(
                self._pump(reader, up_writer, "to_target", fault, rng, pair),
                self._pump(up_reader, writer, "to_client", fault, rng, pair),
            )
        finally:
            self._tasks.discard(task)
            if len(ends) == 2:
                self._pairs.discard((ends[0], ends[1]))
            for end in ends:
                self._writers.discard(end)
                end.close()

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        direction: Direction,
        fault: Fault | None,
        rng: random.Random,
        both: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        mine = fault if fault is not None and fault.direction == direction else None
        moved, struck = 0, False
        try:
            while True:
                data = await src.read(_CHUNK)
                if not data:
                    break
                if mine is not None and not struck and moved + len(data) >= mine.after_bytes:
                    cut = mine.after_bytes - moved
                    await self._relay(dst, data[:cut], direction)
                    moved += cut
                    data = data[cut:]
                    struck = True
                    self.injected[mine.kind] += 1
                    if mine.kind == "reset":
                        for w in both:
                            _reset(w)
                        return
                    if mine.kind == "stall":
                        await asyncio.sleep(mine.seconds)
                    elif mine.kind == "garbage":
                        dst.write(rng.randbytes(mine.garbage_bytes))
                if struck and mine is not None and mine.kind == "delay":
                    await asyncio.sleep(mine.seconds)
                await self._relay(dst, data, direction)
                moved += len(data)
            if dst.can_write_eof():
                dst.write_eof()
        except (ConnectionError, OSError, RuntimeError):
            for w in both:
                _reset(w)

    async def _relay(self, dst: asyncio.StreamWriter, data: bytes, direction: Direction) -> None:
        if data:
            loop = asyncio.get_running_loop()
            if (held := self._stalled_until - loop.time()) > 0:
                await asyncio.sleep(held)  # the fault itself: stall_connections
            if loop.time() < self._delayed_until:
                await asyncio.sleep(self._delay_s)  # the fault itself: delay_connections
            dst.write(data)
            await dst.drain()
            self.relayed[direction] += len(data)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (no FIN, unsent data dropped), as a crashed peer or a middlebox reset does."""
    if writer.transport.is_closing():
        writer.transport.abort()  # already going (or gone): nothing left to reset
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    writer.transport.abort()
