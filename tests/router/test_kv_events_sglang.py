"""SGLang's KV events feed the prefix index: the bytes a real SGLang 0.5.23 CPU server published
(``data/sglang_kv_events.msgpack``, made by ``data/capture_sglang_kv_events.py``: prompt A, then A + B, then
prompts that evict both, then a cache flush), and the event rules at their edges.

SGLang names each 1-token page by a chained SHA-256; the router regroups pages into its own blocks from
the token ids, so what the events say SGLang stored must match the hashes the router gives a prompt.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq

from pd_disagg.servers import free_port
from router import kv_events_sglang
from router.app import RouterState
from router.config import parse_config
from router.kv_events import WorkerEvents
from router.kv_events_common import Cleared, Event, Removed, Stored
from router.prefix_index import PrefixIndex
from tests.polling import wait_until_async

CAPTURE = Path(__file__).parent / "data" / "sglang_kv_events.msgpack"


class Capture(msgspec.Struct):
    sglang: str
    prompts: dict[str, list[int]]
    fillers: list[list[int]]
    messages: list[tuple[bytes, bytes, bytes]]  # topic, 8-byte sequence number, payload


@pytest.fixture(scope="module")
def capture() -> Capture:
    return msgspec.msgpack.decode(CAPTURE.read_bytes(), type=Capture)


def _replay(capture: Capture, events: WorkerEvents, start: int, stop: int) -> None:
    """Apply captured messages ``[start, stop)``: each is a batch, in sequence."""
    for _, seq, payload in capture.messages[start:stop]:
        assert events.apply(int.from_bytes(seq, "big"), payload) == "batch"


def _first(capture: Capture, found: Callable[[Event], bool]) -> int:
    """Index of the first captured message with an event for which ``found`` is true."""
    return next(
        i
        for i, (_, _, payload) in enumerate(capture.messages)
        if any(found(e) for e in kv_events_sglang.decode(payload))
    )


def test_the_capture_is_sglangs_whole_stream(capture: Capture) -> None:
    assert capture.sglang == "0.5.23"
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in capture.messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    decoded = [e for _, _, payload in capture.messages for e in kv_events_sglang.decode(payload)]
    stored = [e for e in decoded if isinstance(e, Stored)]
    # SGLang's pages are one token here; a node's consecutive pages come as one event
    assert {e.block_size for e in stored} == {1}
    assert [list(e.token_ids) for e in stored].count(capture.prompts["A"]) == 1
    assert any(isinstance(e, Removed) for e in decoded) and isinstance(decoded[-1], Cleared)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_what_sglang_stored_is_named_as_the_router_names_the_prompt(
    capture: Capture, block_size: int
) -> None:
    """A's page chain, and B's under A's last page (a child node), get the router's own hashes of A and of
    A + B whatever the router's block size; SGLang's evictions take them out, its flush empties the view."""
    a, b = capture.prompts["A"], capture.prompts["B"]
    index = PrefixIndex(block_size, 100_000, random.Random(0))
    events = WorkerEvents(index, "p0", "sglang")
    stored_a = _first(capture, lambda e: isinstance(e, Stored) and list(e.token_ids) == a)
    stored_b = _first(capture, lambda e: isinstance(e, Stored) and list(e.token_ids) == b)
    cleared = len(capture.messages) - 1
    _replay(capture, events, 0, stored_a + 1)
    assert index.match("p0", index.hashes(a)) == len(a) // block_size
    assert index.match("p0", index.hashes(a + b)) == len(a) // block_size
    _replay(capture, events, stored_a + 1, stored_b + 1)
    assert index.match("p0", index.hashes(a + b)) == (len(a) + len(b)) // block_size
    _replay(capture, events, stored_b + 1, cleared)
    assert index.match("p0", index.hashes(a)) == 0  # evicted by the fillers
    last = capture.fillers[-1]
    assert index.match("p0", index.hashes(last)) == len(last) // block_size
    _replay(capture, events, cleared, cleared + 1)
    assert index.blocks() == 0


def _batch(*events: dict[str, object]) -> bytes:
    """A batch as SGLang encodes it: ``[ts, [tagged maps], attn_dp_rank]``."""
    return msgspec.msgpack.encode([0.0, list(events), 0])


def _sg_stored(
    hashes: list[int], parent: int | None, tokens: list[object], **extra: object
) -> dict[str, object]:
    size = len(tokens) // len(hashes)
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        **extra,
    }


def test_pages_that_straddle_the_routers_blocks() -> None:
    """Pages of 2 tokens under router blocks of 3: a router block is named when the page holding its last
    token is stored, a child continues from mid-block, and evicting a page takes out the blocks it completed."""
    tokens = list(range(100, 112))
    index = PrefixIndex(3, 1000, random.Random(0))
    events = WorkerEvents(index, "p0", "sglang")
    assert events.apply(0, _batch(_sg_stored([1, 2, 3], None, tokens[:6]))) == "batch"
    assert index.match("p0", index.hashes(tokens)) == 2
    assert events.apply(1, _batch(_sg_stored([4, 5, 6], 3, tokens[6:]))) == "batch"
    assert index.match("p0", index.hashes(tokens)) == 4
    for seq, page, held in ((2, 6, 3), (3, 5, 2), (4, 4, 2)):  # page 5 (tokens 8-9) completed block 2 (6-8)
        events.apply(seq, _batch({"type": "BlockRemoved", "block_hashes": [page], "medium": "GPU"}))
        assert index.match("p0", index.hashes(tokens)) == held, page


def test_blocks_a_plain_prompt_cannot_reach_are_skipped() -> None:
    tokens = list(range(100, 108))
    index = PrefixIndex(4, 1000, random.Random(0))
    events = WorkerEvents(index, "p0", "sglang")
    skipped = [
        _sg_stored([1, 2], None, tokens, cache_salt="tenant-a"),  # namespaced by the salt
        _sg_stored([3, 4], None, tokens, lora_name="adapter"),  # another model's cache
        _sg_stored([5, 6], None, tokens, medium="CPU_PINNED"),  # the hierarchical cache's host tier
        _sg_stored([7, 8], None, [[t, t + 1] for t in tokens]),  # bigram pages (token pairs)
        _sg_stored([9, 10], 12345, tokens),  # a parent stored before the subscription
    ]
    assert events.apply(0, _batch(*skipped)) == "batch"
    assert index.blocks() == 0
    events.apply(1, _batch(_sg_stored([11, 12], None, tokens)))
    # the host tier dropping its copy leaves the device's
    events.apply(2, _batch({"type": "BlockRemoved", "block_hashes": [12], "medium": "CPU_PINNED"}))
    assert index.match("p0", index.hashes(tokens)) == 2


async def test_a_router_follows_an_sglang_workers_events_with_sglangs_decoder(
    capture: Capture, tokenizer_dir: Path
) -> None:
    """An SGLang prefill worker with ``kv_events`` set is followed with SGLang's decoder: the batch that
    stored A, as SGLang published it, puts A in the router's view of that worker."""
    a = capture.prompts["A"]
    stored_a = _first(capture, lambda e: isinstance(e, Stored) and list(e.token_ids) == a)
    topic, seq, payload = capture.messages[stored_a]
    port = free_port()
    ctx = zmq.Context()
    publisher = ctx.socket(zmq.PUB)
    publisher.bind(f"tcp://127.0.0.1:{port}")
    cfg = parse_config(
        {
            "flow": "sglang-bootstrap",
            "model": {"path": "m", "tokenizer": str(tokenizer_dir)},
            "policy": {"threshold_tokens": 0},
            "prefill": [
                {
                    "url": f"http://127.0.0.1:{free_port()}",
                    "engine": "sglang",
                    "bootstrap_port": free_port(),
                    "kv_events": f"tcp://127.0.0.1:{port}",
                }
            ],
            "decode": [{"url": f"http://127.0.0.1:{free_port()}", "engine": "sglang"}],
            "kv_routing": {"block_size": 16},
        }
    )
    state = RouterState(cfg, random.Random(0))
    await state.start()
    index, (p0,) = state.balancer.prefixes, state.balancer.prefill.workers
    assert index is not None
    try:

        async def stored() -> bool:
            # a SUB socket misses what is published before its subscription reaches the publisher: repeat
            # (each repeat has the same sequence number: a gap, so the view is cleared and A stored again)
            publisher.send_multipart([topic, seq, payload])
            await asyncio.sleep(0)
            return index.match(p0, index.hashes(a)) == len(a) // 16

        await wait_until_async(stored, 10, "A stored in the view of the SGLang worker")
    finally:
        await state.close()
        publisher.close(linger=0)
        ctx.term()
