"""What the SLO scheduler's SGLang adapter (``scheduler_plugins.sglang``) reads of and sets in SGLang's scheduler.

Part of ``pd_connector.sglang.compat``: every touch of SGLang's scheduler internals the adapter makes is here,
checked by name at start (``SYMBOLS``, ``PARAMETERS``, then ``SCHEDULER_FIELDS`` on the built scheduler) on
top of the package's version gate. Proven on sglang ``compat.PROVEN_ON``.

Who calls what (all in SGLang's scheduler process, on its one scheduling thread):
- ``pd_connector.sglang.plugin.register`` (when ``PD_SGLANG_SCHEDULER=slo``): ``startup_problem``, then
  ``hook_scheduler`` puts the adapter's five hooks on ``Scheduler``: AFTER ``__init__`` (``server_facts``,
  ``attach``), AROUND ``get_new_batch_prefill`` (``attached``, ``prefill_view``, ``chunked_prefill_size``),
  BEFORE ``run_batch`` (``batch_rows``), AFTER ``process_batch_result`` and BEFORE ``on_idle``.
- Why these: ``get_new_batch_prefill`` reads ``self.chunked_prefill_size`` on every call and hands it to
  ``PrefillAdder`` as ``rem_chunk_tokens`` (minus the running decodes when mixed chunks are on), so setting
  it for the duration of the call sizes that step's prefill chunk and nothing else; ``run_batch`` starts a
  step and ``process_batch_result`` ends it (in order, also with the overlap scheduler); the loop calls
  ``on_idle`` instead of ``run_batch`` when it found nothing to run, the one sign that it did not run
  straight on into another step.

Imports no SGLang until a function runs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from pd_connector.engine_symbols import has_path, missing
from pd_connector.sglang import compat

_MODULE = "sglang.srt.managers.scheduler"
_SCHEDULER = f"{_MODULE}.Scheduler"
INIT = f"{_SCHEDULER}.__init__"
GET_NEW_BATCH_PREFILL = f"{_SCHEDULER}.get_new_batch_prefill"
RUN_BATCH = f"{_SCHEDULER}.run_batch"
PROCESS_BATCH_RESULT = f"{_SCHEDULER}.process_batch_result"
ON_IDLE = f"{_SCHEDULER}.on_idle"

#: SGLang symbols the adapter needs: the hook targets, the hook types, where a request's own target lives.
SYMBOLS = (
    *(
        f"{_MODULE}:Scheduler.{m}"
        for m in ("__init__", "get_new_batch_prefill", "run_batch", "process_batch_result", "on_idle")
    ),
    "sglang.srt.managers.schedule_policy:PrefillAdder.__init__",
    "sglang.srt.plugins.hook_registry:HookRegistry.register",
    *(f"sglang.srt.plugins.hook_registry:HookType.{t}" for t in ("AROUND", "BEFORE", "AFTER")),
    "sglang.srt.sampling.sampling_params:SamplingParams.custom_params",  # a request's own ITL target
    "sglang.srt.sampling.sampling_params:SamplingParams.max_new_tokens",  # a decode's length, for TPOT
)
#: Parameters the hooks receive by name, and ``PrefillAdder``'s chunk budget (what ``chunked_prefill_size``
#: becomes) and mixed-decode discount, whose meaning the adapter relies on.
PARAMETERS: dict[str, tuple[str, ...]] = {
    f"{_MODULE}:Scheduler.get_new_batch_prefill": ("running_batch",),
    f"{_MODULE}:Scheduler.run_batch": ("batch",),
    f"{_MODULE}:Scheduler.process_batch_result": ("batch", "result"),
    "sglang.srt.managers.schedule_policy:PrefillAdder.__init__": (
        "rem_chunk_tokens",
        "num_mixed_decode_tokens",
    ),
}
#: Fields of the built ``Scheduler`` the adapter reads (``chunked_prefill_size`` it also sets per call).
SCHEDULER_FIELDS = (
    "chunked_prefill_size",
    "is_mixed_chunk",
    "enable_overlap",
    "page_size",
    "chunked_req",
    "waiting_queue",
    "server_args.disaggregation_mode",
)
#: Where the adapter keeps its state: on the scheduler instance it serves (one per scheduler process).
_STATE_ATTR = "_pd_slo_scheduler"


def startup_problem() -> str | None:
    """Why the SLO scheduler cannot run on this SGLang (version, or missing symbols/parameters, all named)."""
    reason = compat.unsupported_reason(compat.sglang_version())
    if reason is not None:
        return reason
    absent = missing(SYMBOLS) + compat.missing_parameters(PARAMETERS)
    if absent:
        return compat._missing_message("scheduler_plugins' SLO scheduler", absent) + ", so it is not enabled"
    return None


def hook_scheduler(
    init_hook: Callable[..., Any],
    prefill_hook: Callable[..., Any],
    run_hook: Callable[..., Any],
    result_hook: Callable[..., Any],
    idle_hook: Callable[..., Any],
) -> None:
    """Register the adapter's hooks (signatures: see ``HookType``): ``init_hook(result, scheduler, ...)``
    AFTER ``__init__``, ``prefill_hook(original_fn, scheduler, running_batch)`` AROUND
    ``get_new_batch_prefill``, ``run_hook(scheduler, batch)`` BEFORE ``run_batch``, ``result_hook(result,
    scheduler, batch, result)`` AFTER ``process_batch_result``, ``idle_hook(scheduler)`` BEFORE
    ``on_idle``."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(INIT, init_hook, HookType.AFTER)
    HookRegistry.register(GET_NEW_BATCH_PREFILL, prefill_hook, HookType.AROUND)
    HookRegistry.register(RUN_BATCH, run_hook, HookType.BEFORE)
    HookRegistry.register(PROCESS_BATCH_RESULT, result_hook, HookType.AFTER)
    HookRegistry.register(ON_IDLE, idle_hook, HookType.BEFORE)


