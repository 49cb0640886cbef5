"""Receiver (decode, D) half of the transfer engine: links to prefill side channels, per-transfer waits.

Runs only on the engine's I/O thread. One link (control connection) per prefill address, opened on first
use and shared by all transfers to it; a link that breaks fails its transfers at once, and the next
``expect`` reconnects (a restarted P). Giving up on a transfer (timeout, abort) waits for P's Ack before
reporting, so D never reuses blocks P is still writing into.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time

import msgspec

from pd_connector import control
from pd_connector.protocol import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Destinations,
    Done,
    Hello,
    HelloAck,
    LayerDone,
    Memory,
    Message,
    ProtocolError,
    Ready,
    Refused,
)
from pd_connector.transfer.context import EngineContext, logger
from pd_connector.transfer.types import TransferResult, TransferState


@dataclasses.dataclass(eq=False)
class _Link:
    """Our client connection to one prefill side, shared by all transfers to that address."""

    addr: str
    conn: control.Connection | None = None
    ready: bool = False
    waiting: list[str] = dataclasses.field(default_factory=list)
    # Transfers given up before the handshake finished: P may have offered them, so it is told afterwards.
    aborts: list[Abort] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Recv:
    """Receiver state of one transfer."""

    transfer_id: str
    link: _Link
    dests: Destinations
    started: float
    state: TransferState = TransferState.WAITING
    sent: bool = False
    bytes: int = 0
    ending: tuple[TransferState, str] | None = None  # set while waiting for P's Ack of our Abort
    timer: asyncio.TimerHandle | None = None


class Receiver:
    """D side of every transfer of one engine; ``memory`` is our transport descriptor for the handshake."""

    def __init__(self, ctx: EngineContext, memory: bytes) -> None:
        self.ctx = ctx
        self.memory = memory
        self.recvs: dict[str, _Recv] = {}
        self.links: dict[str, _Link] = {}

    def sizes(self) -> dict[str, int]:
        return {"recvs": len(self.recvs), "links": len(self.links)}

    def state(self, tid: str) -> TransferState | None:
        rt = self.recvs.get(tid)
        return rt.state if rt is not None else None

    def shutdown(self) -> None:
        for rt in list(self.recvs.values()):
            self._finish(rt, TransferState.FAILED, "transfer engine closed")
        for link in list(self.links.values()):
            if link.conn is not None:
                link.conn.close("engine closed")

    # ---- adapter calls ---------------------------------------------------------------------------------------
    def expect(self, addr: str, dests: Destinations) -> None:
        link = self.links.get(addr)
        if link is None:
            link = self.links[addr] = _Link(addr)
            self.ctx.loop.create_task(self._connect(link))
        rt = _Recv(dests.transfer_id, link, dests, time.monotonic())
        self.recvs[rt.transfer_id] = rt
        rt.timer = self.ctx.loop.call_later(dests.lease_s, self._timed_out, rt)
        if link.ready:
            self._send_destinations(rt)
        else:
            link.waiting.append(rt.transfer_id)

    def abort(self, tid: str, reason: str) -> None:
        rt = self.recvs.get(tid)
        if rt is not None and rt.ending is None:
            self._give_up(rt, TransferState.ABORTED, reason)

    # ---- the link --------------------------------------------------------------------------------------------
    async def _connect(self, link: _Link) -> None:
        cfg = self.ctx.config
        try:
            conn = await control.connect(
                link.addr,
                self.ctx.codec,
                cfg.connect_timeout_s,
                cfg.heartbeat_interval_s,
                cfg.heartbeat_timeout_s,
            )
        except (TimeoutError, OSError) as e:
            self._link_failed(link, f"cannot connect to prefill {link.addr}: {e!r}")
            return
        link.conn = conn
        conn.on_close = lambda c, why: self._link_failed(link, f"prefill {link.addr} lost: {why}")
        reason = await self._handshake(link, conn)
        if reason or link.conn is not conn:
            logger.error("control: %s", reason)
            conn.on_close = lambda c, why: None
            conn.close(reason)
            self._link_failed(link, reason or "link closed during handshake")
            return
        link.ready = True
        conn.on_message = lambda c, msg: self._on_message(link, msg)
        waiting, link.waiting = link.waiting, []
        for tid in waiting:
            rt = self.recvs.get(tid)
            if rt is not None and rt.link is link:
                self._send_destinations(rt)
        aborts, link.aborts = link.aborts, []
        for abort in aborts:
            conn.send(abort)
        await conn.run()

    async def _handshake(self, link: _Link, conn: control.Connection) -> str:
        """Hello, P's proof, then our memory descriptor: '' when P is ready for Destinations, else why not.

        The descriptor lets its holder write into our KV cache, so it goes out only after P's HelloAck echoed
        our fresh nonce (under the shared secret's MAC, when one is set).
        """
        cfg, layout = self.ctx.config, self.ctx.layout
        nonce = secrets.token_bytes(NONCE_BYTES)
        conn.send(
            Hello(
                PROTOCOL_VERSION, cfg.engine_id, layout, layout.compat_hash(), self.ctx.transport.name, nonce
            )
        )
        try:
            reply = await conn.read_message(cfg.connect_timeout_s)
            if isinstance(reply, HelloAck):
                if reply.echo != nonce or len(reply.nonce) != NONCE_BYTES:
                    return f"prefill {link.addr} answered the handshake without echoing our nonce"
                conn.codec = conn.codec.session(nonce, reply.nonce)
                conn.send(Memory(self.memory))
                reply = await conn.read_message(cfg.connect_timeout_s)
                if isinstance(reply, Ready):
                    return ""
        except (TimeoutError, ProtocolError, asyncio.IncompleteReadError, ConnectionError) as e:
            return f"handshake with prefill {link.addr} failed: {e!r}"
        if isinstance(reply, Refused):
            return f"prefill {link.addr} refused the handshake: {reply.reason}"
        return f"prefill {link.addr} answered the handshake with {type(reply).__name__}"

    def _link_failed(self, link: _Link, reason: str) -> None:
        """The link is gone (refused, unreachable, closed): every transfer on it ends now."""
        if self.links.get(link.addr) is link:
            del self.links[link.addr]
        link.ready = False
        for rt in [r for r in self.recvs.values() if r.link is link]:
            if rt.ending is not None:
                self._finish(rt, *rt.ending)
            else:
                self._finish(rt, TransferState.FAILED, reason)

    def _send_destinations(self, rt: _Recv) -> None:
        assert rt.link.conn is not None
        remaining = rt.dests.lease_s - (time.monotonic() - rt.started)
        # The lease P sees is what is left of our timeout, so P never writes after we gave up.
        rt.sent = rt.link.conn.send(msgspec.structs.replace(rt.dests, lease_s=max(remaining, 1e-3)))

    def _on_message(self, link: _Link, msg: Message) -> None:
        rt = self.recvs.get(getattr(msg, "transfer_id", ""))
        if isinstance(msg, LayerDone):
            if rt is not None and rt.ending is None:
                rt.state = TransferState.TRANSFERRING
                rt.bytes += msg.bytes
                self.ctx.count(bytes_received=msg.bytes)
        elif isinstance(msg, (Done, Abort)):
            if isinstance(msg, Abort) and link.conn is not None:
                link.conn.send(Ack(msg.transfer_id))
            if rt is not None:
                self._on_end(rt, msg)
        elif isinstance(msg, Ack):
            if rt is not None and rt.ending is not None:
                self._finish(rt, *rt.ending)
        else:
            logger.error("control: unexpected %s from prefill %s", type(msg).__name__, link.addr)
            if link.conn is not None:
                link.conn.close(f"unexpected {type(msg).__name__}")

    def _on_end(self, rt: _Recv, msg: Done | Abort) -> None:
        """P finished or aborted: P has no write in flight for this transfer any more."""
        if rt.ending is not None:  # we had given up already; P's message crossed our Abort
            self._finish(rt, *rt.ending)
        elif isinstance(msg, Abort):
            state = TransferState.FAILED if msg.failure else TransferState.ABORTED
            self._finish(rt, state, f"prefill {'failed' if msg.failure else 'aborted'}: {msg.reason}")
        elif msg.num_tokens < rt.dests.num_tokens:
            reason = f"prefill covered {msg.num_tokens} of {rt.dests.num_tokens} tokens"
            self._finish(rt, TransferState.FAILED, reason)
        else:
            self.ctx.count(transfers_received=1)
            self._finish(rt, TransferState.DONE, "", first_token=msg.first_token)

    # ---- giving up -------------------------------------------------------------------------------------------
    def _timed_out(self, rt: _Recv) -> None:
        rt.timer = None
        if self.recvs.get(rt.transfer_id) is rt and rt.ending is None:
            self.ctx.count(timeouts=1)
            self._give_up(rt, TransferState.FAILED, f"no KV from prefill within {rt.dests.lease_s} s")

    def _give_up(self, rt: _Recv, state: TransferState, reason: str) -> None:
        """Tell P and wait for its Ack (it drained its writes) before reporting."""
        abort = Abort(rt.transfer_id, reason, state is TransferState.FAILED)
        if not (rt.sent and rt.link.ready and rt.link.conn is not None):
            # P never learnt our blocks, so nothing can write into them: report now, and still tell P,
            # which may have offered the transfer and would otherwise hold its blocks until its lease ends.
            if rt.link.ready and rt.link.conn is not None:
                rt.link.conn.send(abort)
            elif self.links.get(rt.link.addr) is rt.link:
                rt.link.aborts.append(abort)
            self._finish(rt, state, reason)
            return
        rt.ending = (state, reason)
        rt.link.conn.send(abort)
        if rt.timer is not None:
            rt.timer.cancel()
        rt.timer = self.ctx.loop.call_later(self.ctx.config.abort_grace_s, self._abort_unanswered, rt)

    def _abort_unanswered(self, rt: _Recv) -> None:
        rt.timer = None
        if self.recvs.get(rt.transfer_id) is rt and rt.link.conn is not None:
            logger.error(
                "transfer %s: prefill %s did not answer our abort within %s s; closing the link",
                rt.transfer_id,
                rt.link.addr,
                self.ctx.config.abort_grace_s,
            )
            rt.link.conn.close("abort unanswered")  # P detaches on close: no write can land afterwards

    def _finish(self, rt: _Recv, state: TransferState, reason: str, first_token: int | None = None) -> None:
        if self.recvs.get(rt.transfer_id) is not rt:
            return
        del self.recvs[rt.transfer_id]
        if rt.timer is not None:
            rt.timer.cancel()
        if rt.transfer_id in rt.link.waiting:
            rt.link.waiting.remove(rt.transfer_id)
        self.ctx.report(
            TransferResult(
                rt.transfer_id,
                "recv",
                state,
                reason,
                num_tokens=rt.dests.num_tokens if state is TransferState.DONE else 0,
                first_token=first_token,
                bytes=rt.bytes,
                duration_s=time.monotonic() - rt.started,
            )
        )
