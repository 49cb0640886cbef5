"""Receiver (decode, D) half of the transfer engine: links to prefill side channels, per-transfer waits.

Runs only on the engine's I/O thread. One link (control connection) per prefill address, opened on first
use and shared by all transfers to it; a link that breaks fails its transfers, and the next ``expect``
reconnects (a restarted P). Giving up on a transfer (timeout, abort) waits for P's Ack before reporting, so D
never reuses blocks P is still writing into.

The data fence. A lost link is no Ack: P's one-sided writes may still be in flight and land after D reported
and vLLM gave the blocks to another request (a 200 with wrong tokens no checksum can catch). So each link
(one control session) hands P its own data grant (``Transport.grant``), revoked first when the link is lost:
tcp closes that session's data connections unread and the transfers fail at once; a transport that cannot
refuse a writer (ucx, cma) answers False, and D holds those parts' blocks until P cannot be writing (its
deadline plus ``abort_grace_s``, or at once when P's side channel refuses connections): bounded, never
leaked. docs/architecture.md (the data fence) has the reasoning and what it does not cover.

Tensor parallelism: a transfer names P's first rank (its side channel); that rank's handshake
(``handshake.dial``) tells D how P is split (``HelloAck.layout``), and D then takes each of its heads from the
first P rank holding it (``layout.head_plan``), rank ``k`` listening on the first rank's port + ``k``. Each P
rank involved is one *part* of the transfer; it is DONE when every part's Done arrived, and fails as a whole
when any part fails (the other parts are aborted first, so no P rank writes into blocks D gave up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import msgspec

from pd_connector import control
from pd_connector.layout import HeadSlice, KVLayout, fanout, head_plan
from pd_connector.protocol import Abort, Ack, Destinations, Done, LayerDone, Message
from pd_connector.timeline import Timeline
from pd_connector.transfer import handshake, integrity
from pd_connector.transfer.context import EngineContext, logger
from pd_connector.transfer.types import TransferResult, TransferState, state_in


@dataclasses.dataclass(eq=False)
class _Link:
    """Our client connection to one prefill side, shared by all transfers to that address."""

    addr: str
    key: str  # this control session's data grant (``Transport.grant``), revoked when the link is lost
    conn: control.Connection | None = None
    ready: bool = False
    layout: KVLayout | None = None  # P's layout, from its HelloAck
    waiting: list[_Part] = dataclasses.field(default_factory=list)
    # Transfers given up before the handshake finished: P may have offered them, so it is told afterwards.
    aborts: list[Abort] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Part:
    """What one P rank writes for a transfer: its link, the destinations sent there, its progress."""

    recv: _Recv
    link: _Link
    dests: Destinations
    sent: bool = False
    done: bool = False
    acked: bool = False  # P answered our Abort (or its end crossed it): nothing of it writes any more
    bytes: int = 0
    hold: asyncio.TimerHandle | None = None  # link lost, writes not fenced: the blocks are kept until then


@dataclasses.dataclass(eq=False)
class _Recv:
    """Receiver state of one transfer."""

    transfer_id: str
    addr: str  # P's first rank
    dests: Destinations  # the template: every part's destinations are it plus a head slice and a fan-out
    started: float
    parts: list[_Part] = dataclasses.field(default_factory=list)
    planned: bool = False
    state: TransferState = TransferState.WAITING
    first_token: int | None = None
    ending: tuple[TransferState, str] | None = None  # set while waiting for P's Acks of our Aborts
    integrity_failed: bool = False  # what landed did not match P's checksums
    timer: asyncio.TimerHandle | None = None
    timeline: Timeline = dataclasses.field(default_factory=Timeline)

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)


class Receiver:
    """D side of every transfer of one engine; ``memory`` is our transport descriptor for the handshake."""

    def __init__(self, ctx: EngineContext, memory: bytes) -> None:
        self.ctx = ctx
        self.memory = memory
        self.recvs: dict[str, _Recv] = {}
        self.links: dict[str, _Link] = {}
        # Transfers waiting for the handshake with P's first rank (which tells how P is split).
        self.unplanned: dict[str, list[_Recv]] = {}
        self._sessions = itertools.count()  # numbers the links' data grants
        self._probes: dict[str, asyncio.Task[None]] = {}  # per P address: is it gone? (see ``_hold``)

    def sizes(self) -> dict[str, int]:
        return {"recvs": len(self.recvs), "links": len(self.links)}

    def state(self, tid: str) -> TransferState | None:
        return state_in(self.recvs, tid)

    def shutdown(self) -> None:
        for rt in list(self.recvs.values()):
            self._finish(rt, TransferState.FAILED, "transfer engine closed")
        for link in list(self.links.values()):
            if link.conn is not None:
                link.conn.close("engine closed")
        for probe in self._probes.values():
            probe.cancel()

    # ---- adapter calls ---------------------------------------------------------------------------------------
    def expect(self, addr: str, dests: Destinations, at: float) -> None:
        rt = _Recv(dests.transfer_id, addr, dests, at)
        rt.timeline.mark("expected", at)
        self.recvs[rt.transfer_id] = rt
        rt.timer = self.ctx.loop.call_later(dests.lease_s, self._timed_out, rt)
        link = self._link(addr)
        if link.ready:
            self._plan(rt, link)
        else:
            self.unplanned.setdefault(addr, []).append(rt)

    def abort(self, tid: str, reason: str) -> None:
        rt = self.recvs.get(tid)
        if rt is not None and rt.ending is None:
            self._give_up(rt, TransferState.ABORTED, reason)

    # ---- planning the parts ------------------------------------------------------------------------------------
    def _plan(self, rt: _Recv, first: _Link) -> None:
        """Split the transfer over the P ranks D's heads come from, now that P's split is known."""
        rt.planned = True
        prefill = first.layout
        assert prefill is not None
        mine = self.ctx.layout
        try:
            if prefill.tp_size == 1 and mine.tp_size == 1:
                slices: list[HeadSlice | None] = [None]
            else:
                slices = list(head_plan(prefill.tp_size, mine))
            parts = []
            for sl in slices:
                rank = 0 if sl is None else sl.prefill_rank
                addr = control.rank_addr(rt.addr, rank)
                refusal = self.ctx.policy.refusal(addr)
                if refusal is not None:
                    raise ValueError(refusal)
                share = 1 if sl is None else fanout(prefill.at_rank(rank), mine.tp_size)
                parts.append((addr, msgspec.structs.replace(rt.dests, heads=sl, fanout=share)))
        except ValueError as e:
            self._finish(rt, TransferState.FAILED, f"cannot plan the transfer over prefill's ranks: {e}")
            return
        for addr, dests in parts:
            link = self._link(addr)
            part = _Part(rt, link, dests)
            rt.parts.append(part)
            if link.ready:
                self._send_destinations(part)
            else:
                link.waiting.append(part)

    def _link(self, addr: str) -> _Link:
        link = self.links.get(addr)
        if link is None:
            link = self.links[addr] = _Link(addr, f"{addr}#{next(self._sessions)}")
            self.ctx.loop.create_task(self._connect(link))
        return link

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
        try:
            memory = self.ctx.transport.grant(link.key, self.memory)
        except RuntimeError as e:  # the transport is closing
            conn.close(f"no data grant: {e}")
            return
        answer = await handshake.dial(self.ctx, link.addr, conn, memory)
        reason = answer if isinstance(answer, str) else ""
        if reason or link.conn is not conn:
            logger.error("control: %s", reason)
            conn.on_close = lambda c, why: None
            conn.close(reason)
            self._link_failed(link, reason or "link closed during handshake")
            return
        assert isinstance(answer, KVLayout)
        link.ready, link.layout = True, answer
        conn.on_message = lambda c, msg: self._on_message(link, msg)
        for rt in self.unplanned.pop(link.addr, []):
            if self.recvs.get(rt.transfer_id) is rt and rt.ending is None:
                self._plan(rt, link)
        waiting, link.waiting = link.waiting, []
        for part in waiting:
            if self.recvs.get(part.recv.transfer_id) is part.recv and part.recv.ending is None:
                self._send_destinations(part)
        aborts, link.aborts = link.aborts, []
        for abort in aborts:
            conn.send(abort)
        await conn.run()

    def _link_failed(self, link: _Link, reason: str) -> None:
        """The link is gone (refused, unreachable, closed): every transfer using it ends, once no write of
        this session can land any more (fenced now, or held until P cannot be writing: see the module doc)."""
        if self.links.get(link.addr) is link:
            del self.links[link.addr]
        link.ready = False
        fenced = self.ctx.transport.revoke(link.key)
        for rt in self.unplanned.pop(link.addr, []):
            self._finish(rt, TransferState.FAILED, reason)
        for rt in [r for r in self.recvs.values() if any(p.link is link for p in r.parts)]:
            for part in rt.parts:
                if part.link is not link or part.acked or part.done or part.hold is not None:
                    continue
                if fenced or not part.sent:
                    part.acked = True  # nothing of this session writes into our memory any more
                else:
                    self._hold(part)
            if rt.ending is None:
                self._give_up(rt, TransferState.FAILED, reason)
            else:
                self._maybe_acked(rt)

    def _hold(self, part: _Part) -> None:
        """Keep ``part``'s blocks until P cannot be writing into them: past the deadline it was given (it starts
        no write after it) plus ``abort_grace_s`` (its last write drained), or until P is provably gone."""
        rt = part.recv
        until = rt.started + rt.dests.lease_s + self.ctx.config.abort_grace_s
        wait_s = until - time.monotonic()
        if wait_s <= 0:
            part.acked = True
            return
        logger.warning(
            "transfer %s: link to prefill %s lost and its writes cannot be fenced on %s; keeping the blocks "
            "up to %.1f s until it cannot be writing",
            rt.transfer_id,
            part.link.addr,
            self.ctx.transport.name,
            wait_s,
        )
        part.hold = self.ctx.loop.call_later(wait_s, self._released, part)
        if part.link.addr not in self._probes:
            self._probes[part.link.addr] = self.ctx.loop.create_task(self._probe(part.link.addr))

    def _released(self, part: _Part) -> None:
        if part.hold is not None:
            part.hold.cancel()
            part.hold = None
        part.acked = True
        self._maybe_acked(part.recv)

    def _held(self, addr: str) -> list[_Part]:
        return [
            p for rt in self.recvs.values() for p in rt.parts if p.hold is not None and p.link.addr == addr
        ]

    async def _probe(self, addr: str) -> None:
        """While parts of a lost link to ``addr`` are held: if P's side channel refuses connections, its
        process died or its engine closed, and neither writes any more, so the held blocks go back now. A P
        that accepts (stopped, slow, or restarted on that port) leaves them held until their deadline."""
        cfg = self.ctx.config
        host, port = control.split_addr(addr)
        try:
            while self._held(addr):
                try:
                    _, writer = await asyncio.wait_for(
                        asyncio.open_connection(host, port), cfg.connect_timeout_s
                    )
                except ConnectionRefusedError:
                    logger.info("control: prefill %s is gone; releasing the blocks held for its writes", addr)
                    for part in self._held(addr):
                        self._released(part)
                    return
                except (TimeoutError, OSError):
                    pass
                else:
                    writer.close()
                await asyncio.sleep(cfg.heartbeat_interval_s)
        finally:
            self._probes.pop(addr, None)

    def _send_destinations(self, part: _Part) -> None:
        assert part.link.conn is not None
        rt = part.recv
        remaining = rt.dests.lease_s - (time.monotonic() - rt.started)
        # The lease P sees is what is left of our timeout, so P never writes after we gave up.
        part.sent = part.link.conn.send(msgspec.structs.replace(part.dests, lease_s=max(remaining, 1e-3)))
        rt.timeline.mark("destinations_sent")

    def _part(self, link: _Link, tid: str) -> _Part | None:
        rt = self.recvs.get(tid)
        return None if rt is None else next((p for p in rt.parts if p.link is link), None)

    def _on_message(self, link: _Link, msg: Message) -> None:
        tid = getattr(msg, "transfer_id", "")
        part = self._part(link, tid)
        if isinstance(msg, LayerDone):
            if part is not None and part.recv.ending is None:
                part.recv.state = TransferState.TRANSFERRING
                part.recv.timeline.mark("first_layer")
                part.bytes += msg.bytes
                self.ctx.count(bytes_received=msg.bytes)
        elif isinstance(msg, (Done, Abort)):
            if isinstance(msg, Abort) and link.conn is not None:
                link.conn.send(Ack(msg.transfer_id))
            if part is not None:
                self._on_end(part, msg)
        elif isinstance(msg, Ack):
            if part is not None and part.recv.ending is not None:
                part.acked = True
                self._maybe_acked(part.recv)
        else:
            logger.error("control: unexpected %s from prefill %s", type(msg).__name__, link.addr)
            if link.conn is not None:
                link.conn.close(f"unexpected {type(msg).__name__}")

    def _on_end(self, part: _Part, msg: Done | Abort) -> None:
        """A P rank finished or aborted its part: it has no write in flight for this transfer any more."""
        rt = part.recv
        part.acked = True
        if rt.ending is not None:  # we had given up already; P's message crossed our Abort
            self._maybe_acked(rt)
        elif isinstance(msg, Abort):
            state = TransferState.FAILED if msg.failure else TransferState.ABORTED
            self._give_up(rt, state, f"prefill {'failed' if msg.failure else 'aborted'}: {msg.reason}")
        elif msg.num_tokens < rt.dests.num_tokens:
            reason = f"prefill covered {msg.num_tokens} of {rt.dests.num_tokens} tokens"
            self._give_up(rt, TransferState.FAILED, reason)
        elif (
            mismatch := integrity.landed_problem(
                self.ctx.kv_bytes,
                self.ctx.layout,
                msg.checksums,
                part.dests.layer_block_ids is not None,
                part.link.addr,
            )
        ) is not None:
            logger.error("transfer %s: %s", rt.transfer_id, mismatch)
            self.ctx.count(integrity_failures=1)
            rt.integrity_failed = True
            self._give_up(rt, TransferState.FAILED, mismatch)
        else:
            part.done = True
            if msg.first_token is not None:
                rt.first_token = msg.first_token
            if all(p.done for p in rt.parts):
                rt.timeline.mark("done")
                self.ctx.count(transfers_received=1)
                self._finish(rt, TransferState.DONE, "")

    # ---- giving up -------------------------------------------------------------------------------------------
    def _timed_out(self, rt: _Recv) -> None:
        rt.timer = None
        if self.recvs.get(rt.transfer_id) is rt and rt.ending is None:
            self.ctx.count(timeouts=1)
            self._give_up(rt, TransferState.FAILED, f"no KV from prefill within {rt.dests.lease_s} s")

    def _give_up(self, rt: _Recv, state: TransferState, reason: str) -> None:
        """Tell every P rank still writing and wait for its Ack (it drained its writes) before reporting."""
        abort = Abort(rt.transfer_id, reason, state is TransferState.FAILED)
        rt.ending = (state, reason)
        if not rt.planned:
            # P's first rank may have offered the transfer: tell it once its link is up.
            link = self.links.get(rt.addr)
            if link is not None:
                link.aborts.append(abort)
        for part in rt.parts:
            if part.acked or part.done or part.hold is not None:
                continue
            if part.sent and part.link.ready and part.link.conn is not None:
                part.link.conn.send(abort)
                continue
            # P never learnt our blocks through this part: nothing of it writes into them; still tell P.
            part.acked = True
            if part.link.ready and part.link.conn is not None:
                part.link.conn.send(abort)
            elif self.links.get(part.link.addr) is part.link:
                part.link.aborts.append(abort)
        if rt.timer is not None:
            rt.timer.cancel()
        rt.timer = self.ctx.loop.call_later(self.ctx.config.abort_grace_s, self._abort_unanswered, rt)
        self._maybe_acked(rt)

    def _maybe_acked(self, rt: _Recv) -> None:
        if rt.ending is not None and all(p.acked or p.done for p in rt.parts):
            self._finish(rt, *rt.ending)

    def _abort_unanswered(self, rt: _Recv) -> None:
        rt.timer = None
        if self.recvs.get(rt.transfer_id) is not rt:
            return
        for part in rt.parts:
            if not (part.acked or part.done) and part.link.conn is not None:
                logger.error(
                    "transfer %s: prefill %s did not answer our abort within %s s; closing the link",
                    rt.transfer_id,
                    part.link.addr,
                    self.ctx.config.abort_grace_s,
                )
                part.link.conn.close("abort unanswered")  # P detaches on close: no write can land afterwards

    def _finish(self, rt: _Recv, state: TransferState, reason: str) -> None:
        if self.recvs.get(rt.transfer_id) is not rt:
            return
        del self.recvs[rt.transfer_id]
        if rt.timer is not None:
            rt.timer.cancel()
        for part in rt.parts:
            if part.hold is not None:
                part.hold.cancel()
            if part in part.link.waiting:
                part.link.waiting.remove(part)
        waiting = self.unplanned.get(rt.addr)
        if waiting is not None and rt in waiting:
            waiting.remove(rt)
        self.ctx.report(
            TransferResult(
                rt.transfer_id,
                "recv",
                state,
                reason,
                num_tokens=rt.dests.num_tokens if state is TransferState.DONE else 0,
                first_token=rt.first_token if state is TransferState.DONE else None,
                bytes=rt.bytes,
                duration_s=time.monotonic() - rt.started,
                integrity_failed=rt.integrity_failed,
                stages=rt.timeline.stamps,
            )
        )
