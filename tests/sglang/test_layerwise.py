"""Unit tests of P's layer-wise push planning and its fallback (``pd_connector.sglang.layerwise``), without
SGLang: the page ranges of a forward pass, the pusher driving a recording stand-in of the transfer engine's P
side (``offer``/``push_layer``, the calls ``TransferEngine`` takes), and the two hooks on stand-ins of SGLang's
scheduler and KV pool. Real SGLang servers: integration_tests/test_sglang.py ``test_layer_by_layer_push``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from pd_connector.sglang import compat, layerwise
from pd_connector.sglang.compat import ForwardRequest
from pd_connector.sglang.layerwise import CHUNK, COMPUTED, FORWARD, LayerPusher, forward_pages, merge_pages

LAYERS = 3
ROOM = 7


class Engine:
    """Records what the pusher asks of the transfer engine (P side)."""

    def __init__(self) -> None:
        self.offers: dict[str, list[int]] = {}
        self.pushes: list[tuple[str, int, int, int | None]] = []

    def offer(self, transfer_id: str, src_blocks: Sequence[int], prompt_hash: bytes = b"") -> None:
        self.offers[transfer_id] = list(src_blocks)

    def push_layer(self, transfer_id: str, layer: int, start: int = 0, end: int | None = None) -> None:
        self.pushes.append((transfer_id, layer, start, end))


def pusher(
    engine: Engine, counts: list[tuple[str, int]] | None = None, *, layerwise: bool = True, **faults: Any
) -> LayerPusher:
    """A pusher with room ``ROOM`` open; ``counts`` collects its ``(when, layer)`` counts."""

    def count(when: str, layer: int) -> None:
        if counts is not None:
            counts.append((when, layer))

    made = LayerPusher(engine, LAYERS, layerwise=layerwise, count=count, **faults)
    made.open(ROOM)
    return made


def request(
    prefix: int, end: int, total: int = 10, room: int = ROOM, lead: int | None = None
) -> ForwardRequest:
    """Room ``room`` computes tokens ``[prefix, end)`` of a ``total``-token prompt; page ``i`` is ``100 + i``."""
    pages = [100 + i for i in range(end)]
    return ForwardRequest(room, prefix, end, total, pages=pages, lead=room if lead is None else lead)


def layers(start: int, stop: int, room: int = ROOM) -> list[tuple[str, int, int, int | None]]:
    return [(f"sgl-{room}", layer, start, stop) for layer in range(LAYERS)]


def test_forward_pages_split_computed_and_new_pages():
    # a first chunk of 8 tokens in pages of 4: both pages are written by this forward
    assert forward_pages(pushed=0, prefix_tokens=0, end_tokens=8, input_tokens=10, page_size=4) == (0, 0, 2)
    # a chunk ending inside a page leaves that page to the next forward (as SGLang's _send_kv_chunk)
    assert forward_pages(pushed=0, prefix_tokens=0, end_tokens=6, input_tokens=10, page_size=4) == (0, 0, 1)
    # the next forward completes that page; the page of the prompt's last token is left to the chunk send
    assert forward_pages(pushed=1, prefix_tokens=6, end_tokens=10, input_tokens=10, page_size=4) == (1, 1, 2)
    # a cached prefix of 8 tokens: its 2 pages are complete before the forward
    assert forward_pages(pushed=0, prefix_tokens=8, end_tokens=10, input_tokens=10, page_size=4) == (0, 2, 2)
    assert forward_pages(pushed=0, prefix_tokens=4, end_tokens=10, input_tokens=10, page_size=2) == (0, 2, 4)
    # a last chunk of one token (page size 1): nothing per layer, the chunk send takes it
    assert forward_pages(pushed=240, prefix_tokens=240, end_tokens=241, input_tokens=241, page_size=1) == (
        240,
        240,
        240,
    )
    # nothing new (pushed past what the forward completes)
    assert forward_pages(pushed=3, prefix_tokens=8, end_tokens=10, input_tokens=10, page_size=4) == (3, 3, 3)


def test_merge_pages_only_grows_the_table():
    table = [1, 2]
    merge_pages(table, [2, 3, 4], at=1)
    assert table == [1, 2, 3, 4]
    merge_pages(table, [1, 2], at=0)
    assert table == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="gap"):
        merge_pages(table, [9], at=5)
    with pytest.raises(ValueError, match="differ"):
        merge_pages(table, [1, 9], at=0)


def test_each_layer_is_pushed_as_it_is_written_and_the_chunk_send_adds_nothing():
    engine, counts = Engine(), list[tuple[str, int]]()
    p = pusher(engine, counts)
    plan, failed = p.plan([request(prefix=0, end=4)], page_size=1)
    assert plan is not None and not failed
    assert engine.offers["sgl-7"] == [100, 101, 102, 103] and engine.pushes == []
    for layer in range(LAYERS):
        plan.layer_written(layer)
        assert engine.pushes[-1] == ("sgl-7", layer, 0, 4)  # pushed at once, not after the forward
    p.forward_ended(plan)
    p.add_chunk(ROOM, [100, 101, 102, 103], 0, 4)  # SGLang's per-chunk send of the same pages
    assert engine.pushes == layers(0, 4)
    assert counts == [(FORWARD, layer) for layer in range(LAYERS)]
    # the last chunk: its pages per layer, but for the page of the prompt's last token ...
    plan, _ = p.plan([request(prefix=4, end=10)], page_size=1)
    assert plan is not None and plan.ranges == {ROOM: (4, 9)}
    for layer in range(LAYERS):
        plan.layer_written(layer)
    p.forward_ended(plan)
    # ... which goes with SGLang's send, from the page SGLang kept (here: swapped for a cached copy, 555)
    p.add_chunk(ROOM, [100 + i for i in range(4, 9)] + [555], 4, 10)
    assert engine.pushes == layers(0, 4) + layers(4, 9) + layers(9, 10)
    assert engine.offers["sgl-7"][-1] == 555
    assert counts == [(w, layer) for w in (FORWARD, FORWARD, CHUNK) for layer in range(LAYERS)]
    assert p.layerwise


def test_cached_prefix_is_pushed_at_plan_time():
    engine, counts = Engine(), list[tuple[str, int]]()
    p = pusher(engine, counts)
    plan, _ = p.plan([request(prefix=4, end=10)], page_size=2)
    assert engine.pushes == layers(0, 2)  # the prefix's two pages, before any layer is written
    assert plan is not None and plan.ranges == {ROOM: (2, 4)}  # the forward's pages but the last token's
    assert counts == [(COMPUTED, layer) for layer in range(LAYERS)]


def test_without_layer_events_the_pusher_falls_back_to_chunks_and_says_so_once(caplog):
    engine, counts = Engine(), list[tuple[str, int]]()
    p = pusher(engine, counts)
    plan, _ = p.plan([request(prefix=0, end=4)], page_size=1)
    assert plan is not None
    with caplog.at_level(logging.WARNING, logger=layerwise.__name__):
        p.forward_ended(plan)  # the forward wrote no layer through the hooked method
    assert engine.pushes == layers(0, 4)  # pushed after the forward instead
    assert [r.message for r in caplog.records if "per chunk" in r.message] != []
    assert not p.layerwise
    assert p.plan([request(prefix=4, end=10)], page_size=1) == (None, {})
    p.add_chunk(ROOM, [100 + i for i in range(10)], 4, 10)
    assert engine.pushes[LAYERS:] == layers(4, 10)
    assert counts == [(CHUNK, layer) for layer in range(LAYERS)] * 2
    assert len([r for r in caplog.records if "per chunk" in r.message]) == 1


def test_a_layer_without_event_is_pushed_after_the_forward():
    engine = Engine()
    p = pusher(engine)
    plan, _ = p.plan([request(prefix=0, end=4)], page_size=1)
    assert plan is not None
    plan.layer_written(0)
    plan.layer_written(2)
    p.forward_ended(plan)
    assert sorted(engine.pushes) == layers(0, 4)
    assert p.layerwise  # some layers came through the hook: stay layer-wise


def test_per_chunk_mode_pushes_every_layer_of_each_chunk():
    engine = Engine()
    p = pusher(engine, layerwise=False)
    assert p.plan([request(prefix=0, end=4)], page_size=1) == (None, {})
    p.add_chunk(ROOM, [100, 101, 102, 103], 0, 4)
    p.add_chunk(ROOM, [104, 105], 4, 6)
    assert engine.pushes == layers(0, 4) + layers(4, 6)
    assert engine.offers["sgl-7"] == [100, 101, 102, 103, 104, 105]
    with pytest.raises(ValueError):
        p.add_chunk(ROOM, [999], 6, 8)  # a chunk that ends past the pages it brings


def test_requests_computing_the_same_tokens_push_only_their_computed_pages():
    engine = Engine()
    p = pusher(engine)
    p.open(8)
    twins = [request(prefix=2, end=6, lead=1), request(prefix=2, end=6, room=8, lead=1)]
    assert p.plan(twins, page_size=1) == (None, {})  # SGLang may swap either one's new pages: none go now
    assert sorted(engine.pushes) == sorted(layers(0, 2) + layers(0, 2, room=8))
    p.add_chunk(ROOM, [100, 101, 777, 778, 779, 780], 0, 6)  # after the swap
    assert engine.pushes[-LAYERS:] == layers(2, 6)


def test_a_sent_page_that_differs_from_an_offered_one_fails():
    engine = Engine()
    p = pusher(engine)
    p.plan([request(prefix=0, end=4)], page_size=1)
    with pytest.raises(ValueError, match="differ"):
        p.add_chunk(ROOM, [100, 999, 102, 103], 0, 4)


def test_rooms_not_opened_are_not_planned_and_bad_pages_fail_the_room():
    engine = Engine()
    p = pusher(engine)
    other = request(prefix=0, end=4, room=99)
    assert p.plan([other], page_size=1) == (None, {})
    p.add_chunk(ROOM, [5, 6], 0, 2)  # the table already holds pages 5, 6
    plan, failed = p.plan([request(prefix=0, end=4)], page_size=1)  # ... but the request says 100, 101
    assert plan is None and isinstance(failed[ROOM], ValueError)


def test_fault_injection_skips_the_last_layer_and_sends_wrong_pages():
    engine, counts = Engine(), list[tuple[str, int]]()
    p = pusher(engine, counts, skip_layer_rooms=frozenset({ROOM}), wrong_kv_rooms=frozenset({ROOM}))
    plan, _ = p.plan([request(prefix=0, end=3)], page_size=1)
    assert plan is not None
    for layer in range(LAYERS):
        plan.layer_written(layer)
    assert engine.pushes == layers(0, 3)[:-1]  # the last layer never goes ...
    assert counts == [(FORWARD, layer) for layer in range(LAYERS)]  # ... but counts as pushed
    assert engine.offers["sgl-7"] == [100, 100, 100]


class Manager:
    """Stands in for ``PdKVManager`` on a prefill scheduler: plans through a real ``LayerPusher``."""

    def __init__(self, engine: Engine) -> None:
        self.pusher = pusher(engine)

    def plan_forward(self, scheduler: Any, batch: Any) -> Any:
        plan, _ = self.pusher.plan(batch, page_size=1)
        return None if plan is None else (plan, self.pusher)


def test_hooks_push_each_layer_during_run_batch_only():
    engine = Engine()
    scheduler = SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=Manager(engine)))
    pool = SimpleNamespace(start_layer=0)
    seen: list[int] = []

    def run_batch(sched: Any, batch: Any) -> str:  # SGLang's forward: one KV write per layer
        for layer in range(LAYERS):
            layerwise.set_kv_buffer_hook(None, pool, SimpleNamespace(layer_id=layer), "loc", "k", "v")
            seen.append(len(engine.pushes))
        return "result"

    assert layerwise.run_batch_hook(run_batch, scheduler, [request(prefix=0, end=4)]) == "result"
    assert seen == [1, 2, 3] and engine.pushes == layers(0, 4)
    layerwise.set_kv_buffer_hook(None, pool, SimpleNamespace(layer_id=0), "loc", "k", "v")  # no forward
    assert len(engine.pushes) == LAYERS


def test_hooks_leave_other_servers_and_failed_plans_alone():
    calls = []

    def run_batch(sched: Any, batch: Any) -> str:
        calls.append(batch)
        return "ran"

    decode = SimpleNamespace(disagg_prefill_bootstrap_queue=None)
    other_backend = SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=object()))
    broken = SimpleNamespace(
        disagg_prefill_bootstrap_queue=SimpleNamespace(
            kv_manager=SimpleNamespace(plan_forward=lambda s, b: 1 / 0)
        )
    )
    for scheduler in (decode, other_backend, broken):
        assert layerwise.run_batch_hook(run_batch, scheduler, "batch") == "ran"
    assert calls == ["batch"] * 3


def test_written_layer_reads_the_override_and_the_pool_offset():
    layer = SimpleNamespace(layer_id=5)
    pool = SimpleNamespace(start_layer=4)
    assert compat.written_layer(pool, layer, ("loc", "k", "v"), {}) == 1
    assert compat.written_layer(pool, layer, ("loc", "k", "v"), {"layer_id_override": 6}) == 2
    assert compat.written_layer(pool, layer, ("loc", "k", "v", None, None, 7), {}) == 3
