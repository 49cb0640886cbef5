"""vLLM's KV cache events (``vllm/distributed/kv_events.py``), decoded without importing vLLM.

A vLLM server started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'`` publishes, after each engine step, ``BlockStored`` (the hashes of full blocks
now cached, their parent's hash and their token ids), ``BlockRemoved`` (hashes evicted) and
``AllBlocksCleared``. Block hashes are vLLM's own (sha256 or xxhash with a per-process seed), chained over
the blocks as vLLM hashes them; the router never recomputes them (``kv_events.WorkerEvents``). Fields these
Structs do not name are ignored.
"""

from __future__ import annotations

from typing import Any

from router.kv_events_common import Stored, StoredFields, decoder, device_tier


class BlockStored(StoredFields, tag=True):
    # Blocks keyed by more than their tokens (multimodal inputs, cache salt): their tokens alone do not name them.
    extra_keys: list[Any] | None = None


def _stored(event: BlockStored) -> Stored | None:
    if event.lora_id is not None or event.lora_name is not None or not device_tier(event.medium):
        return None
    if event.extra_keys and any(k is not None for k in event.extra_keys):
        return None
    return Stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)


#: One published batch's events (raises ``msgspec.DecodeError`` when it is no batch).
decode = decoder(BlockStored, _stored)
