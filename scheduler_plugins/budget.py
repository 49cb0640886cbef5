"""Per-iteration token budget and prefill order: the policy, independent of any engine.

The adapter (``scheduler_plugins.vllm``, ``scheduler_plugins.sglang``) describes the step it is about to
build (how many decodes run and their context, where the next prefill chunk starts), asks ``prefill_chunk``
how many prefill tokens to add (``prefill_chunk`` for the ITL target, ``deadline_chunk`` and
``admission_chunk`` for the TTFT deadlines), and asks ``deadline_order`` in which order to serve prefills.

Guarantees the tests check:
- the chunk is a multiple of the alignment (the KV block size), except that it never exceeds the engine cap,
  and is the whole room the cap leaves when that fits the target;
- the chunk is at least ``min_chunk`` whenever the engine cap allows, even when the decodes alone already
  exceed the target: every pending prefill makes progress each step, so nothing starves; and when that
  minimum is over the target, the chunk is the largest predicted within ``lost_slack`` of its step time;
- otherwise the chunk is the largest aligned size whose predicted step time stays within the target;
- a step with no decode in it is held to a share of the TTFT target, not to the ITL target (``step_limit_s``),
  unless a second pending prompt can get its first token from a step within the ITL limit
  (``lone_step_chunk``);
- with TPOT targets, the step's time limit is also at most what every decode's mean gap can afford
  (``tpot_limit_s``);
- ``deadline_chunk`` is the smallest aligned chunk with which the pending prefills, one after another, are
  predicted to end by their TTFT deadlines (those no chunk the step can take would save left out; 0 when
  none is left), and ``admission_chunk`` the smallest with which waiting prompts are admitted whole beside
  the prefill under way; the adapter takes the largest of these and ``prefill_chunk``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from scheduler_plugins.config import align_up
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
            prefill_depth=self.prefill_cached if chunk else 0.0,
        )


def step_limit_s(plan: StepPlan, itl_limit_s: float, chunk_lone_prefill: bool, lone_limit_s: float) -> float:
    """How long the step may take: ``itl_limit_s`` (headroom x the ITL target) when a decode shares it.

    With no decode in the step (``plan.decodes == 0``: no stream running and, on a decode node, no remote
    load waiting) no client is between two tokens, so the ITL target does not hold it: chunking a lone
    prefill to it only slows it, each chunk paying the step's fixed cost (docs/scheduler.md, Budget). But a
    request arriving during the step waits for all of it, so the step is held to ``lone_limit_s`` (a share
    of the TTFT target, ``SchedulerSettings.lone_step_limit_s``; never below the ITL limit; ``inf``: the
    whole room the engine cap leaves). ``chunk_lone_prefill`` keeps the ITL limit, for servers where a
    request arriving mid-prefill must start within one small step.
    """
    if plan.decodes or chunk_lone_prefill:
        return itl_limit_s
    return max(itl_limit_s, lone_limit_s)


@dataclass(frozen=True)
class DecodeTrack:
    """A running decode's account against its TPOT target (the mean gap over its whole answer)."""

    target_s: float  # its TPOT target
    gaps: int  # gaps since its first token (output tokens - 1)
    elapsed_s: float  # since its first token
    remaining: int  # tokens it may still produce (max_tokens - output tokens; >= 1 while it runs)

    @classmethod
    def of(cls, target_ms: float, produced: int, max_tokens: int, elapsed_s: float) -> DecodeTrack:
        """From what an engine holds of a decode: ``produced`` output tokens of at most ``max_tokens``,
        the first of them ``elapsed_s`` ago."""
        return cls(target_ms / 1e3, max(0, produced - 1), elapsed_s, max(1, max_tokens - produced))


class FirstTokens:
    """When each running decode's first token came out, for its ``DecodeTrack``. An adapter notes its
    decodes every step, planned or not (a decode's first token came out in the step before the first one
    that finds it decoding; noting only on planned steps would start an account late and count a decode
    that ran alone as early in its answer), and forgets the requests that left."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def note(self, decoding: Iterable[str], now: float, gone: Callable[[str], bool]) -> None:
        for request_id in [r for r in self._at if gone(r)]:
            del self._at[request_id]
        for request_id in decoding:
            self._at.setdefault(request_id, now)

    def elapsed_s(self, request_id: str, now: float) -> float:
        """Since the decode's first token; 0 for one not noted yet."""
        return now - self._at.get(request_id, now)


