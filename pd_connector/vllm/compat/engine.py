"""Where PDConnector hooks into vLLM's engine beyond the connector API: factory registration, the
shared-memory queues' busy poll, first-token seeding and streaming, failing one request's load, scheduling an
ended load without the idle pause.

Part of ``pd_connector.vllm.compat``. ``plugin.register`` (every vLLM process) calls ``register_connector``;
``PDConnector.__init__`` (EngineCore and workers) calls ``limit_busy_poll``, and in EngineCore
``hook_step_output`` and ``schedule_ended_loads_at_once``; ``SchedulerSide``
(EngineCore) calls ``first_output_token`` on P and ``seed_first_token`` and ``first_token_output`` on D.
Each writes or reads vLLM state that vLLM does not promise to keep (a private registry, a queue's wait loop,
a request's token lists and status, the scheduler's per-step error set and step outputs, EngineCore's step
result).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_connector.vllm.compat.versions import (
    BUSY_POLL_SYMBOLS,
    FAIL_LOAD_SYMBOLS,
    PLUGIN_SYMBOLS,
    STEP_SYMBOLS,
    STREAM_SYMBOLS,
    require,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request, RequestStatus

logger = logging.getLogger(f"vllm.{__name__}")


def register_connector(name: str, module_path: str, class_name: str) -> None:
    """Register a connector class lazily (module path + class name) in vLLM's ``KVConnectorFactory``, unless
    the name is taken already. vLLM 0.32 has no public query, so this reads the factory's private
    ``_registry`` (``register_connector`` itself raises on a second registration)."""
    require("pd_connector's vLLM plugin", PLUGIN_SYMBOLS)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(name, module_path, class_name)


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
    D's API server sees ``token`` only where the request asks D's stream to carry it
    (``pd_stream_first_token``: ``hook_step_output`` outputs it); otherwise pd-router streams P's copy of it
    (docs/wire-contract.md). Returns False, changing nothing, for a request without prompt token ids (prompt
    embeddings).
    """
    prompt = request.prompt_token_ids
    if prompt is None:
        return False
    request.prompt_token_ids = [*prompt, token]
    request.append_output_token_ids(token)
    return True


@dataclass(frozen=True)
class FirstTokenEnd:
    """How P's token, as D's first output, ends its request: vLLM's finished status and stop reason."""

    status: RequestStatus
    stop_reason: int | str | None


@dataclass(frozen=True)
class StreamedFirstToken:
    """P's token for D's own stream to carry first (``hook_step_output``); ``end``: how it ends the
    request, None when D goes on after it."""

    token: int
    end: FirstTokenEnd | None


def first_token_output(request: Request, max_model_len: int) -> StreamedFirstToken | None:
    """D (scheduler side, right after ``seed_first_token``): P's token as D's stream is to carry it, or None
    when it cannot (logprobs asked: P's answer alone has the token's, and vLLM's output would be a row short).

    vLLM checks stop conditions on the tokens it samples only, so whether P's token itself ends the request
    (the model's EOS, a stop token id, ``max_tokens`` 1, the context full) is checked here with vLLM's own
    ``check_stop``; its changes to the request's status and stop reason are undone, so the request stays as
    vLLM left it until ``hook_step_output`` ends it with the output of P's token.
    """
    from vllm.v1.core.sched.utils import check_stop

    params = request.sampling_params
    prompt, outputs = request.prompt_token_ids, request.output_token_ids
    if params is None or request.pooling_params is not None or params.logprobs is not None:
        return None
    if prompt is None or not outputs:
        return None
    token = int(outputs[-1])
    status, reason = request.status, request.stop_reason
    try:
        if not check_stop(request, max_model_len):
            return StreamedFirstToken(token, None)
        return StreamedFirstToken(token, FirstTokenEnd(request.status, request.stop_reason))
    finally:
        request.status, request.stop_reason = status, reason


