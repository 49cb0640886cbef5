"""The pure parts of ``benchmarks.autoscale``: the traffic-shift workload, what each request and each replica
count sample records, and the figures computed from them (SLO attainment, goodput, replica-seconds, the
issue's targets). No Ray here: ``tests/test_bench_autoscale.py`` tests it all.

Definitions (per phase of one system's run):
- a request **attains** when it answered 200 with at least one token, its TTFT <= the TTFT SLO and its TPOT
  (time from the first to the last token over the tokens after the first; 0 for one token) <= the TPOT SLO;
  failed requests count as sent and not attained.
- **SLO attainment** = attained / sent. **Goodput** = attained / the phase's length (req/s).
- **replica-seconds** = the integral over the phase of the engine replicas holding an engine slot (any state
  but STOPPED: a starting or stopping replica holds its resources too; at most the cluster's slots, see
  ``holding``), from samples of the dashboard's replica lists (a step function: each sample holds until the
  next).
- **goodput per replica-second** = attained / replica-seconds (requests per replica-second).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import msgspec

#: The issue's targets: ours attains at least this in every phase...
ATTAINMENT_TARGET = 0.9
#: ... and its goodput per replica-second is at least these multiples of the static and Ray's policies.
VS_STATIC_TARGET = 1.3
VS_RAY_TARGET = 1.2


class Phase(msgspec.Struct, frozen=True):
    """One stretch of the workload: Poisson arrivals at ``rate_rps`` of prompts of ``prompt_tokens`` asking for
    ``max_tokens`` (generated in full: ``ignore_eos``)."""

    name: str
    duration_s: float
    rate_rps: float
    prompt_tokens: int
    max_tokens: int


#: Each phase's default arrival rate (req/s), in phase order.
RATES = (5.0, 3.0, 2.0)


def phases(short: bool, rates: Sequence[float] = RATES) -> tuple[Phase, ...]:
    """The traffic shift: long prompts (P-heavy, routed P->D), then long outputs of short prompts (D-heavy,
    routed to D alone), then short requests only (light), at ``rates``. The default rates load one P (long prompts: ~1.2x the tiny
    model's profiled prefill rate, 2818 tokens/s) and one D (long outputs: ~30 requests decoding at once) beyond
    what 1P1D serves well. ``short``: 60 s phases instead of 120 s, about what a replica takes to start here
    (40-80 s), so a replica started in one phase serves little of it."""
    if len(rates) != 3 or not all(r > 0 for r in rates):
        raise ValueError(f"need three positive rates (req/s), one per phase; got {list(rates)}")
    length = 60.0 if short else 120.0
    return (
        Phase("long_prompts", length, rate_rps=rates[0], prompt_tokens=700, max_tokens=16),
        Phase("long_outputs", length, rate_rps=rates[1], prompt_tokens=64, max_tokens=200),
        Phase("short_only", length, rate_rps=rates[2], prompt_tokens=32, max_tokens=16),
    )


def arrivals(phase: Phase, seed: int) -> list[float]:
    """Send times (s from the phase's start) of a Poisson process at the phase's rate, within its length; the
    same for every system (same seed)."""
    rng = random.Random(f"{seed}:{phase.name}")
    times, t = [], rng.expovariate(phase.rate_rps)
    while t < phase.duration_s:
        times.append(t)
        t += rng.expovariate(phase.rate_rps)
    return times


class Slo(msgspec.Struct, frozen=True):
    ttft_s: float
    tpot_s: float


class Record(msgspec.Struct, frozen=True):
    """One request as the client saw it. ``token_times_s``: arrival of each streamed piece of text, from send;
    ``tokens``: the tokens generated (the server's usage count: a piece may carry several tokens, and a token
    that ends inside a multi-byte character streams no text of its own); 0: one per piece."""

    phase: str
    sent_s: float
    status: int
    token_times_s: tuple[float, ...] = ()
    error: str = ""
    tokens: int = 0

    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    def tpot_s(self) -> float | None:
        times = self.token_times_s
        if not times:
            return None
        gaps = max(self.tokens, len(times)) - 1
        return (times[-1] - times[0]) / gaps if gaps > 0 else 0.0

    def attains(self, slo: Slo) -> bool:
        ttft, tpot = self.ttft_s(), self.tpot_s()
        return (
            self.status == 200
            and ttft is not None
            and tpot is not None
            and ttft <= slo.ttft_s
            and tpot <= slo.tpot_s
        )


class Sample(msgspec.Struct, frozen=True):
    """Engine replicas holding resources (any state but STOPPED) at ``t_s`` (s from the run's start)."""

    t_s: float
    prefill: int
    decode: int


def holding(states: dict[str, list[str]], slots: int) -> dict[str, int]:
    """Replicas per role that hold an engine slot, from their Serve states: all but STOPPED, at most ``slots``
    in all. Serve calls a replica waiting for resources STARTING, like one starting on its slot, so when more
    are listed than there are slots the excess are STARTING replicas: taken from the roles with STARTING
    replicas (decode's first), never from RUNNING or STOPPING ones."""
    held = {role: sum(s != "STOPPED" for s in listed) for role, listed in states.items()}
    excess = sum(held.values()) - slots
    for role in sorted(held, key=lambda r: r != "decode"):
        take = min(max(excess, 0), states[role].count("STARTING"))
        held[role] -= take
        excess -= take
    return held


def replica_seconds(samples: Sequence[Sample], start_s: float, end_s: float) -> dict[str, float]:
    """Each role's replica-seconds over [start_s, end_s]: each sample's counts hold until the next sample
    (the last until ``end_s``); before the first sample counts as the first. Samples must be in time order."""
    if not samples:
        raise ValueError("no replica samples")
    out = {"prefill": 0.0, "decode": 0.0}
    for i, s in enumerate(samples):
        begin = start_s if i == 0 else max(s.t_s, start_s)
        until = samples[i + 1].t_s if i + 1 < len(samples) else end_s
        span = min(until, end_s) - begin
        if span > 0:
            out["prefill"] += s.prefill * span
            out["decode"] += s.decode * span
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def phase_figures(
    records: Sequence[Record], samples: Sequence[Sample], phase: Phase, start_s: float, slo: Slo
) -> dict[str, float | int | None]:
    """Sent, failed, attainment, goodput and replica-seconds of one phase (which began at ``start_s``)."""
    mine = [r for r in records if r.phase == phase.name]
    attained = sum(r.attains(slo) for r in mine)
    seconds = replica_seconds(samples, start_s, start_s + phase.duration_s)
    total = seconds["prefill"] + seconds["decode"]
    ttfts = sorted(t for r in mine if (t := r.ttft_s()) is not None)
    return {
        "sent": len(mine),
        "failed": sum(r.status != 200 or not r.token_times_s for r in mine),
        "attained": attained,
        "slo_attainment": _ratio(attained, len(mine)),
        "goodput_rps": attained / phase.duration_s,
        "replica_s": total,
        "prefill_replica_s": seconds["prefill"],
        "decode_replica_s": seconds["decode"],
        "goodput_per_replica_s": _ratio(attained, total),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)] if ttfts else None,
    }


def totals(per_phase: dict[str, dict[str, float | int | None]]) -> dict[str, float | None]:
    """The whole run: attained over replica-seconds, summed over the phases."""
    attained = sum(float(p["attained"] or 0) for p in per_phase.values())
    seconds = sum(float(p["replica_s"] or 0) for p in per_phase.values())
    return {"attained": attained, "replica_s": seconds, "goodput_per_replica_s": _ratio(attained, seconds)}


def targets(systems: dict[str, dict[str, object]]) -> dict[str, object]:
    """The issue's targets for ``ours`` against ``static`` and ``ray`` (None: a system did not run)."""
    out: dict[str, object] = {}
    ours = systems.get("ours")
    if ours is None:
        return {"ours_attainment_every_phase": None, "vs_static": None, "vs_ray": None}
    phases_ = ours["phases"]
    assert isinstance(phases_, dict)
    worst = [p["slo_attainment"] for p in phases_.values()]
    out["ours_worst_phase_attainment"] = min((w for w in worst if w is not None), default=None)
    out["ours_attainment_every_phase"] = all(w is not None and w >= ATTAINMENT_TARGET for w in worst)
    for other, least in (("static", VS_STATIC_TARGET), ("ray", VS_RAY_TARGET)):
        mine = _per_replica_s(ours)
        theirs = _per_replica_s(systems[other]) if other in systems else None
        ratio = _ratio(mine, theirs) if mine is not None and theirs is not None else None
        out[f"vs_{other}"] = ratio
        out[f"vs_{other}_met"] = None if ratio is None else ratio >= least
    return out


def _per_replica_s(system: dict[str, object]) -> float | None:
    total = system["total"]
    assert isinstance(total, dict)
    value = total["goodput_per_replica_s"]
    return None if value is None else float(value)


def replica_changes(samples: Sequence[Sample]) -> list[list[float]]:
    """``[t_s, prefill, decode]`` at the first sample and at every sample whose counts differ from the one
    before: the run's scaling timeline."""
    out: list[list[float]] = []
    for i, s in enumerate(samples):
        if i == 0 or (s.prefill, s.decode) != (samples[i - 1].prefill, samples[i - 1].decode):
            out.append([round(s.t_s, 1), s.prefill, s.decode])
    return out


def report(
    short: bool, slo: Slo, workload: Sequence[Phase], systems: dict[str, dict[str, object]]
) -> dict[str, object]:
    """The benchmark's JSON: conditions, each system's figures and the targets."""
    return {
        "benchmark": "autoscale",
        "short": short,
        "slo": msgspec.to_builtins(slo),
        "phases": msgspec.to_builtins(list(workload)),
        "systems": systems,
        "targets": targets(systems),
    }
