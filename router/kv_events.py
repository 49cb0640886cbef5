"""vLLM's KV cache events as the source of a worker's entry in the prefix index, where the engine publishes them.

A vLLM server started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'`` publishes, after each engine step, a batch of events on a ZMQ PUB socket: a
multipart message ``(topic, 8-byte big-endian sequence number, msgpack payload)`` whose payload is an
``EventBatch`` (an array ``[ts, events, data_parallel_rank]``) of tagged maps: ``BlockStored`` (the hashes of
full blocks now cached, their parent's hash and their token ids), ``BlockRemoved`` (hashes evicted) and
``AllBlocksCleared`` (vllm/distributed/kv_events.py). The Structs below decode that format (the router does
not import vLLM); fields they do not name are ignored.

One ``KvEventsSubscriber`` per worker whose ``kv_events`` endpoint is configured runs in the router's event
loop (started and stopped by ``app.RouterState``). The engine's block hashes are its own (sha256 or xxhash
with a per-process seed); the router re-derives its own chained hash from each stored block's token ids and
its parent's router hash, and keeps the engine-to-router map to apply removals. A block stored by the engine
gets the very hash the routing history gives the same tokens, so both sources feed one view: the history
records a prompt at once (before the engine has even run it), the events add what the history cannot know (the
answers' blocks) and take out what the engine evicted, whichever source put it there. A gap in the sequence
numbers (messages dropped at ZMQ's high-water mark, a restarted engine) may have lost removals: that worker's
view is cleared and rebuilt from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from router.prefix_index import PrefixIndex

log = logging.getLogger("router.kv_events")

BlockHash = int | bytes


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    # A LoRA's blocks are another model's cache: the router routes base-model prompts, so they are skipped.
    lora_id: int | None = None
    lora_name: str | None = None
    # Blocks keyed by more than their tokens (multimodal inputs, cache salt): their tokens alone do not name them.
    extra_keys: list[Any] | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    # Each event decoded on its own (``_event``), so an event kind this router does not know (a newer vLLM's)
    # is skipped, not the batch.
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared
_batch = msgspec.msgpack.Decoder(EventBatch)
_event = msgspec.msgpack.Decoder(Event)


class WorkerEvents:
    """Applies one worker's event batches to the index (pure: no sockets, so tests drive it directly)."""

    def __init__(self, index: PrefixIndex, worker: Any) -> None:
        self._index = index
        self._worker = worker
        self._router_hash: dict[BlockHash, int] = {}  # engine block hash -> the router's
        self._next_seq: int | None = None
        self._warned_size = False

    def apply(self, seq: int, payload: bytes) -> str:
        """Apply one message; returns what it was: ``batch``, ``gap`` (applied after clearing the view) or
        ``undecodable`` (ignored)."""
        try:
            batch = _batch.decode(payload)
        except msgspec.DecodeError as e:
            log.warning("undecodable KV event batch from %s: %s", self._worker, e)
            return "undecodable"
        result = "batch"
        if self._next_seq is not None and seq != self._next_seq:
            self.clear()
            result = "gap"
        self._next_seq = seq + 1
        for raw in batch.events:
            try:
                event = _event.decode(raw)
            except msgspec.DecodeError:
                continue  # an event kind (or shape) this router does not know
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    ours = self._router_hash.pop(h, None)
                    if ours is not None:
                        self._index.remove(self._worker, ours)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
        return result

    def _stored(self, event: BlockStored) -> None:
        if event.lora_id is not None or event.lora_name is not None or event.medium not in (None, "GPU"):
            return
        if event.extra_keys and any(k is not None for k in event.extra_keys):
            return
        size = self._index.block_size
        if event.block_size != size:
            if not self._warned_size:  # once per worker: every batch of such a worker would say it again
                self._warned_size = True
                log.warning(
                    "KV events of %s are ignored: its blocks hold %d tokens, kv_routing.block_size is %d "
                    "(set it to the engines' block size)",
                    self._worker,
                    event.block_size,
                    size,
                )
            return  # the chains would not line up
        if len(event.token_ids) != size * len(event.block_hashes):
            return
        if event.parent_block_hash is None:
            parent = self._index.root
        else:
            found = self._router_hash.get(event.parent_block_hash)
            if found is None:
                return  # its parent was stored before we subscribed: this chain cannot be named
            parent = found
        chain = []
        for i, engine_hash in enumerate(event.block_hashes):
            parent = hash((parent, *event.token_ids[i * size : (i + 1) * size]))
            self._router_hash[engine_hash] = parent
            chain.append(parent)
        self._index.record(self._worker, chain)

    def clear(self) -> None:
        self._router_hash.clear()
        self._index.forget(self._worker)


class KvEventsSubscriber:
    """Subscribes to one worker's publisher (``connect``: ZMQ reconnects by itself while the engine restarts)
    and applies every message; ``on_result`` gets what each one was, for the metrics."""

    def __init__(
        self, endpoint: str, events: WorkerEvents, on_result: Callable[[str], None], ctx: zmq.asyncio.Context
    ) -> None:
        self._endpoint = endpoint
        self._events = events
        self._on_result = on_result
        self._ctx = ctx
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self._endpoint)
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._on_result("undecodable")
                    continue
                self._on_result(self._events.apply(int.from_bytes(frames[1], "big"), frames[2]))
        finally:
            sock.close(linger=0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