def hook_step_output() -> None:
    """Let the scheduler's connector act on each step's output beyond the connector API (EngineCore;
    idempotent): end single requests whose load ended, and output P's token for seeded requests.

    Failing a load: vLLM 0.32 applies its failure policy to every failed load of an engine alike:
    ``recompute`` prefills the prompt locally, ``fail`` ends the request with an error. A seeded request
    (first-token seeding) whose load failed before P's token arrived can do neither right under
    ``recompute``: the client already has P's token, and D would sample a first token of its own after the
    prompt, repeating it (so would a load that landed but brought no usable token). So each step, before vLLM
    handles its output, the connector is asked for ``loads_to_fail(kv_connector_output)``; the requests it
    names join the scheduler's per-step error set (the one grammar-compile failures use), and vLLM ends them
    in that same step with its generation error (the client gets an error, D frees the blocks once the failed
    load is reported, as for ``fail``).

    Outputting P's token: ``seed_first_token`` makes P's token a seeded request's first output token without
    any output saying so, and D's first step then samples the second. For a request the connector names in
    ``streamed_first_tokens`` (``{request id: StreamedFirstToken}``, filled while vLLM handles the step's
    transfer output, emptied here), an output with P's token alone is added to the very step whose output
    reported the load ended, before the request's first step runs: D's API server detokenizes, counts and
    streams it like any token, and the client (through pd-router, ``pd_stream_first_token``) can get it
    without waiting for D's step or for P's answer to come back through P's front end. When P's token ends
    the request, that output carries its finish reason, and the request is finished there with vLLM's
    ``finish_requests`` (as an abort of a request whose load ended: its blocks are freed at once).

    Wraps ``Scheduler.update_from_output``; patched on the class because the scheduler exists before the
    connector. A connector without ``loads_to_fail`` or ``streamed_first_tokens`` changes nothing.
    """
    require("PDConnector", FAIL_LOAD_SYMBOLS + STREAM_SYMBOLS)
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.update_from_output, "__pd_step_output__", False):
        return
    original = Scheduler.update_from_output

    @functools.wraps(original)
    def update_from_output(self: Scheduler, scheduler_output: Any, model_runner_output: Any) -> Any:
        _fail_named_loads(self, model_runner_output)
        outputs = original(self, scheduler_output, model_runner_output)
        _output_first_tokens(self, outputs)
        return outputs

    update_from_output.__pd_step_output__ = True  # type: ignore[attr-defined]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]


def _fail_named_loads(scheduler: Any, model_runner_output: Any) -> None:
    """Before vLLM handles a step's output: the loads the connector names join the per-step error set."""
    ask = getattr(scheduler.connector, "loads_to_fail", None)
    kv_output = getattr(model_runner_output, "kv_connector_output", None)
    if ask is None or kv_output is None:
        return
    doomed = ask(kv_output)
    errors = getattr(scheduler, "grammar_compile_error_reqs", None)
    if doomed and isinstance(errors, set):
        errors.update(doomed)
    elif doomed:
        logger.warning("PDConnector: this vLLM has no per-step error set; %s recompute", sorted(doomed))


def _output_first_tokens(scheduler: Any, outputs: dict[int, Any]) -> None:
    """After vLLM built a step's outputs: an output of P's token for each request the connector names."""
    pending: dict[str, StreamedFirstToken] | None = getattr(
        scheduler.connector, "streamed_first_tokens", None
    )
    if not pending:
        return
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    for req_id, first in pending.items():
        request = scheduler.requests.get(req_id)
        if request is None or request.is_finished():
            continue
        out = EngineCoreOutput(request_id=req_id, new_token_ids=[first.token])
        if first.end is not None:
            out.finish_reason = RequestStatus.get_finished_reason(first.end.status)
            out.stop_reason = first.end.stop_reason
            scheduler.finish_requests(req_id, first.end.status)
        outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(out)
    pending.clear()


def schedule_ended_loads_at_once() -> None:
    """Let EngineCore schedule a request whose load just ended in the very next loop turn (EngineCore;
    idempotent).

    A D whose requests all wait for KV runs steps that compute nothing, and after each of them vLLM 0.32's
    EngineCore loop sleeps 1 ms (``_process_engine_step``: "yield the GIL" to transfer threads) before the
    next. The step in which the worker reports a load ended is such a step, so the request it frees waited
    that millisecond (about 1.1 ms measured) before vLLM scheduled it: on the P/D path that is the hand-off
    from P's first token to D's, paid by every request (docs/performance.md ``## first_token``). This wraps
    ``EngineCore.step`` to report such a step as executed when it left ended loads for the scheduler to
    promote (``finished_recving_kv_req_ids``), so the loop goes straight to the step that schedules them.
    The report only steers the pause and ``post_step``'s draft-token fetch, so engines that use the flag for
    more are left alone: data parallel (a step reported as executed skips its dummy batch, and the other
    ranks would wait for it) and speculative decoding (no draft tokens come from a step that ran nothing).
    Patched on the class because EngineCore binds ``step`` after its scheduler, and so the connector, exist.
    """
    require("PDConnector", STEP_SYMBOLS)
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore.step, "__pd_ended_loads__", False):
        return
    original = EngineCore.step

    @functools.wraps(original)
    def step(self: EngineCore) -> Any:
        outputs, executed = original(self)
        if executed or not self.scheduler.finished_recving_kv_req_ids:  # type: ignore[attr-defined]
            return outputs, executed
        if self.vllm_config.parallel_config.data_parallel_size > 1 or self.check_for_draft_tokens:
            return outputs, executed
        return outputs, True

    step.__pd_ended_loads__ = True  # type: ignore[attr-defined]
    EngineCore.step = step  # type: ignore[method-assign]
