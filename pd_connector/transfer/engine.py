"""The transfer engine: one per engine worker process, both sender (P) and receiver (D) roles.

Threading: every public method is thread-safe and returns at once (adapters call them from scheduler and
worker threads, including from inside the forward pass). Work is posted to a dedicated I/O thread running
an asyncio loop, which owns all per-transfer state (``sender.Sender``, ``receiver.Receiver``), the control
connections and the transport callbacks; results come back through ``poll()``.

Safety rule behind the abort/timeout paths: a side reports a transfer as ended only when no write can touch
its blocks any more. P drains its in-flight writes before it reports or tells D; D, giving up, sends
``Abort`` and waits for P's ``Ack`` (at most ``abort_grace_s``, then it closes the connection, which makes P
detach its endpoint) before it reports, so D never reuses blocks that P is still writing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from pd_connector import control
from pd_connector.layout import KVLayout
from pd_connector.protocol import Destinations
from pd_connector.transfer.context import EngineContext
from pd_connector.transfer.integrity import RegionBytes
from pd_connector.transfer.receiver import Receiver
from pd_connector.transfer.sender import Sender
from pd_connector.transfer.types import TransferConfig, TransferCounters, TransferResult, TransferState
from pd_connector.transport.base import HOST, MemoryType, Transport
from pd_connector.transport.host import advertised_host
from pd_connector.trust import PeerPolicy


class TransferEngine:
    """Moves KV blocks of individual requests from P to D over ``transport``, driven by the control plane.

    ``buffers``: the local KV buffers as ``(address, length_bytes)``, ordered as ``KVLayout.regions``
    expects, in ``memory`` (host, or CUDA for a transport that reaches it); the engine registers them with
    ``transport``. The engine owns ``transport`` from here on: it
    closes it in ``close`` or when construction fails (bad buffers, listener port taken, ``integrity_check``
    on a cache in device memory).
    """

    def __init__(
        self,
        config: TransferConfig,
        layout: KVLayout,
        buffers: Sequence[tuple[int, int]],
        transport: Transport,
        memory: MemoryType = HOST,
    ) -> None:
        self.config = config
        self.layout = layout
        try:
            policy = PeerPolicy(
                config.secret is not None, config.allowed_prefill_addrs, config.allow_insecure
            )
            if config.listen_port is not None:
                policy.check_listener("the side channel", config.listen_host)
            regions = layout.regions(buffers, memory)
            kv_bytes = RegionBytes(regions) if config.integrity_check else None
            descriptor = transport.register(regions)
        except BaseException:
            transport.close()
            raise
        self._ctx = EngineContext(config, layout, transport, policy, kv_bytes)
        self._sender = Sender(self._ctx)
        self._receiver = Receiver(self._ctx, descriptor)
        self._recv_ids: set[str] = set()  # expected and not yet polled; guarded by the context's lock
        self._closed = False
        self._server: asyncio.Server | None = None
        self._address: str | None = None
        if config.listen_port is not None:
            try:
                self._server = self._ctx.io.run(self._listen(), config.connect_timeout_s)
            except BaseException:
                self._ctx.io.stop()
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
        start_token: int = 0,
        prompt_hash: bytes = b"",
    ) -> None:
        """Ask P at ``prefill_addr`` to write the first ``num_tokens`` tokens of ``transfer_id`` into D's blocks.

        ``dst_blocks``: D block ids in token order, shared by every layer; or ``layer_dst_blocks``, one list
        per layer, for caches whose layers have different block tables (``dst_blocks`` is then ignored).
        ``start_token``: tokens D already has (a local prefix-cache hit; a multiple of the block size for
        heads-major layouts): P skips them, and the tables still start at token 0. ``prompt_hash``
        (``protocol.prompt_digest`` of D's prompt): P fails the transfer if its own prompt differs. Connects
        and handshakes with P if needed, then sends ``Destinations``. Ends in ``poll()`` as DONE (the blocks
        hold the KV) or FAILED/ABORTED within ``timeout_s`` (default ``config.load_timeout_s``) plus
        ``abort_grace_s``; P is told to stop writing before FAILED is reported, or its connection is closed.
        Raises ``ValueError`` at once if the peer policy forbids ``prefill_addr``, the tables cannot hold
        ``num_tokens`` or the id is in use.
        """
        refusal = self._ctx.policy.refusal(prefill_addr)
        if refusal is not None:
            raise ValueError(refusal)
        timeout = self.config.load_timeout_s if timeout_s is None else timeout_s
        if timeout <= 0 or num_tokens <= 0:
            raise ValueError(f"timeout_s and num_tokens must be positive, got {timeout}, {num_tokens}")
        if not 0 <= start_token < num_tokens or start_token % self.layout.granule_tokens:
            raise ValueError(
                f"start_token {start_token} must be in [0, {num_tokens}) and a multiple of "
                f"{self.layout.granule_tokens} (the layout's granule)"
            )
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
            start_token=start_token,
            prompt_hash=prompt_hash,
        )
        with self._ctx.lock:
            if transfer_id in self._recv_ids:
                raise ValueError(f"transfer {transfer_id} is already expected")
            self._recv_ids.add(transfer_id)
        self._post(self._receiver.expect, prefill_addr, dests, time.monotonic())

    # ---- sender side (P) ---------------------------------------------------------------------------------
    def offer(self, transfer_id: str, src_blocks: Sequence[int], prompt_hash: bytes = b"") -> None:
        """Declare (or extend, for chunked prefill) P's block table for ``transfer_id``, in token order.

        ``prompt_hash`` (``protocol.prompt_digest`` of P's prompt, first call) is compared with D's: when both
        are given and differ, the transfer fails before any byte is written.

        The first call starts the sender state (WAITING) and its lease: if no activity (destinations, push,
        landed write) happens for ``config.lease_s``, the transfer ends FAILED with
        ``lease_expired`` and its blocks are released. A later call passes the whole, longer table (the
        known prefix must not change).
        """
        self._post(
            self._sender.offer, transfer_id, [int(b) for b in src_blocks], time.monotonic(), prompt_hash
        )

    def push_layer(self, transfer_id: str, layer: int, start: int = 0, end: int | None = None) -> None:
        """Write ``layer``'s blocks at table positions ``[start, end)`` (None: to the table's end) to D.

        Called from ``save_kv_layer`` once the layer's KV is computed. When D's destinations are not known
        yet, the intent is recorded (not the data: P keeps its blocks until the transfer is reported) and
        executed when they arrive. Pushing a position twice (a block completed by the next chunk) is fine.
        """
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.layout.num_layers - 1}")
        self._post(self._sender.push, transfer_id, layer, start, end)

    def finish(self, transfer_id: str, first_token: int | None = None) -> None:
        """No more pushes: once every write landed, send ``Done`` (with the first sampled token, if any).

        The time from this call until the writes landed is the exposed transfer time. The transfer is
        reported DONE once every write landed and ``Done`` was sent (push model: P's blocks are free then),
        or FAILED when D dies, a write fails or the lease expires first.
        """
        self._post(self._sender.finish, transfer_id, first_token, time.monotonic())

    # ---- both sides --------------------------------------------------------------------------------------
    def abort(self, transfer_id: str, reason: str = "aborted by engine") -> None:
        """Abort a transfer on this side and tell the peer; unknown ids are ignored (idempotent).

        It is reported ABORTED once no write can touch its blocks any more (in-flight writes drained on P,
        P's ``Ack`` or a closed connection on D).
        """
        self._post(self._sender.abort, transfer_id, reason)
        self._post(self._receiver.abort, transfer_id, reason)

    def poll(self) -> list[TransferResult]:
        """Transfers that ended since the last call, each reported exactly once, then forgotten."""
        results = self._ctx.drain()
        with self._ctx.lock:
            self._recv_ids.difference_update(r.transfer_id for r in results if r.role == "recv")
        return results

    def wait(self, timeout_s: float) -> bool:
        """Block until ``poll`` has something to return (True) or ``timeout_s`` passed (False).

        For an adapter whose engine has nothing to compute but transfers in flight: it can wait here instead of
        sleeping a fixed time, so a transfer that ends is reported to the engine at once.
        """
        return self._ctx.wait_reported(timeout_s)

    def state(self, transfer_id: str) -> TransferState | None:
        """Current state of a transfer (terminal until reported by ``poll``), or None when unknown."""
        return (
            self._ctx.reported_state(transfer_id)
            or self._sender.state(transfer_id)
            or self._receiver.state(transfer_id)
        )

    def counters(self) -> TransferCounters:
        """A copy of the cumulative counters."""
        return self._ctx.counters()

    def table_sizes(self) -> dict[str, int]:
        """Number of entries in every internal table (tests assert they return to zero: no leaks)."""

        async def sizes() -> dict[str, int]:
            with self._ctx.lock:
                expected = len(self._recv_ids)
            return {
                **self._sender.sizes(),
                **self._receiver.sizes(),
                "unreported_results": self._ctx.unreported(),
                "expected_ids": expected,
            }

        return self._ctx.io.run(sizes(), self.config.connect_timeout_s)

    def close(self) -> None:
        """Fail every open transfer, close connections and the listener, close the transport (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ctx.io.run(self._shutdown(), self.config.connect_timeout_s + self.config.abort_grace_s)
        finally:
            self._ctx.io.stop()
            self._ctx.transport.close()

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        if self._closed:
            raise RuntimeError(f"transfer engine {self.config.engine_id} is closed")
        self._ctx.io.call_soon(fn, *args)

    # ---- I/O thread ----------------------------------------------------------------------------------------
    async def _listen(self) -> asyncio.Server:
        cfg = self._ctx.config
        server = await control.serve(
            cfg.listen_host,
            cfg.listen_port or 0,
            self._ctx.codec,
            cfg.heartbeat_interval_s,
            cfg.heartbeat_timeout_s,
            self._sender.serve_peer,
        )
        host, port = server.sockets[0].getsockname()[:2]
        host = advertised_host(host, cfg.advertise_host)
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return server

    async def _shutdown(self) -> None:
        self._sender.shutdown()
        self._receiver.shutdown()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
