"""Scheduler-side bookkeeping of PDConnector with fake vLLM requests (no engine)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from vllm.v1.request import RequestStatus

from pd_connector.protocol import prompt_digest
from pd_connector.trust import PeerPolicy
from pd_connector.vllm import scheduler_side
from pd_connector.vllm.metadata import FinishedSend, RecvSpec, SendSpec
from pd_connector.vllm.scheduler_side import DecodeRole, PrefillRole, SchedulerSide
from tests.pd_connector.vllm.sides import (
    ADDR,
    BS,
    MAX_LEN,
    VOCAB,
    FakeBlocks,
    FakeManager,
    FakeOutput,
    FakeRequest,
    classify,
    decode_params,
    make_side,
    refused,
)


def test_classify_roles() -> None:
    assert classify(None) is None
    assert classify({}) is None
    assert classify({"pd_role": "prefill", "pd_transfer_id": "T"}) == PrefillRole("T")
    assert classify({"do_remote_decode": True}) == PrefillRole("r")
    assert classify(decode_params("T")) == DecodeRole("T", ADDR)
    std = {"do_remote_prefill": True, "pd_transfer_id": "T", "pd_prefill_addr": ADDR, "remote_host": "x"}
    assert classify(std) == DecodeRole("T", ADDR)


@pytest.mark.parametrize(
    "params",
    [
        {"pd_role": "decode", "pd_transfer_id": "T"},  # no address
        {"pd_role": "decode", "pd_transfer_id": "T", "pd_prefill_addr": "no-port"},
        {"pd_role": "decode", "pd_transfer_id": ["T"], "pd_prefill_addr": ADDR},
        {"pd_role": "decode", "pd_transfer_id": "x" * 500, "pd_prefill_addr": ADDR},
        {"pd_role": "middle"},
        {"pd_role": "prefill"},  # no transfer id
        {"do_remote_prefill": True},
        "do_remote_decode",
        [1, 2],
    ],
)
def test_bad_params_are_served_locally_and_counted(params: Any) -> None:
    """Never an exception inside the engine: the request prefills locally and the refusal is counted."""
    side, _ = make_side()
    assert side.classify(FakeRequest("r", params, [1, 2, 3])) is None  # type: ignore[arg-type]
    assert refused(side) == 1


def test_roles_the_engine_does_not_play_are_refused() -> None:
    """A consumer-only D never holds blocks for a send (a client's do_remote_decode would leak them), and a
    producer-only P never plans a load (it would crash its worker)."""
    for prefill in ({"do_remote_decode": True}, {"pd_role": "prefill", "pd_transfer_id": "T"}):
        side, _ = make_side(producer=False)
        req = FakeRequest("d1", prefill, list(range(40)))
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
        side.update_state_after_alloc(req, FakeBlocks([1, 2]), 0)  # type: ignore[arg-type]
        assert side.build_connector_meta(FakeOutput({"d1": 40})).sends == []  # type: ignore[arg-type]
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert side.request_finished(req, [1, 2]) == (False, None), "blocks freed at once"  # type: ignore[arg-type]
        assert refused(side) == 1
    side, _ = make_side(consumer=False)
    req = FakeRequest("p1", decode_params(), list(range(40)))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    assert side.build_connector_meta(FakeOutput({})).recvs == []  # type: ignore[arg-type]
    assert refused(side) == 1


def test_prefill_addresses_follow_the_peer_policy() -> None:
    """Without a secret D dials loopback only; an allow-list narrows what it dials either way."""
    remote = {"pd_role": "decode", "pd_transfer_id": "T", "pd_prefill_addr": "10.9.9.9:7600"}
    local = {**remote, "pd_prefill_addr": "127.0.0.1:7600"}
    open_policy = PeerPolicy(authenticated=False)
    assert classify(remote, policy=open_policy) is None
    assert classify(local, policy=open_policy) == DecodeRole("T", "127.0.0.1:7600")
    listed = PeerPolicy(authenticated=True, allowed_prefill_addrs=("10.9.0.0/16:7600",))
    assert classify(remote, policy=listed) == DecodeRole("T", "10.9.9.9:7600")
    assert classify({**remote, "pd_prefill_addr": "10.9.9.9:22"}, policy=listed) is None
    assert classify(local, policy=listed) is None


def test_a_transfer_id_serves_one_request_ever() -> None:
    """n > 1 children and prompt lists share their parent's params: the first transfers, the rest are served
    locally, also once the first finished (its transfer may still hold P's blocks, or be over)."""
    for params in ({"pd_role": "prefill", "pd_transfer_id": "T"}, decode_params("T")):
        side, _ = make_side()
        first, second = (FakeRequest(r, params, list(range(40))) for r in ("0_r", "1_r"))
        assert side.classify(first) is not None  # type: ignore[arg-type]
        assert side.classify(second) is None  # type: ignore[arg-type]
        first.status = second.status = RequestStatus.FINISHED_LENGTH_CAPPED
        side.request_finished(second, [])  # type: ignore[arg-type]
        side.request_finished(first, [])  # type: ignore[arg-type]
        assert side.classify(FakeRequest("2_r", params, [1])) is None  # type: ignore[arg-type]
        assert refused(side) == 2


def test_used_ids_are_forgotten_past_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_side, "USED_IDS_KEPT", 3)
    side, _ = make_side()

    def take(req_id: str, tid: str) -> PrefillRole | DecodeRole | None:
        return side.classify(FakeRequest(req_id, {"pd_role": "prefill", "pd_transfer_id": tid}, [1]))  # type: ignore[arg-type]

    assert all(take(f"r{i}", f"t{i}") is not None for i in range(5))
    assert take("again0", "t0") is not None, "t0 was forgotten"
    assert take("again4", "t4") is None


def test_decode_reports_async_external_tokens_once() -> None:
    side, _ = make_side()
    req = FakeRequest("d1", decode_params(), list(range(100)))
    assert side.get_num_new_matched_tokens(req, 0) == (100, True)  # type: ignore[arg-type]
    assert side.get_num_new_matched_tokens(req, 0) == (100, True), "side-effect free before alloc"
    side.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8]), 100)  # type: ignore[arg-type]
    meta = side.build_connector_meta(FakeOutput({}))  # type: ignore[arg-type]
    digest = prompt_digest(list(range(100)))
    assert meta.recvs == [RecvSpec("d1", "t1", ADDR, [5, 6, 7, 8], 0, 100, prompt_hash=digest)]
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
    side.update_connector_output({"d1"}, {})
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
    assert [(s.start_token, s.end_token, s.prompt_len) for s in specs] == [
        (0, 64, 150),
        (64, 128, 150),
        (128, 150, 150),
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


def test_a_block_split_by_chunks_is_pushed_once() -> None:
    """Concurrent prefills get chunks that end inside a block: each push stops at the last whole block, the
    next starts there, and the step that completes the prompt pushes the partial last block."""
    side, manager = make_side()
    req = FakeRequest("p1", {"pd_role": "prefill", "pd_transfer_id": "T"}, list(range(100)))
    side.update_state_after_alloc(req, FakeBlocks([]), 0)  # type: ignore[arg-type]
    manager.blocks["p1"] = [1, 2, 3, 4]
    spans = []
    for computed, scheduled in ((0, 20), (20, 30), (50, 40), (90, 10)):
        req.num_computed_tokens = computed
        sends = side.build_connector_meta(FakeOutput({"p1": scheduled})).sends  # type: ignore[arg-type]
        spans += [(s.start_token, s.end_token) for s in sends]
    assert spans == [(0, 32), (32, 64), (64, 100)]


def test_prefill_pushes_its_own_prefix_cache_hit_too() -> None:
    """P's scheduler starts a request at its local prefix-cache hit; D may not hold those tokens, so the
    first push starts at token 0 (the transfer engine sends what D asked for)."""
    side, manager = make_side()
    req = FakeRequest("p1", {"pd_role": "prefill", "pd_transfer_id": "T"}, list(range(150)))
    side.update_state_after_alloc(req, FakeBlocks([]), 0)  # type: ignore[arg-type]
    manager.blocks["p1"] = [9, 8, 7, 6, 5]
    req.num_computed_tokens = 128  # four blocks came from P's prefix cache
    (spec,) = side.build_connector_meta(FakeOutput({"p1": 22})).sends  # type: ignore[arg-type]
    assert (spec.start_token, spec.end_token, spec.prompt_len) == (0, 150, 150)


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
        side = SchedulerSide(BS, ADDR, VOCAB, MAX_LEN, allow_corruption=allowed)
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
