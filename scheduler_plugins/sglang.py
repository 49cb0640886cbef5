"""SGLang adapter: the SLO policy (``budget``, ``cost_model``) sizing each prefill chunk of an SGLang server.

Enabled with ``PD_SGLANG_SCHEDULER=slo`` in the SGLang server's environment: ``pd_connector.sglang.plugin``
(the ``sglang.srt.plugins`` entry point) then calls ``register``, which puts five hooks on SGLang's
``Scheduler`` through SGLang's ``HookRegistry`` (every touch of SGLang is in
``pd_connector.sglang.compat.scheduler``). All run in SGLang's scheduler process, on its scheduling thread:

- after ``Scheduler.__init__``: settings (``PD_SCHED_*``, as for vLLM) are validated and the server checked;
  a server the policy cannot serve refuses to start, saying why (``SLOChunker``'s checks);
- around ``get_new_batch_prefill``: ``scheduler.chunked_prefill_size`` is set, for that call only, to the
  running decodes + the chunk ``budget.prefill_chunk`` picks for the partial prefill under way (else the first
  waiting request). SGLang hands it to ``PrefillAdder`` as ``rem_chunk_tokens`` and, with mixed chunks,
  subtracts the decodes riding along, so the prefill gets exactly the chunk;
- before ``run_batch``, after ``process_batch_result`` and before ``on_idle`` (the loop found nothing to run):
  the step's shape and its time are fed to the cost model, by default its whole cycle as for vLLM
  (``scheduler_plugins.step_clock``): from the start of one ``run_batch`` to the start of the next when the
  loop ran straight on, else to the end of its result's handling; with ``step_time=forward``, from the start
  of ``run_batch`` to the end of ``process_batch_result`` (the measure before: it left out SGLang's
  receiving and scheduling between steps, and the predictions fell short of the gaps clients saw).

Piggybacking needs ``--enable-mixed-chunk``: without it SGLang runs prefill chunks as steps of their own and
the decodes wait for the whole prompt whatever the chunk size, so the adapter refuses to start without it.

Failure policy: SGLang's scheduler must survive our bugs. Any exception in the adapter's per-step work is
logged in one line and turns the adapter off for that scheduler: SGLang then runs with its own configured
chunk size. The chosen chunk is logged (logger ``scheduler_plugins.sglang``, INFO) at most every
``log_interval_s`` and whenever the effective ITL target changes; the integration test reads it there.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from pd_connector.sglang.compat import scheduler as compat
from scheduler_plugins.budget import (
    FLOOR_LOOKAHEAD,
    DecodeTrack,
    FirstTokens,
    PendingPrefill,
    StepPlan,
    deadline_chunk,
    explain,
    lone_step_chunk,
    prefill_chunk,
    step_limit_s,
    tpot_limit_s,
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
from scheduler_plugins.cost_model import CostModel, step_shape
from scheduler_plugins.step_clock import RunQueueWait, StepClock, StepSample, StepStats
from scheduler_plugins.verdict import TargetJudge

logger = logging.getLogger(__name__)

#: The switch: ``slo`` turns the adapter on; unset or empty leaves SGLang's scheduler alone.
ENABLE_ENV = "PD_SGLANG_SCHEDULER"
ENABLE_VALUE = "slo"


class SLOChunker:
    """One scheduler's policy state: settings, cost model, the step clock. Built by ``init_hook``, in the
    scheduler process (SGLang CPU runs the model on that process's main thread, whose wait for a CPU the log
    line reports as ``worker_wait``)."""

    def __init__(self, settings: SchedulerSettings, facts: compat.ServerFacts) -> None:
        problems = refusals(settings, facts)
        if problems:
            raise ValueError(
                "scheduler_plugins' SLO scheduler cannot run on this SGLang server: " + "; ".join(problems)
            )
        assert facts.chunk_cap is not None  # refusals() checked it
        self.slo = settings
        self.engine_cap = facts.chunk_cap
        self.align = settings.chunk_align(facts.page_size)
        self.min_chunk = settings.min_chunk(facts.page_size)
        # SGLang CPU's prefill chunks cost in their depth whatever their size (cost_model says why)
        self.cost_model = CostModel(depth_term=True)
        self.active = True
        self.last_chunk: int | None = None
        self._clock = StepClock()
        self._stats = StepStats()
        self._model_thread = RunQueueWait([os.getpid()])
        self._planned = False  # this iteration chose a chunk: its step's prediction is logged against it
        self._first_tokens = FirstTokens()  # time.monotonic(), for the TPOT accounts
        self.judge = TargetJudge("SLO scheduler", logger, settings.verdict_after_steps)
        self._invalid_targets = InvalidTargetWarnings(_warn_invalid_target)
        self._last_log = 0.0
        self._last_target_ms = settings.itl_target_ms

    def chunked_prefill_size(self, view: compat.PrefillView) -> int | None:
        """The ``chunked_prefill_size`` for this step: decodes + the SLO chunk; None when no prefill is
        pending (SGLang's value stays)."""
        now = time.monotonic()
        running = {d.rid for d in view.decodes}
        self._first_tokens.note(running, now, lambda rid: rid not in running)  # every step, planned or not
        self._planned = bool(view.pending)
        if not view.pending:
            return None
        # The strictest ITL target among the step's requests (the candidate's too: it decodes next); a
        # request's own target never loosens the server's.
        params = [*((d.rid, d.params) for d in view.decodes), (view.pending[0].rid, view.pending[0].params)]
        target_ms = min(
            [
                self.slo.itl_target_ms,
                *(self._target_ms(rid, p, ITL_TARGET_ARG, self.slo.itl_target_ms) for rid, p in params),
            ]
        )
        decodes = len(view.decodes)
        plan = StepPlan(
            decodes=decodes,
            decode_context=sum(d.length for d in view.decodes),
            prefill_cached=view.pending[0].cached,
            max_step_tokens=self.engine_cap,
        )
        itl_limit_s = target_ms / 1e3 * self.slo.headroom
        # SGLang fills a step's chunk in queue order with no per-request cap: only a first prompt that ends
        # within a short step can leave the rest of it to the prompt behind.
        lone = lone_step_chunk(
            self.cost_model,
            plan,
            view.pending[0].remaining,
            view.pending[1].remaining if len(view.pending) > 1 else 0,
            itl_limit_s,
            self.min_chunk,
            self.align,
            admits_beside=False,
        )
        limit_s = min(
            step_limit_s(
                plan, itl_limit_s, self.slo.chunk_lone_prefill or lone > 0, self.slo.lone_step_limit_s()
            ),
            tpot_limit_s(
                self._decode_tracks(view.decodes, now),
                self.cost_model.predict(plan.shape(0)),
                self.slo.headroom,
            ),
        )
        chunk = max(
            prefill_chunk(
                self.cost_model, plan, limit_s, self.align, self.min_chunk, self.slo.lost_target_slack
            ),
            self._deadline_chunk(plan, view),
            lone,
        )
        self.last_chunk = chunk
        self.judge.judge(self.cost_model, plan, self.min_chunk, itl_limit_s, target_ms, now)
        self._log(target_ms, chunk, plan, limit_s)
        return max(1, min(self.engine_cap, decodes + chunk))

    def _deadline_chunk(self, plan: StepPlan, view: compat.PrefillView) -> int:
        """The chunk with which the pending prefills, in the view's order, are predicted to end by their TTFT
        deadlines (0: the ITL target alone decides; ``ttft_aware_chunks`` off, or every deadline is lost
        anyway). No waiting prompt is admitted beside the one under way here: SGLang gives the chunk to the
        prefill under way first, with no per-request cap to leave room (vLLM's adapter does)."""
        if not self.slo.ttft_aware_chunks:
            return 0
        pending = [
            PendingPrefill(
                p.remaining,
                p.cached,
                (
                    self._target_ms(p.rid, p.params, TTFT_TARGET_ARG, self.slo.ttft_target_ms) / 1e3
                    - p.waited_s
                )
                * self.slo.headroom,
            )
            for p in view.pending
        ]
        return deadline_chunk(self.cost_model, plan, pending, self.align)

    def _decode_tracks(self, decodes: list[compat.DecodeView], now: float) -> list[DecodeTrack]:
        """The TPOT accounts of the running decodes that have a target (the server's ``tpot_target_ms``, or
        their own in ``custom_params``, never looser) and a known length."""
        tracks = []
        for d in decodes:
            own = self._target_ms(d.rid, d.params, TPOT_TARGET_ARG, self.slo.tpot_target_ms)
            target_ms = tightened_ms(own, self.slo.tpot_target_ms)
            if target_ms and d.max_tokens > 0:
                tracks.append(
                    DecodeTrack.of(
                        target_ms, d.produced, d.max_tokens, self._first_tokens.elapsed_s(d.rid, now)
                    )
                )
        return tracks

    def _target_ms(self, rid: str, params: Any, key: str, default: float) -> float:
        """Request ``rid``'s own target ``key`` from its ``custom_params``; the server's ``default`` when
        unset or invalid."""
        return request_target_ms(params, key, default, functools.partial(self._invalid_targets, rid))

    def step_started(self, rows: list[tuple[int, int]]) -> None:
        """Before ``run_batch``: the previous step's cycle ends if the loop ran straight on, and this one
        starts. Only a step whose chunk was chosen is predicted (a prediction refits the model)."""
        now = time.perf_counter()
        self._observe(self._clock.begin(now, time.process_time()))
        shape = step_shape(rows) if rows else None
        predicted = self.cost_model.predict(shape) if shape is not None and self._planned else 0.0
        self._planned = False
        self._clock.scheduled(shape, predicted, now, self._model_thread.seconds())

    def step_ended(self) -> None:
        """After ``process_batch_result``: whether SGLang loops on is known only at its next iteration."""
        now = time.perf_counter()
        self._observe(self._clock.updated(now, now, time.process_time(), True, self._model_thread.seconds()))

    def went_idle(self) -> None:
        """Before ``on_idle``: the loop found nothing to run, so the last step's cycle ended at its result."""
        self._observe(self._clock.idle())

    def _observe(self, sample: StepSample | None) -> None:
        if sample is None:
            return
        cycle = self.slo.step_time is StepTime.CYCLE
        self.cost_model.observe(sample.shape, sample.cycle_s if cycle else sample.forward_s)
        self._stats.add(sample)

    def fail(self, where: str, exc: BaseException) -> None:
        """Turn the adapter off for this scheduler, in one log line: SGLang's own chunk size from now on."""
        self.active = False
        logger.error(
            "SLO scheduler: %s failed (%s: %s); SGLang's own chunk size (%d) from now on",
            where,
            type(exc).__name__,
            exc,
            self.engine_cap,
        )

    def _log(self, target_ms: float, chunk: int, plan: StepPlan, limit_s: float) -> None:
        now = time.monotonic()
        if target_ms == self._last_target_ms and now - self._last_log < self.slo.log_interval_s:
            return
        self._last_log, self._last_target_ms = now, target_ms
        logger.info(
            "SLO scheduler chunk: itl_target_ms=%g chunk=%d %s %s",
            target_ms,
            chunk,
            explain(
                self.cost_model,
                plan,
                chunk,
                limit_s,
                working_limit_s(self.cost_model, plan, limit_s, self.min_chunk, self.slo.lost_target_slack),
            ),
            self._stats.summary(),
        )


def _warn_invalid_target(rid: str, key: str, value: Any) -> None:
    logger.warning("request %s: ignoring invalid custom_params %s=%r", rid, key, value)


def refusals(settings: SchedulerSettings, facts: compat.ServerFacts) -> list[str]:
    """Why the policy cannot serve this server (empty: it can), each with what to change."""
    problems = []
    if settings.mode is not Mode.COLOCATED:
        problems.append(
            f"mode={settings.mode.value} is not supported on SGLang (only colocated: SGLang's decode servers "
            "never prefill, and the prefill mode's deadline order is not implemented for SGLang)"
        )
    if facts.disaggregation_mode != "null":
        problems.append(
            f"--disaggregation-mode {facts.disaggregation_mode}: the colocated policy needs a server that "
            "prefills and decodes"
        )
    if facts.chunk_cap is None:
        problems.append("chunked prefill is off: set --chunked-prefill-size to a positive number of tokens")
    if not facts.mixed_chunk:
        problems.append(
            "--enable-mixed-chunk is off: without it SGLang runs each prefill chunk as a step of its own and "
            "the running streams wait for the whole prompt, whatever the chunk size"
        )
    return problems


# ---- the hooks (SGLang calls them; see compat.hook_scheduler for where) -------------------------------


def init_hook(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """After ``Scheduler.__init__``: attach an ``SLOChunker``. A bad setting or a server the policy cannot
    serve stops the server at start (``ValueError``, ``RuntimeError`` naming what is wrong): the user asked
    for the policy, and a server silently running without it would be worse."""
    settings = load_settings(os.environ, None)
    facts = compat.server_facts(scheduler)
    chunker = SLOChunker(settings, facts)
    if facts.overlap:
        logger.warning(
            "SLO scheduler: with the overlap scheduler SGLang handles a step's result after launching the "
            "next step, so the time learned for each step is largely its predecessor's (proven with "
            "--disable-overlap-schedule only)"
        )
    compat.attach(scheduler, chunker)
    logger.info(
        "SLO scheduler on: itl_target_ms=%g headroom=%g chunk_align=%d min_chunk=%d lost_target_slack=%g "
        "lone_step_ms=%g chunked_prefill_size=%d step_time=%s",
        settings.itl_target_ms,
        settings.headroom,
        chunker.align,
        chunker.min_chunk,
        settings.lost_target_slack,
        settings.lone_step_limit_s() * 1e3,
        chunker.engine_cap,
        settings.step_time.value,
    )


def prefill_hook(original_fn: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Around ``get_new_batch_prefill(running_batch)``: SGLang builds the step with our chunk size."""
    chunker = compat.attached(scheduler)
    size = None
    if chunker is not None and chunker.active:
        try:
            running_batch = kwargs["running_batch"] if "running_batch" in kwargs else args[0]
            size = chunker.chunked_prefill_size(
                compat.prefill_view(scheduler, running_batch, FLOOR_LOOKAHEAD)
            )
        except Exception as exc:
            chunker.fail("choosing the prefill chunk", exc)
    if size is None:
        return original_fn(scheduler, *args, **kwargs)
    with compat.chunked_prefill_size(scheduler, size):
        return original_fn(scheduler, *args, **kwargs)


def run_hook(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Before ``run_batch(batch)``: the step starts (its shape and start time); the one before it ends if the
    loop ran straight on."""
    chunker = compat.attached(scheduler)
    if chunker is not None and chunker.active:
        try:
            chunker.step_started(compat.batch_rows(kwargs["batch"] if "batch" in kwargs else args[0]))
        except Exception as exc:
            chunker.fail("timing the step", exc)


def result_hook(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """After ``process_batch_result``: the step's output was handled (its cycle ends at the next step)."""
    chunker = compat.attached(scheduler)
    if chunker is not None and chunker.active:
        try:
            chunker.step_ended()
        except Exception as exc:
            chunker.fail("timing the step", exc)


def idle_hook(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Before ``on_idle`` (SGLang's loop found nothing to run): the last step's cycle ended at its result;
    the cost model learns it."""
    chunker = compat.attached(scheduler)
    if chunker is not None and chunker.active:
        try:
            chunker.went_idle()
        except Exception as exc:
            chunker.fail("fitting the cost model", exc)


def register(env: Mapping[str, str] = os.environ) -> None:
    """Called by ``pd_connector.sglang.plugin.register`` in each SGLang process; logs and returns on any
    problem (a plugin that raises would stop SGLang's launcher)."""
    value = env.get(ENABLE_ENV, "")
    if not value:
        return
    if value != ENABLE_VALUE:
        logger.error(
            "%s=%r: unknown value (use %r); the SLO scheduler is off", ENABLE_ENV, value, ENABLE_VALUE
        )
        return
    problem = compat.startup_problem()
    if problem is not None:
        logger.error("%s", problem)
        return
    compat.hook_scheduler(init_hook, prefill_hook, run_hook, result_hook, idle_hook)
