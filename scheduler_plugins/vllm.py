"""vLLM adapter: ``--scheduler-cls scheduler_plugins.vllm.SLOScheduler`` (vLLM 0.32, v1 engine).

Runs inside vLLM's EngineCore process, which calls ``schedule()`` then ``update_from_output()`` once per
iteration (``--scheduler-cls`` turns async scheduling off, so the two alternate strictly). This class does not
copy vLLM's scheduling loop; it sets the loop's inputs before delegating to it:

- ``self.running`` is reordered so decodes come first and partial prefills after them (stall-free order),
  and partial prefills and ``self.waiting`` (a FCFS queue) are ordered by TTFT deadline instead of arrival
  (on a decode node remote KV loads wait first).
- ``self.max_num_scheduled_tokens`` (the step's token budget) becomes decode tokens + the chunk chosen by
  ``budget.prefill_chunk``, raised to the pending prefills' TTFT deadlines (``budget.deadline_chunk``,
  ``budget.admission_chunk``) or to start a second prompt in a step with no decode
  (``budget.lone_step_chunk``), + one token per remote KV load waiting in decode mode, and the private copy of
  the scheduler config gets ``long_prefill_token_threshold = chunk``, so one prefill cannot take the decodes'
  share or the remote loads' reserve.
- each step's cost is fed to the cost model with the step's shape: by default its whole cycle, from the
  start of ``schedule()`` to the start of the next one (``scheduler_plugins.step_clock`` says why), or, with
  ``step_time=forward``, the time from the end of ``schedule()`` to the start of ``update_from_output()``
  (the workers' forward pass and sampling).
- once the model has measured ``verdict_after_steps`` steps, the scheduler judges whether the target can be
  held (the decodes plus the minimum chunk predicted within ``headroom x target``) and says so in the log:
  a WARNING when it cannot, an INFO when it can again.

The chosen budget is logged (logger ``vllm.scheduler_plugins.vllm``) at most every ``log_interval_s`` and
whenever the effective ITL target changes; the integration tests read it from the server log.

Every read or write of the scheduler's private fields (queues, budget, config copy) and of a request's
internal counters goes through ``pd_connector.vllm.compat``, which checks them all when the scheduler starts
(``require_scheduler``) and names the vLLM version they were proven on.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from pd_connector.vllm import compat
from scheduler_plugins.budget import (
    FLOOR_LOOKAHEAD,
    DecodeTrack,
    FirstTokens,
    PendingPrefill,
    StepPlan,
    WaitingPrompt,
    admission_chunk,
    deadline_chunk,
    deadline_order,
    explain,
    lone_step_chunk,
    partial_share,
    prefill_chunk,
    step_limit_s,
    tpot_limit_s,
    urgent_count,
    working_limit_s,
)
from scheduler_plugins.config import (
    ITL_TARGET_ARG,
    TPOT_TARGET_ARG,
    TTFT_TARGET_ARG,
    InvalidTargetWarnings,
    Mode,
    SchedulerSettings,
    StepTime,
    load_settings,
    request_target_ms,
    tightened_ms,
)
from scheduler_plugins.cost_model import CostModel, StepShape, step_shape
from scheduler_plugins.step_clock import RunQueueWait, StepClock, StepSample, StepStats, pinned_cores
from scheduler_plugins.verdict import TargetJudge

# Under the "vllm." namespace so vLLM's logging configuration prints it in the server log.
logger = init_logger(f"vllm.{__name__}")

# Workers waiting for a CPU this share of the steps' time: other processes run on the model's cores.
WAIT_WARNING_SHARE = 0.05
WAIT_WARNING_INTERVAL_S = 60.0


class SLOScheduler(Scheduler):
    """vLLM's scheduler with an SLO-driven token budget per step (see the module docstring)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        compat.require_scheduler(self)
        additional = vllm_config.additional_config
        self.slo: SchedulerSettings = load_settings(
            os.environ, additional if isinstance(additional, dict) else None
        )
        if self.slo.mode is Mode.PREFILL and not compat.uses_fcfs(self):
            raise ValueError(
                "scheduler_plugins prefill mode orders the queue itself: use --scheduling-policy fcfs"
            )
        if self.slo.mode is not Mode.PREFILL and not compat.chunked_prefill_enabled(self):
            raise ValueError(
                "scheduler_plugins colocated/decode modes need chunked prefill (do not disable it)"
            )
        # A private copy: the per-step long_prefill_token_threshold must not leak into the shared config.
        self._user_long_prefill = compat.privatize_scheduler_config(self)
        self._engine_cap = compat.token_budget(self)
        self._align = self.slo.chunk_align(compat.block_size(self))
        self._min_chunk = self.slo.min_chunk(compat.block_size(self))
        self.cost_model = CostModel()
        self._clock = StepClock()
        self._stats = StepStats()
        workers = RunQueueWait.children(os.getpid())  # the executor (built before us) started them
        self._workers = RunQueueWait(workers)
        _warn_if_no_core_is_left(pinned_cores(workers))
        self._last_wait_warning = -WAIT_WARNING_INTERVAL_S
        self.judge = TargetJudge("SLOScheduler", logger, self.slo.verdict_after_steps)
        self._invalid_targets = InvalidTargetWarnings(_warn_invalid_target)
        self._last_log = 0.0
        self._last_target_ms = self.slo.itl_target_ms
        self.current_budget = self._engine_cap
        self._first_tokens = FirstTokens()  # time.monotonic(), for the TPOT accounts
        logger.info(
            "SLOScheduler: mode=%s itl_target_ms=%g ttft_target_ms=%g tpot_target_ms=%g headroom=%g "
            "chunk_align=%d min_chunk=%d lost_target_slack=%g lone_step_ms=%g engine_cap=%d step_time=%s "
            "engine_cores=%s api_server_cores=%s",
            self.slo.mode.value,
            self.slo.itl_target_ms,
            self.slo.ttft_target_ms,
            self.slo.tpot_target_ms,
            self.slo.headroom,
            self._align,
            self._min_chunk,
            self.slo.lost_target_slack,
            self.slo.lone_step_limit_s() * 1e3,
            self._engine_cap,
            self.slo.step_time.value,
            _cores(0),
            _cores(os.getppid()),  # vLLM's API server starts the EngineCore process
        )

    # --- per-request targets -------------------------------------------------------------------------
    def _request_target_ms(self, request: Request, key: str, default: float) -> float:
        invalid = functools.partial(self._invalid_targets, request.request_id)
        return request_target_ms(compat.extra_args(request), key, default, invalid)

    def _decode_tracks(self, decodes: list[Request]) -> list[DecodeTrack]:
        """The TPOT accounts of the running decodes that have a target (``FirstTokens`` started them)."""
        now = time.monotonic()
        tracks = []
        for request in decodes:
            own = self._request_target_ms(request, TPOT_TARGET_ARG, self.slo.tpot_target_ms)
            target_ms = tightened_ms(own, self.slo.tpot_target_ms)
            if target_ms:
                tracks.append(
                    DecodeTrack.of(
                        target_ms,
                        compat.output_tokens(request),
                        compat.max_tokens(request),
                        self._first_tokens.elapsed_s(request.request_id, now),
                    )
                )
        return tracks

    def _deadline(self, request: Request) -> float:
        return (
            compat.arrival_time(request)
            + self._request_target_ms(request, TTFT_TARGET_ARG, self.slo.ttft_target_ms) / 1e3
        )

    # --- the step --------------------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._observe(self._clock.begin(time.perf_counter(), time.process_time()))
        running = compat.running(self)
        decodes = [r for r in running if compat.is_decode(r)]
        prefills = deadline_order([r for r in running if not compat.is_decode(r)], self._deadline)
        self._order_waiting()
        planned = False
        if self.slo.mode is Mode.PREFILL:
            self._set_budget(self._engine_cap, self._user_long_prefill)
        else:  # the TPOT accounts are read by _plan_step only: a prefill node keeps none
            self._first_tokens.note(
                (r.request_id for r in decodes),
                time.monotonic(),
                lambda request_id: compat.scheduled_request(self, request_id) is None,
            )
            planned = self._plan_step(decodes, prefills)
        compat.set_running_order(self, decodes + prefills)
        output = super().schedule(throttle_prefills)
        shape = self._shape_of(output) if output.total_num_scheduled_tokens else None
        # Only a planned step's prediction is checked against its time (cycle/predicted in the log): a
        # prediction refits the model, which costs the model's core time on steps that asked it nothing.
        predicted = self.cost_model.predict(shape) if shape is not None and planned else 0.0
        self._clock.scheduled(shape, predicted, time.perf_counter(), self._workers.seconds())
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        forward_end, wait = time.perf_counter(), self._workers.seconds()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        # vLLM's busy loop steps again at once while the scheduler has requests (EngineCore.step).
        more = self.has_requests()
        now = time.perf_counter()
        self._observe(self._clock.updated(forward_end, now, time.process_time(), more, wait))
        return outputs

    def _observe(self, sample: StepSample | None) -> None:
        if sample is None:
            return
        cycle = self.slo.step_time is StepTime.CYCLE
        self.cost_model.observe(sample.shape, sample.cycle_s if cycle else sample.forward_s)
        self._stats.add(sample)

    def _order_waiting(self) -> None:
        """Earliest TTFT deadline first (ties in arrival order), and on a decode node remote KV loads before
        local prefills. Only a FCFS queue (a deque; prefill mode requires it) can be refilled in a new order;
        a priority queue keeps the order its priorities give."""
        waiting = compat.waiting(self)
        if not waiting or not compat.uses_fcfs(self):
            return
        ordered = deadline_order(waiting, self._deadline)
        if self.slo.mode is Mode.DECODE:
            ordered.sort(key=lambda r: not compat.is_remote_kv(r))  # stable: deadline order within each
        compat.reorder_waiting(self, ordered)

    def _plan_step(self, decodes: list[Request], prefills: list[Request]) -> bool:
        """Colocated/decode: budget = decode tokens + SLO chunk (+ remote-load reserve on a decode node).
        Whether a chunk was planned (False: no prefill pending, the engine's cap stands)."""
        waiting = compat.waiting_with_kv(self)
        remote = [r for r in waiting if compat.is_remote_kv(r)] if self.slo.mode is Mode.DECODE else []
        local_waiting = [r for r in waiting if not compat.is_remote_kv(r)] if remote else waiting
        candidate = prefills[0] if prefills else (local_waiting[0] if local_waiting else None)
        # The waiting prompts the engine takes after the chunk's owner, in queue order.
        behind = local_waiting if prefills else local_waiting[1:]
        decode_tokens = sum(compat.pending_tokens(r) for r in decodes)
        reserve = len(remote)
        if candidate is None:
            self._set_budget(self._engine_cap, self._user_long_prefill)
            return False
        # The strictest ITL target among the step's requests (the chunk's owner too: it decodes next); a
        # request's own target never loosens the server's.
        target_ms = min(
            self.slo.itl_target_ms,
            *(
                self._request_target_ms(r, ITL_TARGET_ARG, self.slo.itl_target_ms)
                for r in [*decodes, candidate]
            ),
        )
        plan = StepPlan(
            decodes=decode_tokens + reserve,
            decode_context=sum(compat.computed_tokens(r) for r in decodes),
            prefill_cached=compat.computed_tokens(candidate),
            max_step_tokens=self._engine_cap,
        )
        itl_limit_s = target_ms / 1e3 * self.slo.headroom
        lone = (
            lone_step_chunk(
                self.cost_model,
                plan,
                compat.pending_tokens(candidate),
                compat.pending_tokens(behind[0]) if behind else 0,
                itl_limit_s,
                self._min_chunk,
                self._align,
                admits_beside=True,
            )
            if self.slo.admit_during_prefill
            else 0
        )
        limit_s = min(
            step_limit_s(
                plan, itl_limit_s, self.slo.chunk_lone_prefill or lone > 0, self.slo.lone_step_limit_s()
            ),
            tpot_limit_s(
                self._decode_tracks(decodes), self.cost_model.predict(plan.shape(0)), self.slo.headroom
            ),
        )
        chunk = max(
            prefill_chunk(
                self.cost_model, plan, limit_s, self._align, self._min_chunk, self.slo.lost_target_slack
            ),
            self._deadline_chunk(plan, prefills or [candidate], behind),
            lone,
        )
        self.judge.judge(self.cost_model, plan, self._min_chunk, itl_limit_s, target_ms, time.monotonic())
        budget = min(self._engine_cap, decode_tokens + reserve + chunk)
        # The chunk's owner leaves room in its step for waiting prompts that fit (a new stream's prompt).
        share = (
            partial_share(chunk, (compat.pending_tokens(r) for r in behind), self._min_chunk)
            if self.slo.admit_during_prefill
            else chunk
        )
        threshold = min(share, self._user_long_prefill) if self._user_long_prefill else share
        self._set_budget(max(1, budget), max(1, threshold))
        self._log_budget(target_ms, chunk, share, len(behind), plan, limit_s)
        return True

    def _deadline_chunk(self, plan: StepPlan, head: list[Request], behind: list[Request]) -> int:
        """The chunk with which the pending prefills are predicted to end by their TTFT deadlines, and with
        which urgent waiting prompts (``budget.urgent_count``) are admitted beside the chunk's owner now
        (with ``admit_during_prefill``; 0: the ITL target alone decides; ``ttft_aware_chunks`` off, or every
        deadline is lost anyway). ``head``: the prefills under way, or else the first waiting prompt (the
        chunk's owner); ``behind``: the waiting prompts after it.

        The floor sees the prefills in the order the engine will serve them: those urgent prompts, the head,
        then the rest of the queue, the first ``FLOOR_LOOKAHEAD`` of them.
        """
        if not self.slo.ttft_aware_chunks:
            return 0
        now = time.time()
        admit = self.slo.admit_during_prefill  # partial_share admits them (_plan_step)
        urgent = self._urgent(plan, head[0], behind, now) if admit else []
        order = [*urgent, *head, *behind[len(urgent) :]][:FLOOR_LOOKAHEAD]
        pending = [
            PendingPrefill(compat.pending_tokens(r), compat.computed_tokens(r), self._time_left_s(r, now))
            for r in order
        ]
        room = plan.max_step_tokens - plan.decodes
        return max(
            deadline_chunk(self.cost_model, plan, pending, self._align),
            admission_chunk((compat.pending_tokens(r) for r in urgent), self._min_chunk, self._align, room),
        )

    def _urgent(self, plan: StepPlan, owner: Request, waiting: list[Request], now: float) -> list[Request]:
        """The leading waiting requests (deadline order) to admit beside the chunk's owner (the prefill under
        way, or else the first waiting prompt) now rather than after its whole prompt
        (``budget.urgent_count``)."""
        candidates = waiting[:FLOOR_LOOKAHEAD]
        count = urgent_count(
            self.cost_model,
            plan,
            (WaitingPrompt(compat.pending_tokens(r), self._time_left_s(r, now)) for r in candidates),
            self._time_left_s(owner, now),
            self._min_chunk,
            self._align,
        )
        return candidates[:count]

    def _time_left_s(self, request: Request, now: float) -> float:
        """Seconds to ``request``'s TTFT deadline with the headroom applied (``now``: ``time.time()``)."""
        return (self._deadline(request) - now) * self.slo.headroom

    def _set_budget(self, budget: int, long_prefill_threshold: int) -> None:
        compat.set_token_budget(self, budget, long_prefill_threshold)
        self.current_budget = budget

    def _log_budget(
        self, target_ms: float, chunk: int, share: int, waiting: int, plan: StepPlan, limit_s: float
    ) -> None:
        now = time.monotonic()
        changed = target_ms != self._last_target_ms
        if not changed and now - self._last_log < self.slo.log_interval_s:
            return
        self._last_log, self._last_target_ms = now, target_ms
        waited = self._stats.worker_wait_share()
        if waited > WAIT_WARNING_SHARE and now - self._last_wait_warning >= WAIT_WARNING_INTERVAL_S:
            self._last_wait_warning = now
            logger.warning(
                "SLOScheduler: the model's workers waited for a CPU %.0f%% of the last steps' time (other "
                "processes run on their cores): those steps take longer than measured alone, and gaps can "
                "exceed the target; give the workers cores of their own (VLLM_CPU_OMP_THREADS_BIND)",
                waited * 100,
            )
        logger.info(
            "SLOScheduler budget: itl_target_ms=%g chunk=%d budget=%d under_way=%d waiting=%d %s %s",
            target_ms,
            chunk,
            self.current_budget,
            share,
            waiting,
            explain(
                self.cost_model,
                plan,
                chunk,
                limit_s,
                working_limit_s(self.cost_model, plan, limit_s, self._min_chunk, self.slo.lost_target_slack),
            ),
            self._stats.summary(),
        )

    def _shape_of(self, output: SchedulerOutput) -> StepShape:
        """The step's shape, read after the parent advanced ``num_computed_tokens`` by the scheduled
        tokens."""
        rows = []
        for req_id, n in output.num_scheduled_tokens.items():
            request = compat.scheduled_request(self, req_id)
            rows.append((n, (compat.computed_tokens(request) - n) if request is not None else 0))
        return step_shape(rows)