def tpot_limit_s(tracks: Iterable[DecodeTrack], decode_step_s: float, headroom: float) -> float:
    """The longest next step with which every running decode's mean gap can still end within ``headroom`` x
    its TPOT target, if each of its later steps takes ``decode_step_s`` (the decodes alone); ``inf`` when no
    decode has a target. A decode that no step could bring within its target (too late even at the
    decodes' own pace) is left out: holding every step back for it would not save it.

    Why: a TPOT target is a mean over the answer. A per-gap limit (the ITL target) set to it spends the whole
    allowance on every step that carries a chunk, so the mean ends near the target, and vLLM's own scheduler,
    one long stall and then fast steps, met the mean more often (docs/performance.md ``## goodput``,
    mixed). The slack each decode has left lets a step be long while every decode beside it can afford it,
    and short when one cannot. A decode that ends before ``max_tokens`` (EOS) has fewer fast steps than
    counted.
    """
    limit = math.inf
    for track in tracks:
        later = max(0, track.remaining - 1)
        allowed = (
            headroom * track.target_s * (track.gaps + track.remaining)
            - track.elapsed_s
            - later * decode_step_s
        )
        if allowed >= decode_step_s:
            limit = min(limit, allowed)
    return limit


def prefill_chunk(
    model: CostModel, plan: StepPlan, limit_s: float, align: int, min_chunk: int, lost_slack: float = 0.0
) -> int:
    """Largest ``align``-multiple chunk with predicted step time <= ``limit_s``, at least ``min_chunk``.

    When even ``min_chunk`` is predicted over ``limit_s``, this step's gap is lost whatever the chunk: the
    limit becomes the minimum chunk's step time times ``1 + lost_slack``, so the chunk grows while the step
    stays within that fraction of the shortest it can be. Where a step's cost hardly depends on its chunk
    (SGLang CPU deep in a prompt: its fixed and depth costs dominate) that prefills the prompt in far fewer
    such slow steps for a gap that much longer; 0 keeps the minimum chunk.

    Binary search over multiples of ``align``: ``model.predict`` is non-decreasing in the chunk size.
    """
    if align <= 0 or min_chunk <= 0:
        raise ValueError(f"align and min_chunk must be positive, got {align}, {min_chunk}")
    room = plan.max_step_tokens - plan.decodes
    if room <= 0:
        return 0
    limit_s = working_limit_s(model, plan, limit_s, min_chunk, lost_slack)
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


def lone_step_chunk(
    model: CostModel,
    plan: StepPlan,
    first: int,
    behind: int,
    limit_s: float,
    min_chunk: int,
    align: int,
    admits_beside: bool,
) -> int:
    """The chunk of a step with no decode in it that gives a second pending prompt its first token within
    ``limit_s`` (the ITL limit); 0 when no such step does, and the prefill first in line then takes the lone
    step's larger limit (``step_limit_s``). ``first``: the tokens the step's first prefill still has to
    compute; ``behind``: the whole prompt waiting next in serving order (0: none). Either ``first`` ends
    within such a step (the chunk is its rest; the engine gives what the chunk leaves to the prompt behind),
    or, where the engine admits a waiting prompt beside the first with a per-request cap (``admits_beside``:
    vLLM's ``partial_share``), ``behind`` is admitted whole beside the minimum chunk (``admission_chunk``).

    Why: with nothing decoding a step has no gap to keep short, so it is far longer than the ITL target (up
    to the whole cap); but every prompt in it gets its first token only at its end. With a short prompt and a
    long one pending at once (a new stream's prompt and a document, either first), such a step holds the
    short prompt's first token as long, where a step of the ITL size starts it, and its decodes then size
    the long prompt's chunks as beside any stream. When neither prompt can start within the limit, chunking
    would only slow both: none is started sooner.
    """
    room = plan.max_step_tokens - plan.decodes
    if plan.decodes or first <= 0 or behind <= 0 or room <= 0:
        return 0
    if first <= room and model.predict(plan.shape(first)) <= limit_s:
        return first
    if not admits_beside:
        return 0
    chunk = admission_chunk([behind], min_chunk, align, room)
    return chunk if chunk and model.predict(plan.shape(chunk)) <= limit_s else 0


