"""Scheduler-side half of the PDConnector (runs in vLLM's EngineCore process, one instance per engine).

Decides per request what the connector does, from the request's ``kv_transfer_params``:
- P (``pd_role: prefill`` from our router, or vLLM's standard ``do_remote_decode: true``): follow every
  scheduled step of the prompt (every chunk under chunked prefill) and tell the worker which blocks each
  step writes; when the request finishes, keep its blocks (``request_finished -> True``) until the worker
  reports the transfer ended (every write landed and Done sent, failed, aborted, or lease expired).
- D (``pd_role: decode``, or ``do_remote_prefill: true`` with the params P returned): report the prompt's
  uncomputed tokens as external and asynchronous (``get_num_new_matched_tokens -> (n, True)``), so vLLM
  allocates the blocks and parks the request until the worker finished loading them. A load is attempted
  once; if it fails, vLLM's ``kv_load_failure_policy`` recomputes (or fails) the request.
Never raises on bad parameters (that would kill the engine): it logs and serves the request locally.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_connector.vllm.metadata import FinishedSend, PDConnectorMetadata, RecvSpec, SendSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under "vllm." so records go through the handlers vLLM configures in its processes.
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True)
class PrefillRole:
    transfer_id: str
    corrupt: bool = False


@dataclass(frozen=True)
class DecodeRole:
    transfer_id: str
    prefill_addr: str


def classify(request_id: str, params: dict[str, Any] | None) -> PrefillRole | DecodeRole | None:
    """What ``kv_transfer_params`` ask of this engine for a request (None: serve it locally)."""
    if not params:
        return None
    role = params.get("pd_role")
    transfer_id = params.get("pd_transfer_id")
    if role == "prefill" or (role is None and params.get("do_remote_decode")):
        return PrefillRole(
            str(transfer_id) if transfer_id else request_id, params.get("pd_test_corrupt") is True
        )
    if role == "decode" or (role is None and params.get("do_remote_prefill")):
        addr = params.get("pd_prefill_addr")
        if not transfer_id or not isinstance(addr, str) or ":" not in addr:
            logger.warning(
                "PDConnector: request %s has decode params without pd_transfer_id/pd_prefill_addr "
                "(%s); prefilling locally",
                request_id,
                params,
            )
            return None
        return DecodeRole(str(transfer_id), addr)
    if role is not None:
        logger.warning("PDConnector: request %s has unknown pd_role %r; serving locally", request_id, role)
    return None


def _prompt_len(request: Request) -> int:
    return len(request.prompt_token_ids or ())


class SchedulerSide:
    """Bookkeeping of transfers between scheduler steps; builds the worker's per-step metadata."""

    def __init__(self, block_size: int, side_channel_addr: str, allow_corruption: bool = False) -> None:
        self._block_size = block_size
        self._allow_corruption = allow_corruption
        self._side_channel_addr = side_channel_addr
        self._kv_cache_manager: KVCacheManager | None = None
        # P: requests whose prompt we push, by request id.
        self._sends: dict[str, tuple[Request, PrefillRole]] = {}
        # D: requests whose load was planned (never load twice), and those still loading.
        self._load_planned: set[str] = set()
        self._loading: set[str] = set()
        self._pending_recvs: list[RecvSpec] = []
        self._pending_finished: list[FinishedSend] = []
        self._pending_aborts: list[str] = []

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    # ---- vLLM scheduler hooks ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        role = classify(request.request_id, request.kv_transfer_params)
        if not isinstance(role, DecodeRole) or request.request_id in self._load_planned:
            return 0, False
        count = _prompt_len(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        role = classify(request.request_id, request.kv_transfer_params)
        if isinstance(role, PrefillRole):
            self._sends.setdefault(request.request_id, (request, role))
        elif isinstance(role, DecodeRole) and num_external_tokens > 0:
            if request.request_id in self._load_planned:
                return
            prompt_len = _prompt_len(request)
            local_tokens = prompt_len - num_external_tokens
            if local_tokens % self._block_size:
                logger.warning(
                    "PDConnector: %s has %d local tokens, not block aligned", request.request_id, local_tokens
                )
            self._load_planned.add(request.request_id)
            self._loading.add(request.request_id)
            self._pending_recvs.append(
                RecvSpec(
                    req_id=request.request_id,
                    transfer_id=role.transfer_id,
                    prefill_addr=role.prefill_addr,
                    block_ids=list(blocks.get_block_ids()[0]),
                    start_block=local_tokens // self._block_size,
                    num_tokens=prompt_len,
                )
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        sends: list[SendSpec] = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            tracked = self._sends.get(req_id)
            if tracked is None:
                continue
            request, role = tracked
            prompt_len = _prompt_len(request)
            # Called before vLLM advances num_computed_tokens: it is where this step starts.
            start = request.num_computed_tokens
            if start >= prompt_len:
                continue
            sends.append(
                SendSpec(
                    req_id=req_id,
                    transfer_id=role.transfer_id,
                    block_ids=list(self._block_ids(req_id)),
                    start_token=start,
                    end_token=min(start + num_tokens, prompt_len),
                    prompt_len=prompt_len,
                    corrupt=role.corrupt and self._allow_corruption,
                )
            )
        meta = PDConnectorMetadata(
            sends=sends,
            recvs=self._pending_recvs,
            finished_sends=self._pending_finished,
            aborted_recvs=self._pending_aborts,
            idle_step=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._pending_recvs, self._pending_finished, self._pending_aborts = [], [], []
        return meta

    def update_connector_output(self, finished_recving: set[str]) -> None:
        self._loading.difference_update(finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._load_planned.discard(req_id)
        if req_id in self._loading:
            # D aborted while loading: vLLM keeps the blocks until the worker reports the load finished.
            self._loading.discard(req_id)
            self._pending_aborts.append(req_id)
            return False, None
        tracked = self._sends.pop(req_id, None)
        if tracked is None:
            return False, None
        transfer_id = tracked[1].transfer_id
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        delay = bool(block_ids)
        self._pending_finished.append(FinishedSend(req_id=req_id, ok=ok, report=delay))
        if not ok:
            return delay, None
        # What a D needs to pull this prefill through vLLM's standard P-then-D flow.
        return delay, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "pd_transfer_id": transfer_id,
            "pd_prefill_addr": self._side_channel_addr,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }

    def has_pending_work(self) -> bool:
        return bool(self._pending_finished or self._pending_aborts or self._pending_recvs)

    def _block_ids(self, req_id: str) -> list[int]:
        if self._kv_cache_manager is None:
            raise RuntimeError("PDConnector: vLLM did not bind the KV cache manager")
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])
