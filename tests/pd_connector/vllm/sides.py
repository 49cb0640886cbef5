"""Fakes of what vLLM hands PDConnector's scheduler side (requests, block lists, the KV cache manager, a
step's output) and a side built over them: shared by the scheduler-side and seeding tests (no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import RequestStatus

from pd_connector.trust import PeerPolicy
from pd_connector.vllm.scheduler_side import DecodeRole, PrefillRole, SchedulerSide

BS = 32
ADDR = "10.0.0.1:7000"
VOCAB = 5000  # above the prompts' and tokens' ids below
MAX_LEN = 2048  # the model's context length


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.RUNNING
    output_token_ids: list[int] = field(default_factory=list)


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


def make_side(**kwargs: Any) -> tuple[SchedulerSide, FakeManager]:
    """A kv_both side whose peers prove a shared secret (so it may dial ADDR), unless ``kwargs`` say else."""
    side = SchedulerSide(BS, ADDR, VOCAB, MAX_LEN, **{"policy": PeerPolicy(authenticated=True), **kwargs})
    manager = FakeManager()
    side.bind_kv_cache_manager(manager)  # type: ignore[arg-type]
    return side, manager


def refused(side: SchedulerSide) -> int:
    stats = side.stats()
    return 0 if stats is None else int(stats.data["refused_requests"])


def classify(params: Any, req_id: str = "r", **kwargs: Any) -> PrefillRole | DecodeRole | None:
    side, _ = make_side(**kwargs)
    return side.classify(FakeRequest(req_id, params, [1, 2, 3]))  # type: ignore[arg-type]
