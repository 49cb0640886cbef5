"""How the SLO scheduler is configured, validated once when the engine's scheduler is built.

Sources, later wins: built-in defaults, environment variables ``PD_SCHED_*`` (they reach vLLM's EngineCore
process because it inherits the server's environment), then the ``scheduler_plugins`` object of vLLM's
``--additional-config`` JSON. Per-request targets (``itl_target_ms``, ``ttft_target_ms``, ``tpot_target_ms``
in the request's ``vllm_xargs``) are read by the adapter, not here. Bad values raise ``ValueError`` naming the
setting, so a misconfigured server fails at start-up instead of scheduling with a silently wrong target.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import msgspec

ENV_PREFIX = "PD_SCHED_"
ADDITIONAL_CONFIG_KEY = "scheduler_plugins"


class Mode(enum.StrEnum):
    """Which node the engine is: the policy differs by what it has to protect."""

    COLOCATED = "colocated"  # decodes and prefills share the engine: protect the ITL target
    DECODE = "decode"  # a D node: like colocated, and remote KV loads are admitted before local prefills
    PREFILL = "prefill"  # a P node: no decodes to protect; large chunks, earliest TTFT deadline first


class StepTime(enum.StrEnum):
    """Which time of a step the cost model learns (see ``scheduler_plugins.step_clock``)."""

    CYCLE = "cycle"  # one iteration's begin to the next's: what a client waits for (API server work too)
    FORWARD = "forward"  # the workers' forward pass and sampling only (the measure before issue 20)


Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class SchedulerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """All settings; units are in the names. ``chunk_align_tokens=0`` means "the KV block size"."""

    mode: Mode = Mode.COLOCATED
    itl_target_ms: Positive = 100.0
    ttft_target_ms: Positive = 2000.0
    # A mean gap per answer (TPOT) each decode is held to, besides the ITL target's per-gap limit
    # (budget.tpot_limit_s); 0: none unless a request sets its own.
    tpot_target_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # Fraction of the ITL target the predicted step may use: the rest absorbs prediction error and the
    # per-token work outside the model step (sampling, detokenizing, HTTP).
    headroom: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.85
    min_chunk_tokens: NonNegInt = 0
    # A step whose minimum chunk is already predicted over its limit (the target is lost for that step) takes
    # the largest chunk predicted within this fraction above the minimum chunk's step time: the prompt is
    # prefilled in fewer slow steps, each at most this much slower (budget.prefill_chunk); 0: the minimum.
    lost_target_slack: Annotated[float, msgspec.Meta(ge=0)] = 0.25
    # vLLM does not need block-aligned chunks (the next chunk starts inside the block); 16 tokens keeps GPU
    # matmul tiles full while letting a chunk fill the step's time budget closely. On the CPU test machine a
    # 32-token block of a deep prompt costs ~40 ms, so block alignment wasted up to a third of the budget.
    chunk_align_tokens: NonNegInt = 16
    log_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    step_time: StepTime = StepTime.CYCLE
    # A prefill under way leaves room in each step for waiting prompts that fit whole (budget.partial_share).
    admit_during_prefill: bool = True
    # Steps the cost model must have measured (prefill steps among them) before the scheduler judges
    # whether the target can be held (logged once, then on every change of the verdict).
    verdict_after_steps: Annotated[int, msgspec.Meta(ge=1)] = 32
    # A prefill with no decode beside it is not held to the ITL target (budget.step_limit_s says why); True
    # chunks it to the ITL target anyway, so a request arriving mid-prefill waits at most one small step.
    chunk_lone_prefill: bool = False
    # Otherwise such a step takes at most this share of the TTFT target (headroom applied): a prompt arriving
    # during it waits at most that long before it can start; 0: no limit (the engine's whole cap).
    lone_step_ttft_share: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.25
    # Colocated and decode modes: a prefill's chunks grow as far as needed for it to end by its TTFT deadline
    # (arrival + ttft_target_ms), evenly over its remaining steps (budget.deadline_chunk); False: the ITL
    # target alone sizes them, however late the first token gets.
    ttft_aware_chunks: bool = True

    def lone_step_limit_s(self) -> float:
        """How long a step with no decode in it may take (``lone_step_ttft_share``; ``inf``: no limit)."""
        share = self.lone_step_ttft_share * self.headroom * self.ttft_target_ms / 1e3
        return share if share > 0 else math.inf

    def chunk_align(self, block_size: int) -> int:
        """Granularity of prefill chunks: the KV block size unless set."""
        return self.chunk_align_tokens or block_size

    def min_chunk(self, block_size: int) -> int:
        """Smallest chunk a pending prefill gets every step (starvation freedom), a multiple of the alignment;
        ``min_chunk_tokens=0`` means one alignment unit."""
        align = self.chunk_align(block_size)
        wanted = self.min_chunk_tokens or align
        return max(align, align_up(wanted, align))


def load_settings(env: Mapping[str, str], additional_config: Mapping[str, Any] | None) -> SchedulerSettings:
    """Merge defaults, ``PD_SCHED_*`` variables and ``additional_config["scheduler_plugins"]``; validate."""
    fields = set(SchedulerSettings.__struct_fields__)
    merged: dict[str, Any] = {}
    for name, value in env.items():
        if name.startswith(ENV_PREFIX):
            key = name[len(ENV_PREFIX) :].lower()
            if key not in fields:
                raise ValueError(f"unknown scheduler setting {name}; known: {sorted(fields)}")
            merged[key] = value
    section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
    if not isinstance(section, Mapping):
        raise ValueError(
            f"--additional-config {ADDITIONAL_CONFIG_KEY!r} must be a JSON object, got {section!r}"
        )
    merged.update(section)
    try:
        # strict=False: environment values are strings ("100") that must become numbers.
        return msgspec.convert(merged, SchedulerSettings, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid scheduler_plugins setting: {exc}") from exc


#: Per-request target fields (vLLM's ``vllm_xargs``, SGLang's ``custom_params``): the same names on both.
ITL_TARGET_ARG = "itl_target_ms"
TTFT_TARGET_ARG = "ttft_target_ms"
TPOT_TARGET_ARG = "tpot_target_ms"


def request_target_ms(params: Any, key: str, default: float, invalid: Callable[[str, Any], None]) -> float:
    """A request's own target ``key`` from its per-request fields ``params`` (a mapping, or None when it sent
    none); ``default`` (the server's) when unset, and when invalid, which ``invalid(key, value)`` reports
    (each adapter logs it in its own words)."""
    value = params.get(key) if isinstance(params, Mapping) else None
    if value is None:
        return default
    target = positive_ms(value)
    if target is None:
        invalid(key, value)
        return default
    return target


#: How many (request, target name) pairs ``InvalidTargetWarnings`` remembers.
REMEMBERED_INVALID_TARGETS = 4096


class InvalidTargetWarnings:
    """Warns of a client's invalid per-request target once per request and target name.

    The adapters read a request's targets on every step it is in (``request_target_ms``), so one bad request
    would otherwise put a warning in the server's log every step until it ends. Each adapter holds one,
    called on the engine's scheduler thread; it remembers the last ``REMEMBERED_INVALID_TARGETS`` pairs and
    forgets the oldest first, so clients sending many bad requests cannot make it grow.
    """

    def __init__(self, warn: Callable[[str, str, Any], None]) -> None:
        self._warn = warn  # (request id, target name, value): the adapter's own words
        self._warned: dict[tuple[str, str], None] = {}  # insertion-ordered: oldest first

    def __call__(self, rid: str, key: str, value: Any) -> None:
        if (rid, key) in self._warned:
            return
        self._warned[rid, key] = None
        if len(self._warned) > REMEMBERED_INVALID_TARGETS:
            del self._warned[next(iter(self._warned))]
        self._warn(rid, key, value)


def positive_ms(value: Any) -> float | None:
    """A per-request target (``itl_target_ms``, ...) as a positive number of milliseconds, None
    when it is not one (the adapters then keep the server's target and log a warning)."""
    try:
        target = float(value)
    except (TypeError, ValueError):
        return None
    return target if target > 0 else None


def tightened_ms(own: float, server: float) -> float:
    """A request's own target where the server's is optional (``tpot_target_ms``: 0 = none): its own,
    never looser than the server's."""
    return min(own, server) if server else own


def align_up(tokens: int, align: int) -> int:
    """``tokens`` rounded up to a multiple of ``align`` (chunks are multiples of the alignment)."""
    return -(-tokens // align) * align