class ServerFacts(NamedTuple):
    """What the adapter checks once, on the built scheduler."""

    chunk_cap: int | None  # --chunked-prefill-size (None: chunked prefill off)
    mixed_chunk: bool  # --enable-mixed-chunk in effect (decodes ride along with prefill chunks)
    overlap: bool  # the overlap scheduler (a step's result is processed one iteration later)
    disaggregation_mode: str  # "null" (aggregated), "prefill" or "decode"
    page_size: int  # tokens per KV page (SGLang cuts chunks at page boundaries)


def server_facts(scheduler: Any) -> ServerFacts:
    """Raise ``RuntimeError`` naming every field of ``SCHEDULER_FIELDS`` the scheduler lacks."""
    absent = [f"Scheduler.{f}" for f in SCHEDULER_FIELDS if not has_path(scheduler, f)]
    if absent:
        raise RuntimeError(compat._missing_message("scheduler_plugins' SLO scheduler", absent))
    cap = scheduler.chunked_prefill_size
    return ServerFacts(
        chunk_cap=int(cap) if cap else None,
        mixed_chunk=bool(scheduler.is_mixed_chunk),
        overlap=bool(scheduler.enable_overlap),
        disaggregation_mode=str(scheduler.server_args.disaggregation_mode),
        page_size=int(scheduler.page_size),
    )


def attach(scheduler: Any, state: object) -> None:
    scheduler.__dict__[_STATE_ATTR] = state


def attached(scheduler: Any) -> Any:
    """The adapter state ``attach`` put on this scheduler, None when the adapter is off for it."""
    return scheduler.__dict__.get(_STATE_ATTR)


class PendingView(NamedTuple):
    """One prefill still to run, as SGLang's scheduler holds it."""

    rid: str
    remaining: int  # prompt tokens still to compute
    cached: int  # tokens already computed (a waiting request's cached prefix is not matched yet: 0)
    params: Any  # its ``custom_params`` (its own TTFT target), None if unset
    waited_s: float  # seconds since SGLang's scheduler received it (0: not recorded)


class DecodeView(NamedTuple):
    """One running decode (it joins a mixed step)."""

    rid: str
    length: int  # tokens in its KV (prompt and output)
    produced: int  # output tokens so far
    max_tokens: int  # its ``max_new_tokens``
    params: Any  # its ``custom_params`` (its own ITL and TPOT targets), None if unset


class PrefillView(NamedTuple):
    """The step ``get_new_batch_prefill`` is about to build, read before it runs."""

    decodes: list[DecodeView]
    # the prefill that gets the chunk (the candidate: the partial prefill under way, else the first waiting
    # request) first, then the waiting queue in its current order; empty: no prefill
    pending: list[PendingView]


def _custom_params(req: Any) -> Any:
    return getattr(getattr(req, "sampling_params", None), "custom_params", None)


def _waited_s(req: Any) -> float:
    """Seconds since the scheduler received ``req`` (``time_stats.scheduler_recv_time``, a
    ``time.perf_counter()`` reading); 0 when SGLang did not record it."""
    received = getattr(getattr(req, "time_stats", None), "scheduler_recv_time", 0.0) or 0.0
    return max(0.0, time.perf_counter() - float(received)) if received else 0.0


def _pending(req: Any, cached: int) -> PendingView:
    remaining = max(0, len(req.origin_input_ids) - cached)
    return PendingView(str(req.rid), remaining, cached, _custom_params(req), _waited_s(req))


def prefill_view(scheduler: Any, running_batch: Any, lookahead: int) -> PrefillView:
    """The running decodes and the prefills still to run, at most ``lookahead`` of them (the step's own work
    stays bounded however long the queue): the partial prefill under way first, then the waiting queue.
    SGLang's policy may reorder the queue in this very call (``calc_priority``); the view keeps the order
    it had."""
    decodes = [
        DecodeView(
            str(r.rid),
            len(r.origin_input_ids) + len(r.output_ids),
            len(r.output_ids),
            int(r.sampling_params.max_new_tokens or 0),
            _custom_params(r),
        )
        for r in getattr(running_batch, "reqs", None) or []
    ]
    partial = scheduler.chunked_req
    pending = [] if partial is None else [_pending(partial, int(partial.extend_end or 0))]
    pending += [
        _pending(r, 0) for r in itertools.islice(scheduler.waiting_queue, max(0, lookahead - len(pending)))
    ]
    return PrefillView(decodes, pending)


@contextmanager
def chunked_prefill_size(scheduler: Any, size: int) -> Iterator[None]:
    """``scheduler.chunked_prefill_size = size`` for the duration of the block, then the configured value."""
    configured = scheduler.chunked_prefill_size
    scheduler.chunked_prefill_size = size
    try:
        yield
    finally:
        scheduler.chunked_prefill_size = configured


def batch_rows(batch: Any) -> list[tuple[int, int]]:
    """``(new tokens, tokens already in the KV)`` per row of the batch about to run: an extend or mixed batch
    lists both (a mixed batch's decodes are rows of one new token); a decode batch has one new token per row."""
    mode = batch.forward_mode
    if mode.is_decode():
        lengths = batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None else []
        return [(1, max(0, int(n) - 1)) for n in lengths]
    if mode.is_extend() or mode.is_mixed():
        return [(int(n), int(p)) for n, p in zip(batch.extend_lens, batch.prefix_lens, strict=True)]
    return []
