"""Per-iteration token budget and prefill order: the policy, independent of any engine.

The adapter (``scheduler_plugins.vllm``, ``scheduler_plugins.sglang``) describes the step it is about to
build (how many decodes run and their context, where the next prefill chunk starts), asks ``prefill_chunk``
how many prefill tokens to add, and asks ``deadline_order`` in which order to serve waiting prefills on a
prefill node.

Guarantees the tests check:
- the chunk is a multiple of the alignment (the KV block size), except that it never exceeds the engine cap,
  and is the whole room the cap leaves when that fits the target;
- the chunk is at least ``min_chunk`` whenever the engine cap allows, even when the decodes alone already
  exceed the target: every pending prefill makes progress each step, so nothing starves;
- otherwise the chunk is the largest aligned size whose predicted step time stays within the target;
- a step with no decode in it has no time limit (``step_limit_s``), so its chunk is the whole room;
- ``deadline_chunk`` is the smallest aligned chunk with which the rest of a prefill is predicted to end by its
  TTFT deadline (the adapter takes the larger of it and ``prefill_chunk``); 0 when no chunk the step can
  take would do it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from scheduler_plugins.cost_model import CostModel, StepShape, attended_pairs


@dataclass(frozen=True)
class StepPlan:
    """The decode part of a step (already fixed) and where the next prefill chunk would start."""

    decodes: int
    decode_context: int  # sum of the decodes' cached tokens
    prefill_cached: int  # tokens already computed for the request that gets the chunk
    max_step_tokens: int  # the engine's hard per-step cap (e.g. vLLM's max_num_batched_tokens)

    def shape(self, chunk: int) -> StepShape:
        decode_pairs = self.decode_context + self.decodes  # each decode attends to its context + itself
        return StepShape(
            prefill_tokens=chunk,
            decodes=self.decodes,
            attended_context=decode_pairs + (attended_pairs(chunk, self.prefill_cached) if chunk else 0.0),
        )


def step_limit_s(plan: StepPlan, itl_limit_s: float, chunk_lone_prefill: bool) -> float:
    """How long the step may take: ``itl_limit_s`` (headroom x the ITL target) when a decode shares it.

    With no decode in the step (``plan.decodes == 0``: no stream running and, on a decode node, no remote
    load waiting) no client is between two tokens, so nothing limits the step and the prefill takes the
    whole room the engine cap leaves. Chunking a lone prefill to the ITL target only slows it: each chunk
    pays the step's fixed cost and re-reads the prompt's KV so far (docs/scheduler.md, Budget).
    ``chunk_lone_prefill`` keeps the ITL limit anyway, for servers where a request arriving mid-prefill must
    start within one small step.
    """
    if plan.decodes or chunk_lone_prefill:
        return itl_limit_s
    return math.inf


def prefill_chunk(model: CostModel, plan: StepPlan, limit_s: float, align: int, min_chunk: int) -> int:
    """Largest ``align``-multiple chunk with predicted step time <= ``limit_s``, at least ``min_chunk``.

    Binary search over multiples of ``align``: ``model.predict`` is non-decreasing in the chunk size.
    """
    if align <= 0 or min_chunk <= 0:
        raise ValueError(f"align and min_chunk must be positive, got {align}, {min_chunk}")
    room = plan.max_step_tokens - plan.decodes
    if room <= 0:
        return 0
    lo, hi = 0, room // align  # lo: known to fit (0 blocks always "fits": the floor is applied below)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.predict(plan.shape(mid * align)) <= limit_s:
            lo = mid
        else:
            hi = mid - 1
    if lo == room // align and room % align and model.predict(plan.shape(room)) <= limit_s:
        return room  # the whole room fits: the cap, not the alignment, bounds the chunk
    return min(room, max(lo * align, min_chunk))


def deadline_chunk(model: CostModel, plan: StepPlan, remaining: int, time_left_s: float, align: int) -> int:
    """Smallest ``align``-multiple chunk with which the ``remaining`` prompt tokens of the prefill under way
    are predicted to be computed within ``time_left_s`` (to its TTFT deadline), the decodes staying as they
    are; 0 when none fits the room the cap leaves (the deadline is lost whatever this step does, so the ITL
    target alone sizes the chunk) or nothing remains.

    Why: chunks sized to the ITL target alone made a long prompt beside running streams take as many steps as
    the target allowed, however late its first token got. Raising every remaining chunk evenly to this size
    meets the deadline with the smallest steps that can, so the streams' gaps grow as little as needed.
    The rest of the prefill in ``n`` steps is predicted as ``n`` x the decode part of a step plus the
    prefill's own work, which does not depend on the chunking: the model is linear in the step's shape, and
    the attended pairs of all chunks add up to those of the whole remainder.
    """
    room = plan.max_step_tokens - plan.decodes
    if remaining <= 0 or room <= 0 or align <= 0:
        return 0
    per_step = model.predict(plan.shape(0))
    nothing = model.predict(StepShape(0, 0, 0.0))
    prefill_work = (
        model.predict(StepShape(remaining, 0, attended_pairs(remaining, plan.prefill_cached))) - nothing
    )
    spare = time_left_s - prefill_work
    if spare < per_step:
        return 0
    steps = int(spare // per_step) if per_step > 0 else remaining  # >= 1: spare >= per_step
    chunk = -(-remaining // steps)
    chunk = -(-chunk // align) * align
    if chunk > room:
        return room if room >= remaining else 0
    return chunk


def partial_share(chunk: int, waiting_prompts: Iterable[int], min_chunk: int) -> int:
    """How many of the step's ``chunk`` prefill tokens the prefill under way may take, so that waiting
    requests whose whole prompt fits the rest are admitted in the same step (FCFS, until one does not fit).

    Why: the engine serves its running requests before its waiting ones, so a long prompt's chunk would take
    the whole budget and every request arriving during its prefill (e.g. a new stream's short prompt) would
    wait for the whole prompt. Each admitted prompt must fit in the share too (the engine applies one
    per-request cap, ``long_prefill_token_threshold``, to all prefills, and a short prompt cut by it would
    then wait behind the long one), and the share is at least ``min_chunk``: the prompt under way always
    moves on. Returns ``chunk`` when nothing fits.
    """
    admitted = 0
    for tokens in waiting_prompts:
        if tokens <= 0:
            continue
        if admitted + tokens > chunk - max(min_chunk, tokens):
            break
        admitted += tokens
    return chunk - admitted


T = TypeVar("T")


def deadline_order(items: Iterable[T], deadline: Callable[[T], float]) -> list[T]:
    """Earliest TTFT deadline first; ties keep arrival order (``sorted`` is stable).

    With deadline = arrival + target and targets bounded above, a waiting request is overtaken only by
    requests with a tighter target that arrived within that target's window, so each one is served in
    bounded time.
    """
    return sorted(items, key=deadline)


def explain(model: CostModel, plan: StepPlan, chunk: int, limit_s: float) -> str:
    """One decision for the server log, in the words both adapters use (integration tests parse the log)."""
    a, b, c, d = model.coefficients_s
    return (
        f"decodes={plan.decodes} predicted_ms={model.predict(plan.shape(chunk)) * 1e3:.1f} "
        f"limit_ms={limit_s * 1e3:.1f} fit(a_ms={a * 1e3:.2f} b_ms_per_tok={b * 1e3:.4f} "
        f"c_ms_per_dec={c * 1e3:.3f} d_ns_per_pair={d * 1e9:.3f}) n={model.observations}"
    )