def working_limit_s(
    model: CostModel, plan: StepPlan, limit_s: float, min_chunk: int, lost_slack: float
) -> float:
    """The limit ``prefill_chunk`` sizes the chunk to: ``limit_s``, or, when even the minimum chunk's step is
    predicted over it (the step's target is lost), that step's time x ``1 + lost_slack``. The adapters log it
    beside ``limit_s`` on such steps (``explain``), whose ``predicted_ms`` is over ``limit_ms`` by design."""
    room = plan.max_step_tokens - plan.decodes
    shortest_s = model.predict(plan.shape(max(0, min(room, min_chunk))))
    return shortest_s * (1 + lost_slack) if shortest_s > limit_s else limit_s


# How many pending prefills, in serving order, the adapters pass to ``deadline_chunk``: those further back are
# counted once they near the front, and a step's planning stays short however long the queue.
FLOOR_LOOKAHEAD = 32


@dataclass(frozen=True)
class PendingPrefill:
    """A prefill still to run, as ``deadline_chunk`` sees it (the adapter reads it from the queues)."""

    remaining: int  # prompt tokens still to compute
    cached: int  # tokens already computed (a waiting request's prefix-cache hit is not known yet: 0)
    time_left_s: float  # to its TTFT deadline, headroom applied; negative once it passed


