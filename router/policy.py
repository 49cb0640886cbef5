"""Conditional disaggregation: decide per request whether it goes straight to D, P->D, or waits.

A policy is any object with ``decide(PolicyInput) -> Decision``; the router calls it once per request (in the
router process, after tokenizing) with the prompt length and a snapshot of both pools' loads. Policies are
pure functions of that input, so their boundaries are easy to test and new ones (queue-time aware) drop in
without touching the request path. With KV-aware routing (``[kv_routing]``) the decode worker is chosen
first (``CacheCost``, in ``Balancer.place_decode``) and the policy decides on the tokens it does not hold.
"""

from __future__ import annotations

import enum
from typing import Protocol

import msgspec

from router.config import PolicyConfig


class Route(enum.Enum):
    LOCAL = "local"  # straight to a decode worker, which prefills itself
    DISAGG = "disagg"  # prefill on P, KV pushed to D, D decodes
    WAIT = "wait"  # the workers it needs are saturated: wait for a slot instead of overloading one
    REJECT = "rejected"  # no usable worker of a pool the request needs: 503


class PoolLoad(msgspec.Struct, frozen=True):
    """Load of the healthy, non-draining workers of one pool."""

    workers: int = 0
    # Least outstanding prefill tokens over the pool's workers (P) / least active requests (D).
    min_outstanding_tokens: int = 0
    min_active: int = 0
    # Least active requests over the workers with no prefill leg in flight (None: every worker has one): what
    # ``ThresholdPolicy`` may lend a short request to (P pool only).
    lendable_min_active: int | None = None


class PolicyInput(msgspec.Struct, frozen=True):
    prompt_tokens: int
    prefill: PoolLoad
    decode: PoolLoad
    # False for a request the engine runs as several sequences (``Parsed.fan_out``): it cannot go P->D.
    one_sequence: bool = True
    # Leading prompt tokens the chosen decode worker holds in its prefix cache (KV-aware routing; else 0).
    cached_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)


class Decision(msgspec.Struct, frozen=True):
    route: Route
    # Why, for metrics and logs: short | lent | cached | long | disagg_only | fan_out | prefill_saturated |
    # no_prefill | decode_saturated | no_decode. LOCAL with ``lent`` runs on a prefill worker, not a decode one.
    reason: str


class Policy(Protocol):
    def decide(self, inp: PolicyInput) -> Decision: ...


class ThresholdPolicy:
    """Length threshold with a load-aware override.

    - No usable D: REJECT (503). Every D at ``decode_max_active``: WAIT (queue; the caller times out with 429).
    - Decode workers that cannot prefill alone (``decode_prefills`` False: SGLang): every request goes P->D.
      No usable P: REJECT (503); every P at ``prefill_saturated_tokens``: WAIT for one below it (429 after
      the queue timeout); else DISAGG. The proxy refuses requests of several sequences before asking.
    - Several sequences (``n`` > 1, a prompt list, beam search): LOCAL. The P/D legs carry one transfer id;
      vLLM would give each sequence its own engine request with that same id, so their KV would collide.
    - Prompt shorter than ``threshold_tokens``: LOCAL (a short prefill is cheap to piggyback on decode), on a
      prefill worker (reason ``lent``) when one has no prefill leg in flight and fewer requests than both
      ``lend_max_active`` and the least loaded D: P's capacity serves short requests instead of idling while
      no long prompt needs it (the cost: a lent request decodes beside the next long prompt's prefill there).
    - Uncached part (prompt less the chosen D's cached prefix) shorter than ``threshold_tokens``: LOCAL,
      reason ``cached`` (D computes the rest itself; shipping the whole prompt's KV from P would cost more).
    - No healthy P: LOCAL (D prefills itself rather than failing).
    - Every P at ``prefill_saturated_tokens`` and the least loaded D below ``decode_headroom_fraction`` of its
      capacity: LOCAL (D has spare capacity, queueing behind P would only add TTFT).
    - Otherwise DISAGG.
    """

    def __init__(self, cfg: PolicyConfig, decode_prefills: bool = True) -> None:
        self._cfg = cfg
        self._decode_prefills = decode_prefills

    def decide(self, inp: PolicyInput) -> Decision:
        cfg = self._cfg
        if inp.decode.workers == 0:
            return Decision(Route.REJECT, "no_decode")
        if inp.decode.min_active >= cfg.decode_max_active:
            return Decision(Route.WAIT, "decode_saturated")
        p_saturated = inp.prefill.min_outstanding_tokens >= cfg.prefill_saturated_tokens
        if not self._decode_prefills:
            if inp.prefill.workers == 0:
                return Decision(Route.REJECT, "no_prefill")
            if p_saturated:
                return Decision(Route.WAIT, "prefill_saturated")
            return Decision(Route.DISAGG, "disagg_only")
        if not inp.one_sequence:
            return Decision(Route.LOCAL, "fan_out")
        if inp.prompt_tokens < cfg.threshold_tokens:
            lendable = inp.prefill.lendable_min_active
            lend = lendable is not None and lendable < min(cfg.lend_max_active, inp.decode.min_active)
            return Decision(Route.LOCAL, "lent" if lend else "short")
        if inp.uncached_tokens < cfg.threshold_tokens:
            return Decision(Route.LOCAL, "cached")
        if inp.prefill.workers == 0:
            return Decision(Route.LOCAL, "no_prefill")
        if p_saturated and inp.decode.min_active < cfg.decode_headroom_fraction * cfg.decode_max_active:
            return Decision(Route.LOCAL, "prefill_saturated")
        return Decision(Route.DISAGG, "long")


class CacheCost(msgspec.Struct, frozen=True):
    """What sending a prompt to a worker is expected to cost, in prompt tokens of prefill work (lower wins).

    Used by ``Balancer.place_decode`` / ``place_prefill`` (router process, once per request) when KV-aware
    routing is on and some candidate holds a prefix of the prompt.

    - decode worker: ``uncached + load_tokens * active``. The tokens it does not hold must be prefilled (by P
      and shipped, or by D itself), and every request already running there slows this one's decode steps;
      ``load_tokens`` says how many prompt tokens one running request weighs as
      (``kv_routing.load_tokens``). With 0, the longest match always wins; large values approach least-loaded.
    - prefill worker: ``outstanding + uncached``: the prefill work queued before this prompt is done there
      (its leg's ``outstanding_tokens``), so a P that holds the prefix wins unless it is that much busier.
    """

    load_tokens: int

    def decode(self, prompt_tokens: int, cached_tokens: int, active: int) -> int:
        return max(0, prompt_tokens - cached_tokens) + self.load_tokens * active

    def prefill(self, prompt_tokens: int, cached_tokens: int, outstanding_tokens: int) -> int:
        return outstanding_tokens + max(0, prompt_tokens - cached_tokens)


def make_policy(cfg: PolicyConfig, decode_prefills: bool) -> Policy:
    """The policy named in the config (one today; the switch is where new ones are registered).

    ``decode_prefills``: whether decode workers can serve a request alone (``RouterConfig.decode_prefills``).
    """
    if cfg.name == "threshold":
        return ThresholdPolicy(cfg, decode_prefills)
    raise ValueError(f"unknown policy {cfg.name!r}")
