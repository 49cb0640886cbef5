"""Sender (prefill, P) half of the transfer engine: the side-channel server and per-transfer push state.

Runs only on the engine's I/O thread. Each decode side (D) connects to our listener, handshakes (version,
transport, KV layout) and then sends Destinations; the adapter's ``offer``/``push_layer``/``finish`` calls
turn into transport writes into D's memory. A transfer is reported (and its source blocks freed by the
adapter) only once its in-flight writes drained, so P never frees blocks a write is still reading.

Under tensor parallelism one transfer of this P rank may serve several D ranks (``Destinations.fanout``),
each with its own head slice: every push goes to each bound D rank, pushes made before a D rank's
destinations came are replayed to it, and the transfer is DONE once each D rank got every token it asked for
on every layer (``Done`` to each). Any D rank failing fails the transfer for all of them.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import Future

from pd_connector import control
from pd_connector.block_mapping import BlockMapping
from pd_connector.protocol import (
    Abort,
    Ack,
    Checksums,
    Destinations,
    Done,
    LayerDone,
    Message,
)
from pd_connector.transfer import handshake, integrity
from pd_connector.transfer.context import EngineContext, logger
from pd_connector.transfer.coverage import add_span, first_hole
from pd_connector.transfer.send_state import Binding, Orphan, Peer, Send, Tombstone, validate_destinations
from pd_connector.transfer.types import TransferResult, TransferState, state_in


class Sender:
    """P side of every transfer of one engine."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        self.sends: dict[str, Send] = {}
        self.orphans: dict[str, list[Orphan]] = {}
        self.peers: dict[control.Connection, Peer] = {}
        # Transfers that ended before (all) D ranks' destinations came: answered with Abort when they do.
        self.tombstones: dict[str, Tombstone] = {}

    def sizes(self) -> dict[str, int]:
        return {
            "sends": len(self.sends),
            "orphan_destinations": sum(len(o) for o in self.orphans.values()),
            "peers": len(self.peers),
            "tombstones": len(self.tombstones),
        }

    def state(self, tid: str) -> TransferState | None:
        return state_in(self.sends, tid)

    def shutdown(self) -> None:
        for st in list(self.sends.values()):
            self._end(st, TransferState.FAILED, "transfer engine closed")
        for tid in list(self.orphans):
            self._drop_orphans(tid)
        for tombstone in self.tombstones.values():
            tombstone.timer.cancel()
        self.tombstones.clear()
        for conn in list(self.peers):
            conn.close("engine closed")

    # ---- connections from D ---------------------------------------------------------------------------------
    async def serve_peer(self, conn: control.Connection) -> None:
        """Handle one decode side's connection on our listener: handshake, then messages until it closes."""
        accepted = await handshake.accept(self.ctx, conn)
        if accepted is None:
            return
        mapping = BlockMapping(self.ctx.layout, accepted.layout)
        self.peers[conn] = Peer(conn, accepted.peer_id, accepted.engine_id, mapping)
        conn.on_message = self._on_message
        conn.on_close = self._on_closed
        await conn.run()

    def _on_closed(self, conn: control.Connection, reason: str) -> None:
        peer = self.peers.pop(conn, None)
        if peer is None:
            return
        self.ctx.transport.detach(peer.peer_id)  # fails in-flight writes into a peer we no longer trust
        for tid in list(self.orphans):
            self._drop_orphans(tid, peer)
        for st in [s for s in self.sends.values() if s.binding(peer) is not None]:
            self._end(st, TransferState.FAILED, f"decode {peer.engine_id} lost: {reason}")

    def _on_message(self, conn: control.Connection, msg: Message) -> None:
        peer = self.peers[conn]
        if isinstance(msg, Destinations):
            self._on_destinations(peer, msg)
        elif isinstance(msg, Ack):
            pass  # D answering our Abort: we sent it only after our writes drained, nothing waits for it
        elif isinstance(msg, Abort):
            self._on_abort(peer, msg)
        else:
            logger.error("control: unexpected %s from decode %s", type(msg).__name__, conn.peer)
            conn.close(f"unexpected {type(msg).__name__}")

    # ---- messages from D -------------------------------------------------------------------------------------
    def _on_destinations(self, peer: Peer, dests: Destinations) -> None:
        tid = dests.transfer_id
        problem = validate_destinations(self.ctx.layout, peer, dests)
        st = self.sends.get(tid)
        again = any(o.peer is peer for o in self.orphans.get(tid, ())) or (
            st is not None and st.binding(peer) is not None
        )
        if problem is None and again:
            problem = "destinations for this transfer were already given"
        if problem is not None:
            logger.error("transfer %s: bad destinations from %s: %s", tid, peer.engine_id, problem)
            peer.conn.send(Abort(tid, f"prefill refused destinations: {problem}", failure=True))
            return
        tombstone = self.tombstones.get(tid)
        if tombstone is not None:  # P already ended this transfer: D learns it now, not at its timeout
            peer.conn.send(tombstone.abort)
            tombstone.left = (dests.fanout if tombstone.left is None else tombstone.left) - 1
            if tombstone.left <= 0:
                tombstone.timer.cancel()
                del self.tombstones[tid]
            return
        if st is None:  # D was faster than P's scheduler: keep the destinations until offer() (or lease end)
            timer = self.ctx.loop.call_later(self.ctx.config.lease_s, self._orphan_expired, tid, peer)
            self.orphans.setdefault(tid, []).append(Orphan(peer, dests, timer))
            return
        self._bind(st, peer, dests)

    def _orphan_expired(self, tid: str, peer: Peer) -> None:
        orphans = self.orphans.get(tid, [])
        orphan = next((o for o in orphans if o.peer is peer), None)
        if orphan is not None:
            self._drop_orphans(tid, peer)
            self.ctx.count(expired_leases=1)
            reason = f"prefill never offered this transfer within {self.ctx.config.lease_s} s"
            orphan.peer.conn.send(Abort(tid, reason, failure=True))

    def _drop_orphans(self, tid: str, peer: Peer | None = None) -> list[Orphan]:
        """Forget ``tid``'s early destinations (only ``peer``'s, if given); returns the dropped ones."""
        orphans = self.orphans.get(tid, [])
        dropped = [o for o in orphans if peer is None or o.peer is peer]
        for orphan in dropped:
            orphan.timer.cancel()
        kept = [o for o in orphans if o not in dropped]
        if kept:
            self.orphans[tid] = kept
        else:
            self.orphans.pop(tid, None)
        return dropped

    def _on_abort(self, peer: Peer, msg: Abort) -> None:
        tid = msg.transfer_id
        self._drop_orphans(tid, peer)
        st = self.sends.get(tid)
        state = TransferState.FAILED if msg.failure else TransferState.ABORTED
        why = f"decode {'gave up' if msg.failure else 'aborted'}: {msg.reason}"
        binding = None if st is None else st.binding(peer)
        if st is None:
            peer.conn.send(Ack(tid))  # nothing of ours writes into it
        elif binding is None:
            # This D rank gave up before its destinations reached us: nothing was written for it. The
            # request fails on D as a whole, so the transfer ends for every D rank.
            peer.conn.send(Ack(tid))
            if st.ending is None:
                st.decode_aborted = True
                self._end(st, state, why)
        else:
            binding.decode_aborted = True
            if st.ending is None:
                self._end(st, state, why)
            # else: already ending; our Ack follows once drained

    # ---- adapter calls ---------------------------------------------------------------------------------------
    def offer(self, tid: str, blocks: list[int], at: float, prompt_hash: bytes) -> None:
        st = self.sends.get(tid)
        if st is None:
            st = self.sends[tid] = Send(tid, blocks, at, prompt_hash)
            st.timeline.mark("offered", at)
            self._arm(st)
            for orphan in self._drop_orphans(tid):
                if st.ending is None:
                    self._bind(st, orphan.peer, orphan.dests)
            return
        if st.ending is not None:
            return
        if blocks[: len(st.src_blocks)] != st.src_blocks:
            self._end(st, TransferState.FAILED, "offer() changed already offered blocks")
            return
        st.src_blocks = blocks
        self._arm(st)

    def push(self, tid: str, layer: int, start: int, end: int | None) -> None:
        st = self.sends.get(tid)
        if st is None or st.ending is not None:
            logger.debug("transfer %s: push of layer %d ignored (not live)", tid, layer)
            return
        if st.finished_at is not None:
            self._end(st, TransferState.FAILED, "push_layer() after finish()")
            return
        self._arm(st)
        st.pushes.append((layer, start, end))
        for binding in st.bindings:
            self._write(st, binding, layer, start, end)

    def finish(self, tid: str, first_token: int | None, at: float) -> None:
        st = self.sends.get(tid)
        if st is None or st.ending is not None or st.finished_at is not None:
            return
        st.finished_at, st.first_token = at, first_token
        st.timeline.mark("prompt_done", at)
        # P's source is final now: hash it while the last writes are in flight rather than after they landed.
        for binding in st.bindings:
            try:
                binding.checksums = self._checksums(st, binding)
            except ValueError as e:
                self._end(st, TransferState.FAILED, f"integrity checksums: {e}")
                return
        self._maybe_done(st)

    def abort(self, tid: str, reason: str) -> None:
        st = self.sends.get(tid)
        if st is not None:
            self._end(st, TransferState.ABORTED, reason)
        for orphan in self._drop_orphans(tid):
            orphan.peer.conn.send(Abort(tid, reason))

    # ---- the per-transfer state machine ----------------------------------------------------------------------
    def _arm(self, st: Send) -> None:
        """(Re)start the lease: idle ``lease_s``, never beyond a decode side's own deadline."""
        if st.timer is not None:
            st.timer.cancel()
        loop = self.ctx.loop
        deadline = min([loop.time() + self.ctx.config.lease_s, *(b.deadline for b in st.bindings)])
        st.timer = loop.call_at(deadline, self._lease_expired, st)

    def _lease_expired(self, st: Send) -> None:
        st.timer = None
        if self.sends.get(st.transfer_id) is st and st.ending is None:
            self.ctx.count(expired_leases=1)
            self._end(st, TransferState.FAILED, "lease expired", lease_expired=True)

    def _bind(self, st: Send, peer: Peer, dests: Destinations) -> None:
        binding = Binding(peer, dests, self.ctx.loop.time() + dests.lease_s)
        if st.fanout and dests.fanout != st.fanout:
            # Not bound: it gets its own Abort; the others learn it from the failure.
            peer.conn.send(Abort(st.transfer_id, "decode ranks disagree on the fan-out", failure=True))
            self._end(
                st,
                TransferState.FAILED,
                f"decode ranks disagree on the fan-out ({st.fanout}, {dests.fanout})",
            )
            return
        if st.fanout and len(st.bindings) >= st.fanout:
            peer.conn.send(Abort(st.transfer_id, f"all {st.fanout} decode ranks are served", failure=True))
            return
        st.fanout = dests.fanout
        st.bindings.append(binding)
        st.timeline.mark("destinations")
        st.state = TransferState.TRANSFERRING
        if st.prompt_hash and dests.prompt_hash and st.prompt_hash != dests.prompt_hash:
            self._end(st, TransferState.FAILED, "decode's prompt differs from prefill's for this transfer id")
            return
        self._arm(st)
        for layer, start, end in st.pushes:
            self._write(st, binding, layer, start, end)
        self._maybe_done(st)

    def _write(self, st: Send, binding: Binding, layer: int, start: int, end: int | None) -> None:
        dests, ctx = binding.dests, self.ctx
        if ctx.loop.time() >= binding.deadline:
            # D stops waiting at its deadline and may hold its blocks only that long (its data fence): a write
            # started now could land in blocks given to another request. A push can reach us ahead of the
            # lease timer (a stopped P resuming), so the deadline is checked here too.
            if st.timer is not None:
                st.timer.cancel()
            self._lease_expired(st)
            return
        ps = ctx.layout.block_tokens
        stop = len(st.src_blocks) if end is None else end
        first, last = max(start * ps, dests.start_token), min(stop * ps, dests.num_tokens)
        if first >= last:
            return
        try:
            runs = self._runs(st, binding, layer, first, last)
        except ValueError as e:
            self._end(st, TransferState.FAILED, f"layer {layer}: {e}")
            return
        copies = binding.peer.mapping.layer_copies(layer, runs)
        binding.inflight += 1
        started = time.monotonic()
        future = ctx.transport.write(binding.peer.peer_id, copies)
        timer = ctx.loop.call_later(ctx.config.write_timeout_s, self._write_timed_out, binding, future)
        done = functools.partial(self._write_done, st, binding, layer, (first, last), started, timer)
        future.add_done_callback(functools.partial(ctx.io.call_soon, done))

    @staticmethod
    def _runs(st: Send, binding: Binding, layer: int, first: int, last: int) -> list[tuple[int, int, int]]:
        """The copy runs of tokens ``[first, last)`` of ``layer`` into this D rank (cached per binding);
        ``ValueError`` when the tables cannot take them."""
        dests = binding.dests
        per_layer = dests.layer_block_ids is not None
        key = (first, last, layer if per_layer else -1)
        runs = binding.runs.get(key)
        if runs is None:
            dst = dests.layer_block_ids[layer] if dests.layer_block_ids is not None else dests.block_ids
            runs = binding.runs[key] = binding.peer.mapping.runs(st.src_blocks, dst, first, last, dests.heads)
        return runs

    def _checksums(self, st: Send, binding: Binding) -> Checksums | None:
        """Integrity mode: the checksums of everything written to this D rank (None when the mode is off).

        Over the whole span D asked for, from P's source once it is final (at ``finish``: every layer of the
        prompt is computed, so the last write of each granule carries these bytes; ``integrity`` explains why
        not per write). ``ValueError`` when the run tables would not fit in a control frame.
        """
        kv_bytes = self.ctx.kv_bytes
        if kv_bytes is None:
            return None
        dests, per_layer = binding.dests, binding.dests.layer_block_ids is not None
        first, last = dests.start_token, dests.num_tokens
        layers = range(self.ctx.layout.num_layers) if per_layer else range(1)
        tables = [self._runs(st, binding, layer, first, last) for layer in layers]
        regions = integrity.hashed_regions(self.ctx.layout, per_layer)
        if 16 * sum(len(t) for t in tables) > self.ctx.config.max_frame_bytes // 2:
            raise ValueError(f"its {sum(len(t) for t in tables)} checksummed runs exceed a control frame")
        return integrity.checksums(kv_bytes, regions, tables)

    def _write_timed_out(self, binding: Binding, future: Future[int]) -> None:
        if not future.done():
            reason = f"write did not complete within {self.ctx.config.write_timeout_s} s"
            logger.error("%s; dropping decode %s", reason, binding.peer.engine_id)
            binding.peer.conn.close(reason)  # detaches the endpoint, which fails the write

    def _write_done(
        self,
        st: Send,
        binding: Binding,
        layer: int,
        span: tuple[int, int],
        started: float,
        timer: asyncio.TimerHandle,
        future: Future[int],
    ) -> None:
        timer.cancel()
        binding.inflight -= 1
        error = future.exception()
        if error is not None:
            self._end(st, TransferState.FAILED, f"layer {layer} write failed: {error!r}")
            self._maybe_ended(st)
            # A transport endpoint whose write failed (its data connection reset, its peer gone) fails every
            # later write too: drop this decode, which detaches the endpoint and fails its other transfers, so
            # its next transfer dials again and gets a fresh handshake and data path, not the dead one.
            binding.peer.conn.close(f"a write into it failed: {error!r}")
            return
        n = future.result()
        st.bytes += n
        add_span(binding.covered.setdefault(layer, []), *span)
        self.ctx.count_layer(layer, n, time.monotonic() - started)
        if st.ending is not None:
            self._maybe_ended(st)
            return
        binding.peer.conn.send(LayerDone(st.transfer_id, layer, n))
        self._arm(st)
        self._maybe_done(st)

    def _maybe_done(self, st: Send) -> None:
        """After the last push: Done to each D rank whose writes all landed; DONE once every rank has it."""
        if st.finished_at is None or st.ending is not None:
            return
        layers = self.ctx.layout.num_layers
        for binding in st.bindings:
            if binding.done or binding.inflight:
                continue
            dests = binding.dests
            hole = first_hole(binding.covered, layers, dests.start_token, dests.num_tokens)
            if hole is not None:
                self._end(st, TransferState.FAILED, hole)
                return
            try:
                sums = binding.checksums or self._checksums(st, binding)
            except ValueError as e:
                self._end(st, TransferState.FAILED, f"integrity checksums: {e}")
                return
            # Push model: every byte is in D's memory and P's blocks are read by nobody else.
            binding.peer.conn.send(Done(st.transfer_id, dests.num_tokens, st.first_token, sums))
            binding.done = True
        if st.fanout and sum(b.done for b in st.bindings) == st.fanout:
            st.exposed_s = time.monotonic() - st.finished_at
            st.timeline.mark("done")
            self.ctx.count(exposed_seconds=st.exposed_s)
            self._end(st, TransferState.DONE, "")

    def _end(self, st: Send, state: TransferState, reason: str, lease_expired: bool = False) -> None:
        """Stop scheduling writes; report once the in-flight ones drained (the source blocks are free then)."""
        if st.ending is not None:
            return
        st.ending = (state, reason, lease_expired)
        self._maybe_ended(st)

    def _maybe_ended(self, st: Send) -> None:
        if st.ending is None or st.inflight or self.sends.get(st.transfer_id) is not st:
            return
        state, reason, lease_expired = st.ending
        del self.sends[st.transfer_id]
        if st.timer is not None:
            st.timer.cancel()
        failure = state is TransferState.FAILED
        for binding in st.bindings:
            if binding.done or binding.peer.conn.closed:
                continue
            # Decode's Abort gets our Ack; our own failure or abort gets an Abort (D answers with Ack).
            reply = Ack(st.transfer_id) if binding.decode_aborted else Abort(st.transfer_id, reason, failure)
            binding.peer.conn.send(reply)
        if state is not TransferState.DONE and len(st.bindings) < max(st.fanout, 1) and not st.decode_aborted:
            # D ranks whose destinations have not come yet learn the end when they do (for lease_s).
            timer = self.ctx.loop.call_later(
                self.ctx.config.lease_s, self.tombstones.pop, st.transfer_id, None
            )
            left = st.fanout - len(st.bindings) if st.fanout else None
            self.tombstones[st.transfer_id] = Tombstone(Abort(st.transfer_id, reason, failure), timer, left)
        if state is TransferState.DONE:
            self.ctx.count(transfers_sent=1)
        num_tokens = st.bindings[0].dests.num_tokens if state is TransferState.DONE else 0
        self.ctx.report(
            TransferResult(
                st.transfer_id,
                "send",
                state,
                reason,
                num_tokens=num_tokens,
                first_token=st.first_token,
                bytes=st.bytes,
                duration_s=time.monotonic() - st.started,
                exposed_s=st.exposed_s,
                lease_expired=lease_expired,
                stages=st.timeline.stamps,
            )
        )
