"""Scheduler-side bookkeeping of PDConnector with fake vLLM requests (no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from vllm.v1.request import RequestStatus

from pd_connector.vllm.metadata import FinishedSend, RecvSpec, SendSpec
from pd_connector.vllm.scheduler_side import DecodeRole, PrefillRole, SchedulerSide, classify

pytestmark = pytest.mark.unit

BS = 32
ADDR = "10.0.0.1:7000"


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.RUNNING


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class FakeManager:
    blocks: dict[str, list[int]] = field(default_factory=dict)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


@dataclass
class FakeOutput:
    num_scheduled_tokens: dict[str, int]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def decode_params(transfer_id: str = "t1") -> dict[str, Any]:
    return {"pd_transfer_id": transfer_id, "pd_role": "decode", "pd_prefill_addr": ADDR}


def make_side() -> tuple[SchedulerSide, FakeManager]:
    side = SchedulerSide(BS, ADDR)
    manager = FakeManager()
    side.bind_kv_cache_manager(manager)  # type: ignore[arg-type]
    return side, manager


def test_classify_roles_and_bad_params() -> None:
    assert classify("r", None) is None
    assert classify("r", {"pd_role": "prefill", "pd_transfer_id": "T"}) == PrefillRole("T")
    assert classify("r", {"do_remote_decode": True}) == PrefillRole("r")
    assert classify("r", decode_params("T")) == DecodeRole("T", ADDR)
    std = {"do_remote_prefill": True, "pd_transfer_id": "T", "pd_prefill_addr": ADDR}
    assert classify("r", std) == DecodeRole("T", ADDR)
    # Missing address or unknown role: served locally, never an exception inside the engine.
    assert classify("r", {"pd_role": "decode", "pd_transfer_id": "T"}) is None
    assert classify("r", {"pd_role": "middle"}) is None
    assert classify("r", {"do_remote_prefill": True}) is None


def test_decode_reports_async_external_tokens_once() -> None:
    side, _ = make_side()
    req = FakeRequest("d1", decode_params(), list(range(100)))
    assert side.get_num_new_matched_tokens(req, 0) == (100, True)  # type: ignore[arg-type]
    assert side.get_num_new_matched_tokens(req, 0) == (100, True), "side-effect free before alloc"
    side.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8]), 100)  # type: ignore[arg-type]
    meta = side.build_connector_meta(FakeOutput({}))  # type: ignore[arg-type]
    assert meta.recvs == [RecvSpec("d1", "t1", ADDR, [5, 6, 7, 8], start_block=0, num_tokens=100)]
    # A failed load is recomputed by vLLM: the connector must not try to load again.
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    assert side.build_connector_meta(FakeOutput({})).recvs == []  # type: ignore[arg-type]


def test_decode_with_local_prefix_hit_loads_only_the_tail() -> None:
    side, _ = make_side()
    req = FakeRequest("d1", decode_params(), list(range(100)))
    assert side.get_num_new_matched_tokens(req, 64) == (36, True)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks([1, 2, 9, 10]), 36)  # type: ignore[arg-type]
    (spec,) = side.build_connector_meta(FakeOutput({})).recvs  # type: ignore[arg-type]
    assert (spec.start_block, spec.block_ids, spec.num_tokens) == (2, [1, 2, 9, 10], 100)


def test_decode_abort_while_loading_tells_the_worker() -> None:
    side, _ = make_side()
    req = FakeRequest("d1", decode_params(), list(range(40)))
    side.update_state_after_alloc(req, FakeBlocks([3, 4]), 40)  # type: ignore[arg-type]
    side.build_connector_meta(FakeOutput({}))  # type: ignore[arg-type]
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req, [3, 4]) == (False, None)  # type: ignore[arg-type]
    assert side.build_connector_meta(FakeOutput({})).aborted_recvs == ["d1"]  # type: ignore[arg-type]


def test_decode_finished_load_needs_no_abort() -> None:
    side, _ = make_side()
    req = FakeRequest("d1", decode_params(), list(range(40)))
    side.update_state_after_alloc(req, FakeBlocks([3, 4]), 40)  # type: ignore[arg-type]
    side.build_connector_meta(FakeOutput({}))  # type: ignore[arg-type]
    side.update_connector_output({"d1"})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.request_finished(req, [3, 4]) == (False, None)  # type: ignore[arg-type]
    assert side.build_connector_meta(FakeOutput({})).aborted_recvs == []  # type: ignore[arg-type]


def test_prefill_follows_every_chunk_and_keeps_blocks_until_released() -> None:
    side, manager = make_side()
    req = FakeRequest("p1", {"pd_role": "prefill", "pd_transfer_id": "T"}, list(range(150)))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks([]), 0)  # type: ignore[arg-type]
    specs: list[SendSpec] = []
    for step_blocks, computed, scheduled in (
        ([0, 1], 0, 64),
        ([0, 1, 2, 3], 64, 64),
        ([0, 1, 2, 3, 4], 128, 64),
    ):
        manager.blocks["p1"] = step_blocks
        req.num_computed_tokens = computed
        (spec,) = side.build_connector_meta(FakeOutput({"p1": scheduled, "other": 5})).sends  # type: ignore[arg-type]
        specs.append(spec)
    assert [(s.start_token, s.end_token, s.completes_prompt) for s in specs] == [
        (0, 64, False),
        (64, 128, False),
        (128, 150, True),
    ]
    assert specs[-1].block_ids == [0, 1, 2, 3, 4] and specs[-1].transfer_id == "T"
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = side.request_finished(req, [0, 1, 2, 3, 4])  # type: ignore[arg-type]
    assert delay is True
    assert params is not None and params["pd_prefill_addr"] == ADDR and params["pd_transfer_id"] == "T"
    assert params["do_remote_prefill"] is True
    meta = side.build_connector_meta(FakeOutput({}))  # type: ignore[arg-type]
    assert meta.finished_sends == [FinishedSend("p1", ok=True, report=True)]
    assert side.build_connector_meta(FakeOutput({})).finished_sends == []  # type: ignore[arg-type]


def test_prefill_abort_is_reported_not_ok() -> None:
    side, manager = make_side()
    req = FakeRequest("p1", {"do_remote_decode": True}, list(range(50)))
    side.update_state_after_alloc(req, FakeBlocks([]), 0)  # type: ignore[arg-type]
    manager.blocks["p1"] = [7, 8]
    (spec,) = side.build_connector_meta(FakeOutput({"p1": 50})).sends  # type: ignore[arg-type]
    assert spec.transfer_id == "p1", "standard flow: the request id names the transfer"
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req, [7, 8]) == (True, None)  # type: ignore[arg-type]
    assert side.build_connector_meta(FakeOutput({})).finished_sends == [  # type: ignore[arg-type]
        FinishedSend("p1", ok=False, report=True)
    ]


def test_prefill_without_blocks_frees_at_once() -> None:
    side, _ = make_side()
    req = FakeRequest("p1", {"pd_role": "prefill", "pd_transfer_id": "T"}, list(range(50)))
    side.update_state_after_alloc(req, FakeBlocks([]), 0)  # type: ignore[arg-type]
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req, []) == (False, None)  # type: ignore[arg-type]
    assert side.build_connector_meta(FakeOutput({})).finished_sends == [  # type: ignore[arg-type]
        FinishedSend("p1", ok=False, report=False)
    ]


def test_corruption_needs_the_server_flag() -> None:
    for allowed in (False, True):
        side = SchedulerSide(BS, ADDR, allow_corruption=allowed)
        manager = FakeManager({"p1": [1]})
        side.bind_kv_cache_manager(manager)  # type: ignore[arg-type]
        params = {"pd_role": "prefill", "pd_transfer_id": "T", "pd_test_corrupt": True}
        req = FakeRequest("p1", params, list(range(10)))
        side.update_state_after_alloc(req, FakeBlocks([]), 0)  # type: ignore[arg-type]
        (spec,) = side.build_connector_meta(FakeOutput({"p1": 10})).sends  # type: ignore[arg-type]
        assert spec.corrupt is allowed


def test_specs_survive_msgspec() -> None:
    spec = SendSpec("p1", "T", [1, 2], 0, 40, 40)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=SendSpec) == spec
    recv = RecvSpec("d1", "T", ADDR, [3], 0, 10)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(recv), type=RecvSpec) == recv


def test_idle_steps_are_marked() -> None:
    """The worker throttles vLLM's busy loop only on steps that compute nothing."""
    side, manager = make_side()
    manager.blocks["p1"] = [1]
    assert side.build_connector_meta(FakeOutput({})).idle_step is True  # type: ignore[arg-type]
    assert side.build_connector_meta(FakeOutput({"x": 3})).idle_step is False  # type: ignore[arg-type]
