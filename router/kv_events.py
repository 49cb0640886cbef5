"""Engines' KV cache events as a source of a worker's entry in the prefix index, where the engine publishes them.

A worker whose ``kv_events`` endpoint is configured gets one ``KvEventsSubscriber`` in the router's event loop
(started and stopped by ``app.RouterState``), decoding with its engine's module (``kv_events_vllm``,
``kv_events_sglang``: the worker's ``engine`` decides) into the engine-neutral events of
``kv_events_common``, which ``WorkerEvents`` applies to the index.

The engines' block hashes are their own (vLLM: sha256 or xxhash with a per-process seed; SGLang: a chained
SHA-256 over its pages) and their blocks need not be the router's (SGLang's pages are 1 token on CPU; a
vLLM may run another block size than ``kv_routing.block_size``). So the router re-derives its own chained
hashes from the token ids: it follows each engine block's place in the token stream (the router hash of
the last whole router block before its end, and the tokens after it) and names a router block when the
engine block holding its last token is stored; it keeps this per engine block, to continue from it as a
parent and to take out the router blocks it completed when the engine evicts it. A block stored by the
engine so gets the very hash the routing history gives the same tokens, and both sources feed one view: the
history records a prompt at once (before the engine has even run it), the events add what the history
cannot know (the answers' blocks, prompts other routers sent) and take out what the engine evicted,
whichever source put it there. A gap in the sequence numbers (messages dropped at ZMQ's high-water mark, a
restarted engine) may have lost removals: that worker's view is cleared and rebuilt from then on.

The per-worker map holds one entry per engine block the engine caches, so its size follows the engine's
cache, which the engine's own evictions bound. Measured here (2026-12-02, 512-token events, router blocks of
16): SGLang's 1-token pages cost ~170 bytes and ~1 us (decoding included) per cached token; 16-token blocks
~24 bytes and ~0.1 us per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from array import array
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import msgspec
import zmq
import zmq.asyncio

from router import kv_events_sglang, kv_events_vllm
from router.kv_events_common import BlockHash, Cleared, Event, Removed, Stored
from router.prefix_index import PrefixIndex

log = logging.getLogger("router.kv_events")

Decode = Callable[[bytes], list[Event]]
#: Each engine's event decoder, by ``WorkerConfig.engine``.
DECODERS: Mapping[str, Decode] = {"vllm": kv_events_vllm.decode, "sglang": kv_events_sglang.decode}


class _Run(NamedTuple):
    """One stored event's engine blocks on the router's block grid. Each engine block is kept as ``(run, i)``
    (a pair per engine block: with SGLang's 1-token pages there is one per cached token), and its place is
    computed from the run when it is needed: as a parent, or evicted."""

    base: int  # router hash of the last whole router block before the run (the index's root at the start)
    # The tokens after that block: the parent's partial block, then the event's (empty when every engine
    # block ends on the router's grid: no block has a tail to continue from).
    tokens: array[int]
    start: int  # how many of ``tokens`` are the parent's
    size: int  # tokens per engine block
    blocks: tuple[int, ...]  # router hashes of the whole router blocks in ``tokens``, in order


class WorkerEvents:
    """Applies one worker's event batches to the index (pure: no sockets, so tests drive it directly)."""

    def __init__(self, index: PrefixIndex, worker: Any, engine: str = "vllm") -> None:
        self._index = index
        self._worker = worker
        self._decode = DECODERS[engine]
        self._places: dict[BlockHash, tuple[_Run, int]] = {}  # engine block hash -> (its run, index)
        self._next_seq: int | None = None

    def apply(self, seq: int, payload: bytes) -> str:
        """Apply one message; returns what it was: ``batch``, ``gap`` (applied after clearing the view) or
        ``undecodable`` (ignored)."""
        try:
            events = self._decode(payload)
        except msgspec.DecodeError as e:
            log.warning("undecodable KV event batch from %s: %s", self._worker, e)
            return "undecodable"
        result = "batch"
        if self._next_seq is not None and seq != self._next_seq:
            self.clear()
            result = "gap"
        self._next_seq = seq + 1
        for event in events:
            if isinstance(event, Stored):
                self._stored(event)
            elif isinstance(event, Removed):
                for h in event.block_hashes:
                    place = self._places.pop(h, None)
                    for ours in self._completed(*place) if place is not None else ():
                        self._index.remove(self._worker, ours)
            elif isinstance(event, Cleared):
                self.clear()
        return result

    def _stored(self, event: Stored) -> None:
        size, n = event.block_size, len(event.block_hashes)
        if size <= 0 or len(event.token_ids) != size * n:
            return
        tail: tuple[int, ...] = ()
        if event.parent is None:
            base = self._index.root
        else:
            found = self._places.get(event.parent)
            if found is None:
                return  # its parent was stored before we subscribed: this chain cannot be named
            base, tail = self._end(*found)
        ours = self._index.block_size
        stream = (*tail, *event.token_ids)
        blocks = []
        parent = base
        for k in range(len(stream) // ours):
            parent = hash((parent, *stream[k * ours : (k + 1) * ours]))
            blocks.append(parent)
        # Kept for the blocks' tails: none when every block ends on the router's grid (vLLM, same block size).
        on_grid = not tail and size % ours == 0
        try:
            tokens = array("q", () if on_grid else stream)
        except OverflowError:
            return  # not token ids
        run = _Run(base, tokens, len(tail), size, tuple(blocks))
        self._places.update(zip(event.block_hashes, [(run, i) for i in range(n)], strict=True))
        self._index.record(self._worker, blocks)

    def _end(self, run: _Run, i: int) -> tuple[int, tuple[int, ...]]:
        """Where engine block ``i`` of ``run`` ends: the router hash of the last whole router block up to its
        end, and the tokens after that block."""
        end = run.start + (i + 1) * run.size
        whole = end // self._index.block_size
        base = run.blocks[whole - 1] if whole else run.base
        return base, tuple(run.tokens[whole * self._index.block_size : end])

    def _completed(self, run: _Run, i: int) -> tuple[int, ...]:
        """The router blocks whose last token is in engine block ``i`` of ``run``."""
        ours = self._index.block_size
        return run.blocks[(run.start + i * run.size) // ours : (run.start + (i + 1) * run.size) // ours]

    def clear(self) -> None:
        self._places.clear()
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
