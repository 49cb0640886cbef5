"""vLLM's KV events feed the prefix index: vLLM's own ZMQ publisher (``ZmqEventPublisher``, the one an engine
started with ``--kv-events-config`` runs) against the router's subscriber, and the event rules at their edges."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import msgspec
from aiohttp.test_utils import TestClient, TestServer
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from pd_disagg.servers import free_port
from router.app import STATE, RouterState, make_app
from router.config import parse_config
from router.kv_events import WorkerEvents
from router.prefix_index import PrefixIndex
from tests.polling import wait_until_async

BLOCK = 4
A = list(range(100, 108))  # two blocks
B = list(range(200, 204))  # a third block after A


def _stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], **extra: object) -> BlockStored:
    fields: dict = {"lora_id": None, "medium": "GPU", "lora_name": None} | extra
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK, **fields
    )


#: A block of 8 tokens from an engine whose block size is not the router's (``BLOCK``).
_OTHER_SIZE = BlockStored(
    block_hashes=[b"x5"],
    parent_block_hash=None,
    token_ids=A,
    block_size=8,
    lora_id=None,
    medium=None,
    lora_name=None,
)


def _payload(*events: object) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=list(events)))


async def test_vllms_publisher_stores_extends_removes_and_clears(tokenizer_dir: Path) -> None:
    """A router configured with a decode worker's ``kv_events`` endpoint follows that engine's publisher."""
    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    cfg = parse_config(
        {
            "model": {"path": "m", "tokenizer": str(tokenizer_dir)},
            "decode": [{"url": f"http://127.0.0.1:{free_port()}", "kv_events": f"tcp://127.0.0.1:{port}"}],
            "kv_routing": {"block_size": BLOCK},
        }
    )
    state = RouterState(cfg, random.Random(0))
    await state.start()
    index, (d0,) = state.balancer.prefixes, state.balancer.decode.workers
    assert index is not None
    try:
        first = _stored([b"e1", b"e2"], None, A)

        async def stored() -> bool:
            # a SUB socket misses what is published before its subscription reaches the publisher: repeat
            publisher.publish(KVEventBatch(ts=0.0, events=[first]))
            await asyncio.sleep(0)
            return index.match(d0, index.hashes(A)) == 2

        await wait_until_async(stored, 10, "the first blocks stored")
        publisher.publish(KVEventBatch(ts=1.0, events=[_stored([b"e3"], b"e2", B)]))

        async def extended() -> bool:
            return index.match(d0, index.hashes(A + B)) == 3

        await wait_until_async(extended, 10, "the child block stored under its parent")
        publisher.publish(KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[b"e3"], medium="GPU")]))

        async def removed() -> bool:
            return index.match(d0, index.hashes(A + B)) == 2

        await wait_until_async(removed, 10, "the evicted block removed")
        publisher.publish(KVEventBatch(ts=3.0, events=[AllBlocksCleared()]))

        async def cleared() -> bool:
            return index.blocks() == 0

        await wait_until_async(cleared, 10, "every block cleared")
        metrics = state.metrics.render().decode()
        # the repeats of the first batch were in sequence: no gap, nothing undecodable
        assert 'result="gap"' not in metrics and 'result="undecodable"' not in metrics
        assert f'pd_router_kv_event_batches_total{{result="batch",url="{d0.url}"}}' in metrics
    finally:
        await state.close()
        publisher.shutdown()


def test_the_engines_blocks_get_the_routing_historys_hashes() -> None:
    """What the history records for a prompt and what the events store for the same tokens coincide, so an
    eviction reported by the engine removes the block whichever source put it there."""
    index = PrefixIndex(BLOCK, 1000, random.Random(0))
    index.record("d0", index.hashes(A + B))
    events = WorkerEvents(index, "d0")
    assert events.apply(0, _payload(_stored([b"e1", b"e2"], None, A))) == "batch"
    assert index.blocks() == 3
    assert events.apply(1, _payload(BlockRemoved(block_hashes=[b"e2"], medium="GPU"))) == "batch"
    assert index.match("d0", index.hashes(A + B)) == 1  # prefix-closed search: the gap at block 2 ends it


def test_blocks_the_router_cannot_name_are_skipped() -> None:
    index = PrefixIndex(BLOCK, 1000, random.Random(0))
    events = WorkerEvents(index, "d0")
    skipped = [
        _stored([b"x1"], b"unknown-parent", B),  # its parent was stored before we subscribed
        _stored([b"x2"], None, B, lora_id=1, lora_name="adapter"),  # another model's cache
        _stored([b"x3"], None, B, medium="CPU"),  # an offloading tier
        _stored([b"x4"], None, B, extra_keys=[("mm", "image-hash", 0)]),  # keyed by more than tokens
        _stored([b"x6"], None, A),  # a block size (4) the token ids (8) do not fill
    ]
    for seq, event in enumerate(skipped):
        assert events.apply(seq, _payload(event)) == "batch"
    assert index.blocks() == 0
    assert (
        events.apply(len(skipped), _payload(BlockRemoved(block_hashes=[b"never-stored"], medium=None)))
        == "batch"
    )


def test_an_engine_of_another_block_size_is_regrouped_into_the_routers_blocks() -> None:
    """vLLM blocks of 8 tokens under a router of 4: each names two router blocks, the hashes the history gives
    the same tokens, and its eviction takes both out."""
    index = PrefixIndex(BLOCK, 1000, random.Random(0))
    events = WorkerEvents(index, "d0")
    assert events.apply(0, _payload(_OTHER_SIZE)) == "batch"
    assert index.match("d0", index.hashes(A)) == 2 and index.blocks() == 2
    assert events.apply(1, _payload(BlockRemoved(block_hashes=[b"x5"], medium="GPU"))) == "batch"
    assert index.blocks() == 0


def test_an_offloading_tiers_removal_leaves_the_device_copy() -> None:
    index = PrefixIndex(BLOCK, 1000, random.Random(0))
    events = WorkerEvents(index, "d0")
    events.apply(0, _payload(_stored([b"e1", b"e2"], None, A)))
    events.apply(1, _payload(BlockRemoved(block_hashes=[b"e2"], medium="CPU")))
    assert index.match("d0", index.hashes(A)) == 2


def test_a_sequence_gap_clears_the_view_and_garbage_is_ignored() -> None:
    index = PrefixIndex(BLOCK, 1000, random.Random(0))
    events = WorkerEvents(index, "d0")
    assert events.apply(5, _payload(_stored([b"e1", b"e2"], None, A))) == "batch"
    assert events.apply(6, b"\x93not msgpack of a batch") == "undecodable"
    assert index.blocks() == 2  # ignored, view kept
    assert events.apply(8, _payload(_stored([b"e9"], None, B))) == "gap"  # 7 was lost: maybe a removal
    assert index.match("d0", index.hashes(A)) == 0 and index.match("d0", index.hashes(B)) == 1


def test_an_event_kind_the_router_does_not_know_is_skipped_not_the_batch() -> None:
    index = PrefixIndex(BLOCK, 1000, random.Random(0))
    future = {"type": "BlockMovedToTier", "block_hashes": [b"e1"], "tier": "disk"}
    known = msgspec.to_builtins(_stored([b"e1", b"e2"], None, A), builtin_types=(bytes,))
    payload = msgspec.msgpack.encode([0.0, [future, known], 0])
    assert WorkerEvents(index, "d0").apply(0, payload) == "batch"
    assert index.match("d0", index.hashes(A)) == 2


async def test_a_worker_added_through_the_admin_api_is_followed_until_removed(tokenizer_dir: Path) -> None:
    """Workers added at run time (an autoscaler, an operator) get their KV events followed like configured
    ones; removing one stops its subscription and drops what its events put in the index."""
    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    cfg = parse_config(
        {
            "model": {"path": "m", "tokenizer": str(tokenizer_dir)},
            "decode": [{"url": f"http://127.0.0.1:{free_port()}"}],
            "kv_routing": {"block_size": BLOCK},
        }
    )
    client = TestClient(TestServer(make_app(cfg, random.Random(0))))
    await client.start_server()
    state = client.app[STATE]
    index = state.balancer.prefixes
    assert index is not None and state.kv_events == {}
    try:
        added = {"url": f"http://127.0.0.1:{free_port()}", "kv_events": f"tcp://127.0.0.1:{port}"}
        assert (await client.post("/admin/workers", json={"role": "decode", "worker": added})).status == 201
        (worker,) = [w for w in state.balancer.decode.workers if w.url == added["url"]]
        assert set(state.kv_events) == {worker}

        async def stored() -> bool:
            publisher.publish(KVEventBatch(ts=0.0, events=[_stored([b"e1", b"e2"], None, A)]))
            await asyncio.sleep(0)
            return index.match(worker, index.hashes(A)) == 2

        await wait_until_async(stored, 10, "the added worker's blocks stored")
        ref = {"role": "decode", "url": added["url"]}
        assert (await client.delete("/admin/workers", json=ref)).status == 200
        assert state.kv_events == {} and index.blocks() == 0
    finally:
        await client.close()
        publisher.shutdown()
