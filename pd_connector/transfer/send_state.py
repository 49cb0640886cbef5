"""What the sender (P) keeps per decode peer and per transfer, and the check of a decode's destinations.

Plain records the ``Sender`` (``sender.py``) mutates on the transfer engine's I/O thread; nothing here runs
on its own. Split out so the sender module holds the state machine only.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pd_connector import control
from pd_connector.block_mapping import BlockMapping
from pd_connector.layout import KVLayout
from pd_connector.protocol import Abort, Checksums, Destinations
from pd_connector.timeline import Timeline
from pd_connector.transfer.types import TransferState


@dataclasses.dataclass(eq=False)
class Peer:
    """A decode side connected to our listener: its transport endpoint and block mapping."""

    conn: control.Connection
    peer_id: str
    engine_id: str
    mapping: BlockMapping


@dataclasses.dataclass(eq=False)
class Binding:
    """One D rank's destinations for a transfer and the progress of the writes into them."""

    peer: Peer
    dests: Destinations
    deadline: float  # loop time after which D no longer waits for these blocks
    inflight: int = 0
    #: Token spans whose writes landed, per layer (sorted, merged): Done only when none has a hole.
    covered: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    done: bool = False
    decode_aborted: bool = False  # this D asked to abort: answer Ack (not Abort) once drained
    # Copy runs per (first token, last token, layer or -1 when D's table is shared): every layer of a
    # push reuses them. The offered prefix never changes, so entries stay valid as the table grows.
    runs: dict[tuple[int, int, int], list[tuple[int, int, int]]] = dataclasses.field(default_factory=dict)
    #: Integrity mode: this D rank's checksums, hashed at ``finish`` while the last writes are still in flight
    #: (P's source is final then); None until then, or when the destinations came after ``finish``.
    checksums: Checksums | None = None


@dataclasses.dataclass(eq=False)
class Send:
    """Sender state of one transfer."""

    transfer_id: str
    src_blocks: list[int]
    started: float
    prompt_hash: bytes = b""
    state: TransferState = TransferState.WAITING
    bindings: list[Binding] = dataclasses.field(default_factory=list)
    fanout: int = 0  # D ranks to serve, from the first destinations (0: none came yet)
    #: Every push so far (layer, first block, end block): replayed to destinations that come later.
    pushes: list[tuple[int, int, int | None]] = dataclasses.field(default_factory=list)
    finished_at: float | None = None
    first_token: int | None = None
    bytes: int = 0
    exposed_s: float = 0.0
    ending: tuple[TransferState, str, bool] | None = None  # (final state, reason, lease expired)
    decode_aborted: bool = False  # a D gave up before binding: it was answered already
    timer: asyncio.TimerHandle | None = None
    timeline: Timeline = dataclasses.field(default_factory=Timeline)

    @property
    def inflight(self) -> int:
        return sum(b.inflight for b in self.bindings)

    def binding(self, peer: Peer) -> Binding | None:
        return next((b for b in self.bindings if b.peer is peer), None)


@dataclasses.dataclass(eq=False)
class Tombstone:
    """A transfer that ended before every D rank's destinations came: the Abort each late one gets."""

    abort: Abort
    timer: asyncio.TimerHandle
    left: int | None  # D ranks still to come (None: no destinations came, so the fan-out is unknown)


@dataclasses.dataclass(eq=False)
class Orphan:
    """Destinations that arrived before the adapter offered the transfer."""

    peer: Peer
    dests: Destinations
    timer: asyncio.TimerHandle


def validate_destinations(prefill: KVLayout, peer: Peer, dests: Destinations) -> str | None:
    """What is wrong with D's destinations for D's own layout and this P rank, or None."""
    d = peer.mapping.decode
    if dests.fanout < 1:
        return f"fanout {dests.fanout} must be at least 1"
    if dests.heads is None and prefill.heads != d.heads:
        return f"decode holds KV heads {d.heads}, prefill {prefill.heads}: the destinations need a head slice"
    if dests.heads is not None:
        sl = dests.heads
        if (
            sl.prefill_rank != prefill.tp_rank
            or sl.num_heads <= 0
            or not 0 <= sl.src_head <= prefill.num_kv_heads - sl.num_heads
            or not 0 <= sl.dst_head <= d.num_kv_heads - sl.num_heads
        ):
            return f"head slice {sl} does not fit prefill rank {prefill.tp_rank} and the decode's heads"
    tables = dests.layer_block_ids if dests.layer_block_ids is not None else [dests.block_ids]
    if dests.layer_block_ids is not None and len(tables) != d.num_layers:
        return f"{len(tables)} per-layer tables for {d.num_layers} layers"
    if dests.num_tokens <= 0 or dests.lease_s <= 0:
        return "num_tokens and lease_s must be positive"
    if not 0 <= dests.start_token < dests.num_tokens or dests.start_token % d.granule_tokens:
        return f"start_token {dests.start_token} is not a granule boundary below num_tokens"
    for table in tables:
        if len(table) * d.block_tokens < dests.num_tokens:
            return f"{len(table)} blocks cannot hold {dests.num_tokens} tokens"
    return None
