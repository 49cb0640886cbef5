"""The transfer engine: one per engine worker process, both sender (P) and receiver (D) roles.

Threading: every public method is thread-safe and returns at once (adapters call them from scheduler and
worker threads, including from inside the forward pass). Work is posted to a dedicated I/O thread running
an asyncio loop, which owns all per-transfer state, the control connections and the transport callbacks;
results come back through ``poll()``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_connector.layout import KVLayout
from pd_connector.transfer.types import TransferConfig, TransferCounters, TransferResult, TransferState
from pd_connector.transport.base import Transport


class TransferEngine:
    """Moves KV blocks of individual requests from P to D over ``transport``, driven by the control plane.

    ``buffers``: the local KV buffers as ``(address, length_bytes)``, ordered as ``KVLayout.regions``
    expects; the engine registers them with ``transport`` (and deregisters in ``close``).
    """

    def __init__(
        self,
        config: TransferConfig,
        layout: KVLayout,
        buffers: Sequence[tuple[int, int]],
        transport: Transport,
    ) -> None:
        raise NotImplementedError

    @property
    def address(self) -> str | None:
        """``host:port`` of the side-channel listener (what D passes as ``prefill_addr``), or None."""
        raise NotImplementedError

    # ---- receiver side (D) -------------------------------------------------------------------------------
    def expect(
        self,
        transfer_id: str,
        prefill_addr: str,
        dst_blocks: Sequence[int] | Sequence[Sequence[int]],
        num_tokens: int,
        timeout_s: float | None = None,
    ) -> None:
        """Ask P at ``prefill_addr`` to write the first ``num_tokens`` tokens of ``transfer_id`` into D's blocks.

        ``dst_blocks``: D block ids in token order, shared by every layer, or one list per layer. Connects
        and handshakes with P if needed, then sends ``Destinations``. Ends in ``poll()`` as DONE (the blocks
        hold the KV) or FAILED/ABORTED within ``timeout_s`` (default ``config.load_timeout_s``) plus
        ``abort_grace_s``; P is told to stop writing before FAILED is reported, or its connection is closed.
        Raises ``ValueError`` at once if the tables cannot hold ``num_tokens`` or the id is in use.
        """
        raise NotImplementedError

    # ---- sender side (P) ---------------------------------------------------------------------------------
    def offer(self, transfer_id: str, src_blocks: Sequence[int]) -> None:
        """Declare (or extend, for chunked prefill) P's block table for ``transfer_id``, in token order.

        The first call starts the sender state (WAITING) and its lease: if D's destinations do not arrive
        within ``config.lease_s`` of the last activity, the transfer ends FAILED with ``lease_expired``.
        A later call passes the whole, longer table (the known prefix must not change).
        """
        raise NotImplementedError

    def push_layer(self, transfer_id: str, layer: int, start: int = 0, end: int | None = None) -> None:
        """Write ``layer``'s blocks at table positions ``[start, end)`` (None: to the table's end) to D.

        Called from ``save_kv_layer`` once the layer's KV is computed. When D's destinations are not known
        yet, the intent is recorded (not the data: P keeps its blocks until the transfer is reported) and
        executed when they arrive. Pushing a position twice (a block completed by the next chunk) is fine.
        """
        raise NotImplementedError

    def finish(self, transfer_id: str, first_token: int | None = None) -> None:
        """No more pushes: once every write landed, send ``Done`` (with the first sampled token, if any).

        The time from this call until the writes landed is the exposed transfer time. The transfer is
        reported DONE after D's ``Ack`` (or FAILED when D dies or the lease expires first).
        """
        raise NotImplementedError

    # ---- both sides --------------------------------------------------------------------------------------
    def abort(self, transfer_id: str, reason: str = "aborted by engine") -> None:
        """Abort a transfer on this side and tell the peer; unknown ids are ignored (idempotent).

        It is reported ABORTED once no write can touch its blocks any more (in-flight writes drained on P,
        P's ``Ack`` or a closed connection on D).
        """
        raise NotImplementedError

    def poll(self) -> list[TransferResult]:
        """Transfers that ended since the last call, each reported exactly once, then forgotten."""
        raise NotImplementedError

    def state(self, transfer_id: str) -> TransferState | None:
        """Current state of a transfer (terminal until reported by ``poll``), or None when unknown."""
        raise NotImplementedError

    def counters(self) -> TransferCounters:
        """A copy of the cumulative counters."""
        raise NotImplementedError

    def table_sizes(self) -> dict[str, int]:
        """Number of entries in every internal table (tests assert they return to zero: no leaks)."""
        raise NotImplementedError

    def close(self) -> None:
        """Fail every open transfer, close connections and the listener, deregister memory (idempotent)."""
        raise NotImplementedError
