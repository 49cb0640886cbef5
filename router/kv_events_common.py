"""What the router takes from an engine's KV cache events, whatever the engine: the shared framing and the
engine-neutral events that ``kv_events.WorkerEvents`` applies to the prefix index.

vLLM and SGLang publish the same wire shape (each engine's decoder is its own module: ``kv_events_vllm``,
``kv_events_sglang``): a ZMQ multipart message ``(topic, 8-byte big-endian sequence number, payload)`` whose
msgpack payload is an array ``[ts, events, rank]`` of tagged maps (``{"type": "BlockStored", ...}``). What
differs is which fields each engine adds and what they mean for the router (vLLM's ``extra_keys``, SGLang's
``cache_salt``, the storage tiers' names, the block hashes' meaning), so each engine module decodes its own
Structs and says which stored blocks a prompt's tokens alone name, turning them into the events below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

#: An engine's name for a block (vLLM: bytes or int, SGLang: int64); opaque to the router.
BlockHash = int | bytes


class Stored(msgspec.Struct, frozen=True):
    """Consecutive blocks the engine now caches: ``block_hashes[i]`` holds ``token_ids[i * block_size :
    (i + 1) * block_size]`` and extends ``parent`` (the block before the first; None: the prompt's start)."""

    block_hashes: Sequence[BlockHash]
    parent: BlockHash | None
    token_ids: Sequence[int]
    block_size: int


class Removed(msgspec.Struct, frozen=True):
    block_hashes: Sequence[BlockHash]


class Cleared(msgspec.Struct, frozen=True):
    pass


Event = Stored | Removed | Cleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    # Each event decoded on its own, so an event kind this router does not know (a newer engine's) is
    # skipped, not the batch.
    events: list[msgspec.Raw]
    rank: int | None = None


class StoredFields(msgspec.Struct):
    """The fields of a ``BlockStored`` event both engines send (each engine's Struct adds its own)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    # A LoRA's blocks are another model's cache: the router routes base-model prompts, so they are skipped.
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    """Both engines' eviction event (the fields the router reads)."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


_batch = msgspec.msgpack.Decoder(EventBatch)
S = TypeVar("S", bound=StoredFields)


def decoder(stored: type[S], convert: Callable[[S], Stored | None]) -> Callable[[bytes], list[Event]]:
    """An engine's batch decoder: ``stored`` is its ``BlockStored`` Struct, ``convert`` turns one into what
    the router keeps (None: blocks a plain prompt's tokens cannot reach). The decoder returns a batch's
    events in order, raises ``msgspec.DecodeError`` when the payload is no batch, and skips an event that
    does not decode (an unknown kind or shape: a newer engine's)."""
    kinds: Any = stored | BlockRemoved | AllBlocksCleared
    event: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(kinds)

    def decode(payload: bytes) -> list[Event]:
        found: list[Event] = []
        for raw in _batch.decode(payload).events:
            try:
                decoded = event.decode(raw)
            except msgspec.DecodeError:
                continue
            if isinstance(decoded, BlockRemoved):
                if device_tier(decoded.medium):
                    found.append(Removed(decoded.block_hashes))
            elif isinstance(decoded, AllBlocksCleared):
                found.append(Cleared())
            elif (kept := convert(decoded)) is not None:
                found.append(kept)
        return found

    return decode


def device_tier(medium: str | None) -> bool:
    """Whether an event is about the engine's own device cache (``GPU``, or unnamed), not an offloading tier
    (host memory, disk): a prompt is served from the former, and a removal from a lower tier leaves the
    device's copy where it was."""
    return medium in (None, "GPU")
