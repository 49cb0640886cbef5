"""The transfer engine: one per engine worker process, both sender (P) and receiver (D) roles.

Threading: every public method is thread-safe and returns at once (adapters call them from scheduler and
worker threads, including from inside the forward pass). Work is posted to a dedicated I/O thread running
an asyncio loop, which owns all per-transfer state, the control connections and the transport callbacks;
results come back through ``poll()``.

Safety rule behind the abort/timeout paths: a side reports a transfer as ended only when no write can touch
its blocks any more. P drains its in-flight writes before it reports or tells D; D, giving up, sends
``Abort`` and waits for P's ``Ack`` (at most ``abort_grace_s``, then it closes the connection, which makes P
detach its endpoint) before it reports, so D never reuses blocks that P is still writing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import msgspec

from pd_connector import control
from pd_connector.layout import BlockMapping, KVLayout, LayoutMismatch, check_compatible
from pd_connector.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Destinations,
    Done,
    FrameCodec,
    Hello,
    HelloAck,
    LayerDone,
    Message,
    ProtocolError,
    Refused,
)
from pd_connector.transfer.types import TransferConfig, TransferCounters, TransferResult, TransferState
from pd_connector.transport.base import Transport

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Peer:
    """A decode side connected to our listener (P side): its transport endpoint and block mapping."""

    conn: control.Connection
    peer_id: str
    engine_id: str
    mapping: BlockMapping


@dataclasses.dataclass(eq=False)
class _Send:
    """Sender (P) state of one transfer; only touched on the I/O thread."""

    transfer_id: str
    src_blocks: list[int]
    started: float
    state: TransferState = TransferState.WAITING
    peer: _Peer | None = None
    dests: Destinations | None = None
    dest_deadline: float = float("inf")
    intents: list[tuple[int, int, int | None]] = dataclasses.field(default_factory=list)
    inflight: int = 0
    finished_at: float | None = None
    first_token: int | None = None
    tokens_covered: int = 0
    bytes: int = 0
    done_sent: bool = False
    exposed_s: float = 0.0
    ending: tuple[TransferState, str, bool] | None = None  # (final state, reason, lease expired)
    decode_aborted: bool = False  # D asked to abort: answer Ack (not Abort) once drained
    timer: asyncio.TimerHandle | None = None


@dataclasses.dataclass(eq=False)
class _Link:
    """Our client connection to one prefill side (D side), shared by all transfers to that address."""

    addr: str
    conn: control.Connection | None = None
    ready: bool = False
    waiting: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Recv:
    """Receiver (D) state of one transfer; only touched on the I/O thread."""

    transfer_id: str
    link: _Link
    dests: Destinations
    started: float
    state: TransferState = TransferState.WAITING
    sent: bool = False
    bytes: int = 0
    ending: tuple[TransferState, str] | None = None  # set while waiting for P's Ack of our Abort
    timer: asyncio.TimerHandle | None = None


class TransferEngine:
    """Moves KV blocks of individual requests from P to D over ``transport``, driven by the control plane.

    ``buffers``: the local KV buffers as ``(address, length_bytes)``, ordered as ``KVLayout.regions``
    expects; the engine registers them with ``transport`` and closes the transport in ``close``.
    """

    def __init__(
        self,
        config: TransferConfig,
        layout: KVLayout,
        buffers: Sequence[tuple[int, int]],
        transport: Transport,
    ) -> None:
        self.config = config
        self.layout = layout
        self._transport = transport
        self._memory = transport.register(layout.regions(buffers))
        self._codec = FrameCodec(config.secret, config.max_frame_bytes)
        self._counters = TransferCounters()
        self._lock = threading.Lock()  # guards _counters, _results, _recv_ids (read from adapter threads)
        self._results: dict[str, TransferResult] = {}
        self._recv_ids: set[str] = set()
        self._sends: dict[str, _Send] = {}
        self._orphans: dict[str, tuple[_Peer, Destinations, asyncio.TimerHandle]] = {}
        self._recvs: dict[str, _Recv] = {}
        self._links: dict[str, _Link] = {}
        self._peers: dict[control.Connection, _Peer] = {}
        self._closed = False
        self._io = control.IOThread(f"pd-transfer-{config.engine_id}")
        self._server: asyncio.Server | None = None
        self._address: str | None = None
        if config.listen_port is not None:
            try:
                self._server = self._io.run(self._listen(), config.connect_timeout_s)
            except BaseException:
                self._io.stop()
                transport.close()
                raise

    @property
    def address(self) -> str | None:
        """``host:port`` of the side-channel listener (what D passes as ``prefill_addr``), or None."""
        return self._address

    # ---- receiver side (D) -------------------------------------------------------------------------------
    def expect(
        self,
        transfer_id: str,
        prefill_addr: str,
        dst_blocks: Sequence[int],
        num_tokens: int,
        timeout_s: float | None = None,
        layer_dst_blocks: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Ask P at ``prefill_addr`` to write the first ``num_tokens`` tokens of ``transfer_id`` into D's blocks.

        ``dst_blocks``: D block ids in token order, shared by every layer; or ``layer_dst_blocks``, one list
        per layer, for caches whose layers have different block tables (``dst_blocks`` is then ignored). Connects
        and handshakes with P if needed, then sends ``Destinations``. Ends in ``poll()`` as DONE (the blocks
        hold the KV) or FAILED/ABORTED within ``timeout_s`` (default ``config.load_timeout_s``) plus
        ``abort_grace_s``; P is told to stop writing before FAILED is reported, or its connection is closed.
        Raises ``ValueError`` at once if the tables cannot hold ``num_tokens`` or the id is in use.
        """
        control.split_addr(prefill_addr)
        timeout = self.config.load_timeout_s if timeout_s is None else timeout_s
        if timeout <= 0 or num_tokens <= 0:
            raise ValueError(f"timeout_s and num_tokens must be positive, got {timeout}, {num_tokens}")
        per_layer = layer_dst_blocks is not None
        tables = [[int(b) for b in t] for t in layer_dst_blocks or [dst_blocks]]
        if per_layer and len(tables) != self.layout.num_layers:
            raise ValueError(f"{len(tables)} per-layer block tables for {self.layout.num_layers} layers")
        for table in tables:
            if len(table) * self.layout.block_tokens < num_tokens:
                raise ValueError(
                    f"{len(table)} blocks of {self.layout.block_tokens} tokens cannot hold {num_tokens} tokens"
                )
        dests = Destinations(
            transfer_id,
            num_tokens,
            timeout,
            block_ids=[] if per_layer else tables[0],
            layer_block_ids=tables if per_layer else None,
        )
        with self._lock:
            if transfer_id in self._recv_ids:
                raise ValueError(f"transfer {transfer_id} is already expected")
            self._recv_ids.add(transfer_id)
        self._post(self._do_expect, prefill_addr, dests)

    # ---- sender side (P) ---------------------------------------------------------------------------------
    def offer(self, transfer_id: str, src_blocks: Sequence[int]) -> None:
        """Declare (or extend, for chunked prefill) P's block table for ``transfer_id``, in token order.

        The first call starts the sender state (WAITING) and its lease: if no activity (destinations, push,
        landed write, D's Ack) happens for ``config.lease_s``, the transfer ends FAILED with
        ``lease_expired`` and its blocks are released. A later call passes the whole, longer table (the
        known prefix must not change).
        """
        self._post(self._do_offer, transfer_id, [int(b) for b in src_blocks], time.monotonic())

    def push_layer(self, transfer_id: str, layer: int, start: int = 0, end: int | None = None) -> None:
        """Write ``layer``'s blocks at table positions ``[start, end)`` (None: to the table's end) to D.

        Called from ``save_kv_layer`` once the layer's KV is computed. When D's destinations are not known
        yet, the intent is recorded (not the data: P keeps its blocks until the transfer is reported) and
        executed when they arrive. Pushing a position twice (a block completed by the next chunk) is fine.
        """
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.layout.num_layers - 1}")
        self._post(self._do_push, transfer_id, layer, start, end)

    def finish(self, transfer_id: str, first_token: int | None = None) -> None:
        """No more pushes: once every write landed, send ``Done`` (with the first sampled token, if any).

        The time from this call until the writes landed is the exposed transfer time. The transfer is
        reported DONE after D's ``Ack`` (or FAILED when D dies or the lease expires first).
        """
        self._post(self._do_finish, transfer_id, first_token, time.monotonic())

    # ---- both sides --------------------------------------------------------------------------------------
    def abort(self, transfer_id: str, reason: str = "aborted by engine") -> None:
        """Abort a transfer on this side and tell the peer; unknown ids are ignored (idempotent).

        It is reported ABORTED once no write can touch its blocks any more (in-flight writes drained on P,
        P's ``Ack`` or a closed connection on D).
        """
        self._post(self._do_abort, transfer_id, reason)

    def poll(self) -> list[TransferResult]:
        """Transfers that ended since the last call, each reported exactly once, then forgotten."""
        with self._lock:
            results = list(self._results.values())
            self._results.clear()
            for r in results:
                if r.role == "recv":
                    self._recv_ids.discard(r.transfer_id)
        return results

    def state(self, transfer_id: str) -> TransferState | None:
        """Current state of a transfer (terminal until reported by ``poll``), or None when unknown."""
        with self._lock:
            if transfer_id in self._results:
                return self._results[transfer_id].state
        live = self._sends.get(transfer_id) or self._recvs.get(transfer_id)
        return live.state if live is not None else None

    def counters(self) -> TransferCounters:
        """A copy of the cumulative counters."""
        with self._lock:
            c = dataclasses.replace(self._counters)
            c.per_layer_seconds = dict(self._counters.per_layer_seconds)
            return c

    def table_sizes(self) -> dict[str, int]:
        """Number of entries in every internal table (tests assert they return to zero: no leaks)."""

        async def sizes() -> dict[str, int]:
            with self._lock:
                unreported, recv_ids = len(self._results), len(self._recv_ids)
            return {
                "sends": len(self._sends),
                "orphan_destinations": len(self._orphans),
                "recvs": len(self._recvs),
                "unreported_results": unreported,
                "expected_ids": recv_ids,
                "links": len(self._links),
                "peers": len(self._peers),
            }

        return self._io.run(sizes(), self.config.connect_timeout_s)

    def close(self) -> None:
        """Fail every open transfer, close connections and the listener, close the transport (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._io.run(self._shutdown(), self.config.connect_timeout_s + self.config.abort_grace_s)
        finally:
            self._io.stop()
            self._transport.close()

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        if self._closed:
            raise RuntimeError(f"transfer engine {self.config.engine_id} is closed")
        self._io.call(fn, *args)

    # ================================ I/O thread only below this line =====================================
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._io.loop

    def _count(self, **increments: float) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._counters, name, getattr(self._counters, name) + value)

    def _report(self, result: TransferResult) -> None:
        with self._lock:
            self._results[result.transfer_id] = result
            if result.state is TransferState.FAILED:
                self._counters.failures += 1
            elif result.state is TransferState.ABORTED:
                self._counters.aborts += 1
        log = logger.info if result.state is TransferState.DONE else logger.warning
        log(
            "pd_connector transfer %s (%s) %s %s",
            result.transfer_id,
            result.role,
            result.state.value,
            result.reason,
        )

    async def _listen(self) -> asyncio.Server:
        server = await control.serve(
            self.config.listen_host,
            self.config.listen_port or 0,
            self._codec,
            self.config.heartbeat_interval_s,
            self.config.heartbeat_timeout_s,
            self._serve_peer,
        )
        host, port = server.sockets[0].getsockname()[:2]
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return server

    async def _shutdown(self) -> None:
        for st in list(self._sends.values()):
            self._end_send(st, TransferState.FAILED, "transfer engine closed")
        for tid in list(self._orphans):
            self._drop_orphan(tid)
        for rt in list(self._recvs.values()):
            self._finish_recv(rt, TransferState.FAILED, "transfer engine closed")
        for link in list(self._links.values()):
            if link.conn is not None:
                link.conn.close("engine closed")
        for conn in list(self._peers):
            conn.close("engine closed")
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # ---- P side: handshake ---------------------------------------------------------------------------------
    def _check_hello(self, hello: Hello) -> Refused | None:
        if hello.version != PROTOCOL_VERSION:
            return Refused(
                f"protocol version mismatch: decode speaks {hello.version}, prefill {PROTOCOL_VERSION}",
                ["version"],
            )
        if hello.transport != self._transport.name:
            return Refused(
                f"transport mismatch: decode uses {hello.transport!r}, prefill {self._transport.name!r}",
                ["transport"],
            )
        if hello.layout_hash != hello.layout.compat_hash():
            return Refused("layout_hash does not match the layout sent", ["layout_hash"])
        try:
            check_compatible(self.layout, hello.layout)
        except LayoutMismatch as e:
            return Refused(str(e), list(e.fields))
        return None

    async def _serve_peer(self, conn: control.Connection) -> None:
        """Handle one decode side's connection on our listener: handshake, then messages until it closes."""
        try:
            hello = await conn.read_message(self.config.connect_timeout_s)
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected hello, got {type(hello).__name__}")
        except (ProtocolError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            self._count(rejected_connections=1)
            logger.error("pd_connector control: rejecting connection from %s: %r", conn.peer, e)
            return
        refusal = self._check_hello(hello)
        peer_id = f"{hello.engine_id}#{conn.id}"
        if refusal is None:
            try:
                attach = self._transport.attach(peer_id, hello.memory)
                await asyncio.wait_for(asyncio.wrap_future(attach), self.config.connect_timeout_s)
            except Exception as e:
                self._transport.detach(peer_id)
                refusal = Refused(f"cannot attach {self._transport.name} transport to decode memory: {e!r}")
        if refusal is not None:
            self._count(rejected_connections=1)
            logger.error(
                "pd_connector control: refusing %s (%s): %s", hello.engine_id, conn.peer, refusal.reason
            )
            conn.send(refusal)
            return
        peer = _Peer(conn, peer_id, hello.engine_id, BlockMapping(self.layout, hello.layout))
        self._peers[conn] = peer
        conn.on_message = self._on_peer_message
        conn.on_close = self._on_peer_closed
        conn.send(HelloAck(self.config.engine_id, self.layout.compat_hash()))
        logger.info("pd_connector control: decode %s connected from %s", hello.engine_id, conn.peer)
        await conn.run()

    def _on_peer_closed(self, conn: control.Connection, reason: str) -> None:
        peer = self._peers.pop(conn, None)
        if peer is None:
            return
        self._transport.detach(peer.peer_id)  # fails in-flight writes into a peer we no longer trust
        for tid in [t for t, (p, _, _) in self._orphans.items() if p is peer]:
            self._drop_orphan(tid)
        for st in [s for s in self._sends.values() if s.peer is peer]:
            st.peer = None
            self._end_send(st, TransferState.FAILED, f"decode {peer.engine_id} lost: {reason}")

    def _on_peer_message(self, conn: control.Connection, msg: Message) -> None:
        peer = self._peers[conn]
        if isinstance(msg, Destinations):
            self._on_destinations(peer, msg)
        elif isinstance(msg, Ack):
            st = self._sends.get(msg.transfer_id)
            if st is not None and st.peer is peer and st.done_sent:
                self._end_send(st, TransferState.DONE, "")
        elif isinstance(msg, Abort):
            self._on_peer_abort(peer, msg)
        else:
            logger.error("pd_connector control: unexpected %s from decode %s", type(msg).__name__, conn.peer)
            conn.close(f"unexpected {type(msg).__name__}")

    def _on_destinations(self, peer: _Peer, dests: Destinations) -> None:
        tid = dests.transfer_id
        problem = self._validate_destinations(peer, dests)
        if problem is None and (tid in self._orphans or (tid in self._sends and self._sends[tid].peer)):
            problem = "destinations for this transfer were already given"
        if problem is not None:
            logger.error(
                "pd_connector transfer %s: bad destinations from %s: %s", tid, peer.engine_id, problem
            )
            peer.conn.send(Abort(tid, f"prefill refused destinations: {problem}", failure=True))
            return
        st = self._sends.get(tid)
        if st is None:  # D was faster than P's scheduler: keep the destinations until offer() (or lease end)
            timer = self._loop().call_later(self.config.lease_s, self._orphan_expired, tid)
            self._orphans[tid] = (peer, dests, timer)
            return
        self._bind(st, peer, dests)

    def _validate_destinations(self, peer: _Peer, dests: Destinations) -> str | None:
        d = peer.mapping.decode
        tables = dests.layer_block_ids if dests.layer_block_ids is not None else [dests.block_ids]
        if dests.layer_block_ids is not None and len(tables) != d.num_layers:
            return f"{len(tables)} per-layer tables for {d.num_layers} layers"
        if dests.num_tokens <= 0 or dests.lease_s <= 0:
            return "num_tokens and lease_s must be positive"
        for table in tables:
            if len(table) * d.block_tokens < dests.num_tokens:
                return f"{len(table)} blocks cannot hold {dests.num_tokens} tokens"
        return None

    def _orphan_expired(self, tid: str) -> None:
        entry = self._orphans.pop(tid, None)
        if entry is not None:
            self._count(expired_leases=1)
            entry[0].conn.send(
                Abort(
                    tid, f"prefill never offered this transfer within {self.config.lease_s} s", failure=True
                )
            )

    def _drop_orphan(self, tid: str) -> None:
        entry = self._orphans.pop(tid, None)
        if entry is not None:
            entry[2].cancel()

    def _on_peer_abort(self, peer: _Peer, msg: Abort) -> None:
        tid = msg.transfer_id
        if tid in self._orphans:
            self._drop_orphan(tid)
        st = self._sends.get(tid)
        if st is not None and st.peer is peer and st.ending is None:
            st.decode_aborted = True
            state = TransferState.FAILED if msg.failure else TransferState.ABORTED
            self._end_send(st, state, f"decode {'gave up' if msg.failure else 'aborted'}: {msg.reason}")
        elif st is not None and st.peer is peer:
            pass  # already ending: our Abort follows once drained, and D takes it as the answer
        else:
            peer.conn.send(Ack(tid))  # nothing of ours writes into it

    # ---- P side: the per-transfer state machine ------------------------------------------------------------
    def _arm(self, st: _Send) -> None:
        """(Re)start the lease: idle ``lease_s``, never beyond the decode side's own deadline."""
        if st.timer is not None:
            st.timer.cancel()
        now = self._loop().time()
        st.timer = self._loop().call_at(
            min(now + self.config.lease_s, st.dest_deadline), self._lease_expired, st
        )

    def _lease_expired(self, st: _Send) -> None:
        st.timer = None
        if self._sends.get(st.transfer_id) is not st or st.ending is not None:
            return
        self._count(expired_leases=1)
        self._end_send(st, TransferState.FAILED, "lease expired", lease_expired=True)

    def _do_offer(self, tid: str, blocks: list[int], at: float) -> None:
        st = self._sends.get(tid)
        if st is None:
            st = self._sends[tid] = _Send(tid, blocks, at)
            orphan = self._orphans.pop(tid, None)
            if orphan is not None:
                orphan[2].cancel()
                self._bind(st, orphan[0], orphan[1])
            else:
                self._arm(st)
            return
        if st.ending is not None:
            return
        if blocks[: len(st.src_blocks)] != st.src_blocks:
            self._end_send(st, TransferState.FAILED, "offer() changed already offered blocks")
            return
        st.src_blocks = blocks
        self._arm(st)

    def _bind(self, st: _Send, peer: _Peer, dests: Destinations) -> None:
        st.peer, st.dests = peer, dests
        st.state = TransferState.TRANSFERRING
        st.dest_deadline = self._loop().time() + dests.lease_s
        self._arm(st)
        intents, st.intents = st.intents, []
        for layer, start, end in intents:
            self._write(st, layer, start, end)
        self._maybe_done(st)

    def _do_push(self, tid: str, layer: int, start: int, end: int | None) -> None:
        st = self._sends.get(tid)
        if st is None or st.ending is not None:
            logger.debug("pd_connector transfer %s: push of layer %d ignored (not live)", tid, layer)
            return
        if st.finished_at is not None:
            self._end_send(st, TransferState.FAILED, "push_layer() after finish()")
            return
        self._arm(st)
        if st.peer is None:
            st.intents.append((layer, start, end))
        else:
            self._write(st, layer, start, end)

    def _write(self, st: _Send, layer: int, start: int, end: int | None) -> None:
        assert st.peer is not None and st.dests is not None
        dests, mapping = st.dests, st.peer.mapping
        ps = self.layout.block_tokens
        stop = len(st.src_blocks) if end is None else end
        first, last = start * ps, min(stop * ps, dests.num_tokens)
        if first >= last:
            return
        dst = dests.layer_block_ids[layer] if dests.layer_block_ids is not None else dests.block_ids
        try:
            copies = mapping.copies(layer, st.src_blocks, dst, first, last)
        except ValueError as e:
            self._end_send(st, TransferState.FAILED, f"layer {layer}: {e}")
            return
        st.tokens_covered = max(st.tokens_covered, last)
        st.inflight += 1
        started = time.monotonic()
        future = self._transport.write(st.peer.peer_id, copies)
        timer = self._loop().call_later(self.config.write_timeout_s, self._write_timed_out, st, future)
        future.add_done_callback(
            functools.partial(self._io.call, self._on_write_done, st, layer, started, timer)
        )

    def _write_timed_out(self, st: _Send, future: Future[int]) -> None:
        if not future.done() and st.peer is not None:
            reason = f"write did not complete within {self.config.write_timeout_s} s"
            logger.error(
                "pd_connector transfer %s: %s; dropping decode %s", st.transfer_id, reason, st.peer.engine_id
            )
            st.peer.conn.close(reason)  # detaches the endpoint, which fails the write

    def _on_write_done(
        self, st: _Send, layer: int, started: float, timer: asyncio.TimerHandle, future: Future[int]
    ) -> None:
        timer.cancel()
        st.inflight -= 1
        error = future.exception()
        if error is not None:
            if st.ending is None:
                self._end_send(st, TransferState.FAILED, f"layer {layer} write failed: {error!r}")
            self._maybe_ended(st)
            return
        n, elapsed = future.result(), time.monotonic() - started
        st.bytes += n
        with self._lock:
            self._counters.bytes_sent += n
            self._counters.layer_writes += 1
            self._counters.layer_seconds += elapsed
            self._counters.per_layer_seconds[layer] = (
                self._counters.per_layer_seconds.get(layer, 0.0) + elapsed
            )
        if st.ending is not None:
            self._maybe_ended(st)
            return
        assert st.peer is not None
        st.peer.conn.send(LayerDone(st.transfer_id, layer, n))
        self._arm(st)
        self._maybe_done(st)

    def _do_finish(self, tid: str, first_token: int | None, at: float) -> None:
        st = self._sends.get(tid)
        if st is None or st.ending is not None or st.finished_at is not None:
            return
        st.finished_at, st.first_token = at, first_token
        self._maybe_done(st)

    def _maybe_done(self, st: _Send) -> None:
        if st.peer is None or st.finished_at is None or st.inflight or st.done_sent or st.ending is not None:
            return
        assert st.dests is not None
        if st.tokens_covered < st.dests.num_tokens:
            self._end_send(
                st,
                TransferState.FAILED,
                f"prefill pushed {st.tokens_covered} of the {st.dests.num_tokens} tokens decode wants",
            )
            return
        st.exposed_s = time.monotonic() - st.finished_at
        st.done_sent = True
        self._count(exposed_seconds=st.exposed_s)
        st.peer.conn.send(Done(st.transfer_id, st.tokens_covered, st.first_token))
        self._arm(st)  # D's Ack must come within the lease

    def _end_send(self, st: _Send, state: TransferState, reason: str, lease_expired: bool = False) -> None:
        """Stop scheduling writes; report once the in-flight ones drained (the source blocks are free then)."""
        if st.ending is not None:
            return
        st.ending = (state, reason, lease_expired)
        st.intents.clear()
        self._maybe_ended(st)

    def _maybe_ended(self, st: _Send) -> None:
        if st.ending is None or st.inflight or self._sends.get(st.transfer_id) is not st:
            return
        state, reason, lease_expired = st.ending
        del self._sends[st.transfer_id]
        if st.timer is not None:
            st.timer.cancel()
        if st.peer is not None and state is not TransferState.DONE:
            # Decode's Abort gets our Ack; our own failure or abort gets an Abort (D answers with Ack).
            failure = state is TransferState.FAILED
            st.peer.conn.send(
                Ack(st.transfer_id) if st.decode_aborted else Abort(st.transfer_id, reason, failure)
            )
        if state is TransferState.DONE:
            self._count(transfers_sent=1)
        self._report(
            TransferResult(
                st.transfer_id,
                "send",
                state,
                reason,
                num_tokens=st.tokens_covered,
                first_token=st.first_token,
                bytes=st.bytes,
                duration_s=time.monotonic() - st.started,
                exposed_s=st.exposed_s,
                lease_expired=lease_expired,
            )
        )

    # ---- D side ----------------------------------------------------------------------------------------------
    def _do_expect(self, addr: str, dests: Destinations) -> None:
        link = self._links.get(addr)
        if link is None:
            link = self._links[addr] = _Link(addr)
            self._loop().create_task(self._connect(link))
        rt = _Recv(dests.transfer_id, link, dests, time.monotonic())
        self._recvs[rt.transfer_id] = rt
        rt.timer = self._loop().call_later(dests.lease_s, self._recv_timed_out, rt)
        if link.ready:
            self._send_destinations(rt)
        else:
            link.waiting.append(rt.transfer_id)

    async def _connect(self, link: _Link) -> None:
        cfg = self.config
        reason = ""
        try:
            conn = await control.connect(
                link.addr,
                self._codec,
                cfg.connect_timeout_s,
                cfg.heartbeat_interval_s,
                cfg.heartbeat_timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as e:
            self._link_failed(link, f"cannot connect to prefill {link.addr}: {e!r}")
            return
        link.conn = conn
        conn.on_close = lambda c, why: self._link_failed(link, f"prefill {link.addr} lost: {why}")
        hello = Hello(
            PROTOCOL_VERSION,
            cfg.engine_id,
            self.layout,
            self.layout.compat_hash(),
            self._transport.name,
            self._memory,
        )
        try:
            conn.send(hello)
            reply = await conn.read_message(cfg.connect_timeout_s)
        except (ProtocolError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            reply = None
            reason = f"handshake with prefill {link.addr} failed: {e!r}"
        if isinstance(reply, Refused):
            reason = f"prefill {link.addr} refused the handshake: {reply.reason}"
        elif reply is not None and not isinstance(reply, HelloAck):
            reason = f"prefill {link.addr} answered the handshake with {type(reply).__name__}"
        if reason or link.conn is not conn:
            logger.error("pd_connector control: %s", reason)
            conn.on_close = lambda c, why: None
            conn.close(reason)
            self._link_failed(link, reason or "link closed during handshake")
            return
        link.ready = True
        conn.on_message = lambda c, msg: self._on_link_message(link, msg)
        waiting, link.waiting = link.waiting, []
        for tid in waiting:
            rt = self._recvs.get(tid)
            if rt is not None and rt.link is link:
                self._send_destinations(rt)
        await conn.run()

    def _link_failed(self, link: _Link, reason: str) -> None:
        """The link is gone (refused, unreachable, closed): every transfer on it fails now."""
        if self._links.get(link.addr) is link:
            del self._links[link.addr]
        link.ready = False
        for rt in [r for r in self._recvs.values() if r.link is link]:
            state = rt.ending[0] if rt.ending is not None else TransferState.FAILED
            why = rt.ending[1] if rt.ending is not None else reason
            self._finish_recv(rt, state, why)

    def _send_destinations(self, rt: _Recv) -> None:
        assert rt.link.conn is not None
        remaining = rt.dests.lease_s - (time.monotonic() - rt.started)
        # The lease P sees is what is left of our timeout, so P never writes after we gave up.
        rt.sent = rt.link.conn.send(msgspec.structs.replace(rt.dests, lease_s=max(remaining, 1e-3)))

    def _on_link_message(self, link: _Link, msg: Message) -> None:
        rt = self._recvs.get(getattr(msg, "transfer_id", ""))
        if isinstance(msg, LayerDone):
            if rt is not None and rt.ending is None:
                rt.state = TransferState.TRANSFERRING
                rt.bytes += msg.bytes
                self._count(bytes_received=msg.bytes)
        elif isinstance(msg, Done):
            assert link.conn is not None
            link.conn.send(Ack(msg.transfer_id))
            if rt is None:
                return
            if msg.num_tokens < rt.dests.num_tokens:
                self._finish_recv(
                    rt,
                    TransferState.FAILED,
                    f"prefill covered {msg.num_tokens} of {rt.dests.num_tokens} tokens",
                )
            elif rt.ending is not None:
                self._finish_recv(rt, *rt.ending)  # P finished its writes before seeing our abort
            else:
                self._count(transfers_received=1)
                self._finish_recv(rt, TransferState.DONE, "", first_token=msg.first_token)
        elif isinstance(msg, Abort):
            assert link.conn is not None
            link.conn.send(Ack(msg.transfer_id))
            if rt is not None:
                if rt.ending is not None:  # we had given up already: P's Abort crossed ours
                    self._finish_recv(rt, *rt.ending)
                elif msg.failure:
                    self._finish_recv(rt, TransferState.FAILED, f"prefill failed: {msg.reason}")
                else:
                    self._finish_recv(rt, TransferState.ABORTED, f"prefill aborted: {msg.reason}")
        elif isinstance(msg, Ack):
            if rt is not None and rt.ending is not None:
                self._finish_recv(rt, *rt.ending)
        else:
            logger.error("pd_connector control: unexpected %s from prefill %s", type(msg).__name__, link.addr)
            if link.conn is not None:
                link.conn.close(f"unexpected {type(msg).__name__}")

    def _recv_timed_out(self, rt: _Recv) -> None:
        rt.timer = None
        if self._recvs.get(rt.transfer_id) is rt and rt.ending is None:
            self._count(timeouts=1)
            self._give_up(rt, TransferState.FAILED, f"no KV from prefill within {rt.dests.lease_s} s")

    def _give_up(self, rt: _Recv, state: TransferState, reason: str) -> None:
        """D ends a transfer: tell P and wait for its Ack (it drained its writes) before reporting."""
        if not (rt.sent and rt.link.ready and rt.link.conn is not None):
            self._finish_recv(rt, state, reason)  # P never learnt our blocks: nothing can write into them
            return
        rt.ending = (state, reason)
        rt.link.conn.send(Abort(rt.transfer_id, reason, state is TransferState.FAILED))
        if rt.timer is not None:
            rt.timer.cancel()
        rt.timer = self._loop().call_later(self.config.abort_grace_s, self._abort_unanswered, rt)

    def _abort_unanswered(self, rt: _Recv) -> None:
        rt.timer = None
        if self._recvs.get(rt.transfer_id) is rt and rt.link.conn is not None:
            logger.error(
                "pd_connector transfer %s: prefill %s did not answer our abort within %s s; closing the link",
                rt.transfer_id,
                rt.link.addr,
                self.config.abort_grace_s,
            )
            rt.link.conn.close("abort unanswered")  # P detaches on close: no write can land afterwards

    def _do_abort(self, tid: str, reason: str) -> None:
        st = self._sends.get(tid)
        if st is not None:
            self._end_send(st, TransferState.ABORTED, reason)
        if tid in self._orphans:
            peer = self._orphans[tid][0]
            self._drop_orphan(tid)
            peer.conn.send(Abort(tid, reason))
        rt = self._recvs.get(tid)
        if rt is not None and rt.ending is None:
            self._give_up(rt, TransferState.ABORTED, reason)

    def _finish_recv(
        self, rt: _Recv, state: TransferState, reason: str, first_token: int | None = None
    ) -> None:
        if self._recvs.get(rt.transfer_id) is not rt:
            return
        del self._recvs[rt.transfer_id]
        if rt.timer is not None:
            rt.timer.cancel()
        if rt.transfer_id in rt.link.waiting:
            rt.link.waiting.remove(rt.transfer_id)
        self._report(
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
