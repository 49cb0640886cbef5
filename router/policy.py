"""Conditional disaggregation: decide per request whether it goes straight to D, P->D, or waits.

A policy is any object with ``decide(PolicyInput) -> Decision``; the router calls it once per request (in the
router process, after tokenizing) with the prompt length and a snapshot of both pools' loads. Policies are
pure functions of that input, so their boundaries are easy to test and new ones (prefix-cache aware,
queue-time aware) drop in without touching the request path.
"""

from __future__ import annotations

import enum
from typing import Protocol

import msgspec

from router.config import PolicyConfig


class Route(enum.Enum):
    LOCAL = "local"  # straight to a decode worker, which prefills itself
    DISAGG = "disagg"  # prefill on P, KV pushed to D, D decodes
    WAIT = "wait"  # every decode worker is saturated: wait for a slot instead of overloading one


class PoolLoad(msgspec.Struct, frozen=True):
    """Load of the healthy, non-draining workers of one pool."""

    workers: int = 0
    # Least outstanding prefill tokens over the pool's workers (P) / least active requests (D).
    min_outstanding_tokens: int = 0
    min_active: int = 0


class PolicyInput(msgspec.Struct, frozen=True):
    prompt_tokens: int
    prefill: PoolLoad
    decode: PoolLoad
    # False for a request the engine runs as several sequences (``Parsed.fan_out``): it cannot go P->D.
    one_sequence: bool = True


class Decision(msgspec.Struct, frozen=True):
    route: Route
    # Why, for metrics and logs: short | long | fan_out | prefill_saturated | no_prefill | decode_saturated |
    # no_decode.
    reason: str


class Policy(Protocol):
    def decide(self, inp: PolicyInput) -> Decision: ...


class ThresholdPolicy:
    """Length threshold with a load-aware override.

    - No usable D, or every D at ``decode_max_active``: WAIT (queue; the caller times out with 429).
    - Several sequences (``n`` > 1, a prompt list, beam search): LOCAL. The P/D legs carry one transfer id;
      vLLM would give each sequence its own engine request with that same id, so their KV would collide.
    - Prompt shorter than ``threshold_tokens``: LOCAL (a short prefill is cheap to piggyback on decode).
    - No healthy P: LOCAL (D prefills itself rather than failing).
    - Every P at ``prefill_saturated_tokens`` and the least loaded D below ``decode_headroom_fraction`` of its
      capacity: LOCAL (D has spare capacity, queueing behind P would only add TTFT).
    - Otherwise DISAGG.
    """

    def __init__(self, cfg: PolicyConfig) -> None:
        self._cfg = cfg

    def decide(self, inp: PolicyInput) -> Decision:
        cfg = self._cfg
        if inp.decode.workers == 0:
            return Decision(Route.WAIT, "no_decode")
        if inp.decode.min_active >= cfg.decode_max_active:
            return Decision(Route.WAIT, "decode_saturated")
        if not inp.one_sequence:
            return Decision(Route.LOCAL, "fan_out")
        if inp.prompt_tokens < cfg.threshold_tokens:
            return Decision(Route.LOCAL, "short")
        if inp.prefill.workers == 0:
            return Decision(Route.LOCAL, "no_prefill")
        if (
            inp.prefill.min_outstanding_tokens >= cfg.prefill_saturated_tokens
            and inp.decode.min_active < cfg.decode_headroom_fraction * cfg.decode_max_active
        ):
            return Decision(Route.LOCAL, "prefill_saturated")
        return Decision(Route.DISAGG, "long")


def make_policy(cfg: PolicyConfig) -> Policy:
    """The policy named in the config (one today; the switch is where new ones are registered)."""
    if cfg.name == "threshold":
        return ThresholdPolicy(cfg)
    raise ValueError(f"unknown policy {cfg.name!r}")