def deadline_chunk(model: CostModel, plan: StepPlan, pending: Sequence[PendingPrefill], align: int) -> int:
    """Smallest ``align``-multiple chunk with which every pending prefill, served one after another in the
    given order, is predicted to end by its TTFT deadline, the decodes staying as they are; a prefill whose
    deadline no chunk the step can take would meet is left out (its work still delays those after it), and
    0 when that leaves none (the ITL target alone then sizes the chunk).

    Why: chunks sized to the ITL target alone made a long prompt beside running streams take as many steps as
    the target allowed, however late its first token got. Raising every remaining chunk evenly to this size
    meets the deadlines with the smallest steps that can, so the streams' gaps grow as little as needed. All
    pending prefills count, not only the one under way: sized for its own deadline alone, a prefill took all
    the time to it, and a prompt arriving meanwhile started too late for its own.
    Prefill ``j`` ends after the prompt tokens of prefills ``0..j`` are computed; in ``n`` steps that is
    predicted as ``n`` x the decode part of a step plus their own work, which does not depend on the chunking:
    the model is linear in the step's shape, and the attended pairs of a prompt's chunks add up to its whole.
    """
    room = plan.max_step_tokens - plan.decodes
    if room <= 0 or align <= 0:
        return 0
    per_step = model.predict(plan.shape(0))
    nothing = model.predict(StepShape(0, 0, 0.0))
    tokens, work, floor = 0, 0.0, 0
    for prefill in pending:
        if prefill.remaining <= 0:
            continue
        tokens += prefill.remaining
        work += (
            model.predict(StepShape(prefill.remaining, 0, attended_pairs(prefill.remaining, prefill.cached)))
            - nothing
        )
        spare = prefill.time_left_s - work
        if spare < per_step:
            continue  # lost whatever this step does
        steps = int(spare // per_step) if per_step > 0 else tokens  # >= 1: spare >= per_step
        chunk = -(-tokens // steps)
        chunk = align_up(chunk, align)
        if chunk > room:
            chunk = room if room >= tokens else 0
        floor = max(floor, chunk)
    return floor


def admission_chunk(prompts: Iterable[int], min_chunk: int, align: int, room: int) -> int:
    """The chunk with which ``partial_share`` admits the leading ``prompts`` (waiting, whole prompt lengths,
    in serving order) in this step beside the prefill under way, as many as the ``room`` allows; 0: none.

    Why: the engine serves the prefill under way before any waiting prompt, and ``partial_share`` admits a
    waiting prompt only where it fits whole beside the prefill's own share (at least ``min_chunk``, and at
    least the prompt, so that the engine's per-request cap does not cut it). A short prompt whose TTFT
    deadline comes before that prefill's would otherwise wait for the ITL-sized chunks of the whole prompt
    under way, however tight its own deadline.
    """
    admitted, largest, chunk = 0, 0, 0
    for tokens in prompts:
        if tokens <= 0:
            continue
        largest = max(largest, tokens)
        need = admitted + tokens + max(min_chunk, largest)
        if need > room:
            break
        admitted, chunk = admitted + tokens, min(room, align_up(need, align))
    return chunk


@dataclass(frozen=True)
class WaitingPrompt:
    """A waiting request as ``urgent_count`` sees it (the adapter reads it from the queue)."""

    tokens: int  # its whole prompt, to compute
    time_left_s: float  # to its TTFT deadline, headroom applied; negative once it passed


def urgent_count(
    model: CostModel,
    plan: StepPlan,
    waiting: Iterable[WaitingPrompt],
    under_way_time_left_s: float,
    min_chunk: int,
    align: int,
) -> int:
    """How many leading ``waiting`` prompts (deadline order) to admit whole beside the prefill under way in
    this step (``admission_chunk`` sizes it), rather than after that prefill's whole prompt.

    A prompt is urgent when it is due before the prefill under way, or whenever that prefill's own deadline
    has passed (its first token is late whatever happens now, and a prompt that can still be on time should
    not wait for all of it). It must not be late itself, and the step that admits it (with the urgent
    prompts before it) must be predicted to end within the time left of each of them: a prompt that would
    miss its deadline anyway would only stretch the decodes' step. The first prompt that is not urgent ends
    the count (the engine takes waiting prompts in queue order), and ``waiting`` is read no further.
    """
    room = plan.max_step_tokens - plan.decodes
    prompts: list[int] = []
    least_left_s = math.inf  # the tightest deadline among the prompts counted so far
    for w in waiting:
        if w.time_left_s <= 0 or 0 < under_way_time_left_s <= w.time_left_s:
            break
        prompts.append(w.tokens)
        least_left_s = min(least_left_s, w.time_left_s)
        chunk = admission_chunk(prompts, min_chunk, align, room)
        if partial_share(chunk, prompts, min_chunk) != chunk - sum(prompts):
            return len(prompts) - 1  # the room cannot hold them all
        if model.predict(plan.shape(chunk)) > least_left_s:
            return len(prompts) - 1
    return len(prompts)


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
    admitted, largest = 0, 0
    for tokens in waiting_prompts:
        if tokens <= 0:
            continue
        # The share left must still hold every prompt admitted so far, not only this one.
        if admitted + tokens > chunk - max(min_chunk, largest, tokens):
            break
        admitted, largest = admitted + tokens, max(largest, tokens)
    return chunk - admitted


T = TypeVar("T")


def deadline_order(items: Iterable[T], deadline: Callable[[T], float]) -> list[T]:
    """Earliest TTFT deadline first; ties keep arrival order (``sorted`` is stable).

    With deadline = arrival + target and targets bounded above, a waiting request is overtaken only by
    requests with a tighter target that arrived within that target's window, so each one is served in
    bounded time.
    """
    return sorted(items, key=deadline)


def explain(
    model: CostModel, plan: StepPlan, chunk: int, limit_s: float, working_s: float | None = None
) -> str:
    """One decision for the server log, in the words both adapters use (integration tests parse the log);
    ``working_s``: the limit the chunk was sized to (``working_limit_s``), shown when the target was lost."""
    a, b, c, d, e = model.coefficients_s
    lost = f"lost_limit_ms={working_s * 1e3:.1f} " if working_s is not None and working_s > limit_s else ""
    return (
        f"decodes={plan.decodes} predicted_ms={model.predict(plan.shape(chunk)) * 1e3:.1f} "
        f"limit_ms={limit_s * 1e3:.1f} {lost}fit(a_ms={a * 1e3:.2f} b_ms_per_tok={b * 1e3:.4f} "
        f"c_ms_per_dec={c * 1e3:.3f} d_ns_per_pair={d * 1e9:.3f} e_us_per_depth={e * 1e6:.2f}) "
        f"n={model.observations}"
    )