def _cores(pid: int) -> str:
    """The CPUs ``pid`` may run on, as a compact list (``0-1``), for the start-up line."""
    try:
        return _compact(sorted(os.sched_getaffinity(pid)))
    except OSError:
        return "?"


def _compact(cpus: list[int]) -> str:
    """Sorted CPU numbers as ``0-3`` when contiguous, else ``0,2``."""
    if len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def _warn_if_no_core_is_left(model_cores: set[int]) -> None:
    """Say at start when the model's OpenMP threads are pinned to every core this process may use.

    vLLM's EngineCore (this process) busy-polls its workers for their reply (``sched_yield`` in vLLM's
    shared-memory queue), and the API server runs beside it: with no core left to them they preempt the
    model's threads, and OpenMP steps then took 4-5x their measured cost (docs/performance.md
    ``## scheduler``, ``--cores 0-1`` on two cores), so no budget can hold a target.
    """
    allowed = set(os.sched_getaffinity(0))
    if model_cores and not allowed - model_cores:
        logger.warning(
            "SLOScheduler: the model's threads are pinned to every core this engine may use (%s): vLLM's "
            "EngineCore and API server must preempt them, steps slow down unpredictably and the ITL target "
            "cannot be relied on; leave them a core (VLLM_CPU_OMP_THREADS_BIND on fewer cores)",
            _compact(sorted(model_cores)),
        )


def _warn_invalid_target(rid: str, key: str, value: Any) -> None:
    logger.warning("request %s: ignoring invalid %s=%r", rid, key, value)
