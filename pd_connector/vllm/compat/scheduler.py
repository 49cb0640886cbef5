"""The vLLM scheduler's private queues, token budget and request fields that ``SLOScheduler`` reads and sets.

Part of ``pd_connector.vllm.compat``. ``scheduler_plugins.vllm.SLOScheduler`` (``--scheduler-cls``, EngineCore)
calls ``require_scheduler`` once after vLLM's ``Scheduler.__init__``, then these accessors every step; none of
these fields is promised by vLLM, so the plugin never touches them itself.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from pd_connector.engine_symbols import has_path, missing
from pd_connector.vllm.compat.versions import SCHEDULER_FIELDS, SCHEDULER_SYMBOLS, raise_missing

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request


def require_scheduler(scheduler: Scheduler) -> None:
    """``SLOScheduler`` start-up check, after vLLM's ``Scheduler.__init__`` set its fields: raise naming every
    class symbol (``SCHEDULER_SYMBOLS``) and instance field (``SCHEDULER_FIELDS``) this vLLM lacks."""
    absent = missing(SCHEDULER_SYMBOLS)
    absent += [f"Scheduler.{field}" for field in SCHEDULER_FIELDS if not has_path(scheduler, field)]
    if absent:
        raise_missing("scheduler_plugins.vllm.SLOScheduler", absent)


def uses_fcfs(scheduler: Scheduler) -> bool:
    """Whether the scheduler's queues are FCFS (``--scheduling-policy fcfs``): then ``waiting`` is a deque
    that ``reorder_waiting`` may refill."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    return scheduler.policy is SchedulingPolicy.FCFS


def chunked_prefill_enabled(scheduler: Scheduler) -> bool:
    """Whether chunked prefill is on (the colocated/decode modes cap each step's prefill share with it)."""
    return bool(scheduler.scheduler_config.enable_chunked_prefill)


def privatize_scheduler_config(scheduler: Scheduler) -> int:
    """Give the scheduler its own shallow copy of the scheduler config, so the per-step
    ``long_prefill_token_threshold`` does not leak into the config other components share; returns the
    user's threshold (0: none)."""
    scheduler.scheduler_config = copy.copy(scheduler.scheduler_config)
    return int(scheduler.scheduler_config.long_prefill_token_threshold)


def token_budget(scheduler: Scheduler) -> int:
    """The step's token budget vLLM's ``schedule()`` reads (``max_num_scheduled_tokens``)."""
    return int(scheduler.max_num_scheduled_tokens)


def set_token_budget(scheduler: Scheduler, budget: int, long_prefill_threshold: int) -> None:
    """Set the next step's token budget and the longest chunk one prefill may take (on the private config
    copy: call ``privatize_scheduler_config`` first)."""
    scheduler.max_num_scheduled_tokens = budget
    scheduler.scheduler_config.long_prefill_token_threshold = long_prefill_threshold


def block_size(scheduler: Scheduler) -> int:
    """The KV cache block size in tokens (chunks are aligned to it)."""
    return int(scheduler.block_size)


def running(scheduler: Scheduler) -> list[Request]:
    """The running requests, in the order ``schedule()`` serves them (vLLM's list, not a copy)."""
    return scheduler.running


def set_running_order(scheduler: Scheduler, requests: list[Request]) -> None:
    """Reorder the running list in place (same requests, new order) before ``schedule()`` reads it."""
    scheduler.running[:] = requests


def waiting(scheduler: Scheduler) -> list[Request]:
    """The waiting queue's requests, in serving order (a copy)."""
    return list(scheduler.waiting)


def reorder_waiting(scheduler: Scheduler, requests: list[Request]) -> None:
    """Refill the waiting queue in the given order (the same requests). Needs a deque-backed queue (FCFS)."""
    scheduler.waiting.clear()  # type: ignore[attr-defined]
    scheduler.waiting.extend(requests)  # type: ignore[attr-defined]


def waiting_with_kv(scheduler: Scheduler) -> list[Request]:
    """Waiting requests, those already holding KV blocks (``kv_holding_waiting``) first."""
    return [*scheduler.kv_holding_waiting, *scheduler.waiting]


def scheduled_request(scheduler: Scheduler, request_id: str) -> Request | None:
    """The scheduler's request of that id, or None once it left."""
    return scheduler.requests.get(request_id)


def computed_tokens(request: Request) -> int:
    """Tokens of the request whose KV is computed (or loaded) so far."""
    return request.num_computed_tokens


def arrival_time(request: Request) -> float:
    """When the request arrived (``time.time()`` seconds): the start of its TTFT deadline."""
    return request.arrival_time


def extra_args(request: Request) -> dict[str, Any] | None:
    """The request's ``SamplingParams.extra_args`` (per-request SLO targets), None when it has none."""
    return request.sampling_params.extra_args if request.sampling_params else None


def output_tokens(request: Request) -> int:
    """Tokens the request has produced so far."""
    return request.num_output_tokens


def max_tokens(request: Request) -> int:
    """The most tokens the request may produce (vLLM sets it from ``SamplingParams.max_tokens``)."""
    return request.max_tokens


def pending_tokens(request: Request) -> int:
    """Tokens the request still needs computed (speculative ones and output placeholders included)."""
    return request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens


def is_decode(request: Request) -> bool:
    """A running request that only needs its next token (plus speculative ones): not a prefill chunk."""
    return request.num_computed_tokens >= request.num_tokens - 1


def is_remote_kv(request: Request) -> bool:
    """A request whose prompt KV comes from a prefill node (loading, or asked to load on admission)."""
    from vllm.v1.request import RequestStatus

    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        return True
    params = request.kv_transfer_params
    return bool(params and params.get("do_remote_prefill"))
