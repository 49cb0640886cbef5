"""Planning formulas: achievable prefill and decode throughput under the SLOs, the P/D ratio and instance counts.

Pure functions of a ``Profile`` and a ``Workload`` (no I/O), called by ``planner.cli`` and the tests. The
default method is the paper's (arXiv 2603.04716; docs/planner.md ``## Method`` explains each step):

- prefill as an M/M/1 queue, TTFT = T_ovh + 1/(mu - lambda), mu = TP_max / L_in, so the prefill throughput
  that keeps the mean TTFT at the SLO is TP_prefill = TP_max - L_in / (TTFT - T_ovh);
- decode throughput read at the TPOT SLO from a quadratic fit of throughput (batch / TPOT) against TPOT;
- N_P = TP * L_in / ((L_in + L_out) * TP_prefill), N_D = TP * L_out / ((L_in + L_out) * TP_decode).

Alternatives users know: DistServe's M/D/1 prefill (deterministic service; mean wait rho*D / (2 (1 - rho)))
and AIConfigurator-style rate matching (profiled maxima times efficiency factors, 0.9 prefill / 0.92 decode).
"""

from __future__ import annotations

import enum
import math

import msgspec
import numpy as np

from planner.profile import Profile

# AIConfigurator-style rate matching scales the profiled maxima by these factors.
DEFAULT_PREFILL_EFFICIENCY = 0.9
DEFAULT_DECODE_EFFICIENCY = 0.92
# Counts within this of an integer are that integer (3.0000000004 instances is 3, not 4).
_ROUND_TOLERANCE = 1e-9


# The ``pd-plan --json`` line: these keys, in this order (the documented format).
PLAN_JSON_FIELDS = (
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "pd_ratio",
    "prefill_instances_exact",
    "decode_instances_exact",
    "prefill_instances",
    "decode_instances",
)


class Method(enum.StrEnum):
    """How prefill (and, for rate matching, decode) throughput under the SLOs is derived."""

    MM1 = "mm1"
    MD1 = "md1"
    RATE_MATCH = "rate-match"


class InfeasibleError(ValueError):
    """No number of instances meets the SLOs; the message says which SLO and what is achievable."""


class Workload(msgspec.Struct, frozen=True):
    """What the cluster must serve: total tokens/s (input + output), mean lengths, and the SLOs (seconds)."""

    throughput_tokens_per_s: float
    isl: float
    osl: float
    ttft_s: float
    tpot_s: float

    @property
    def request_rate(self) -> float:
        """Requests per second implied by the token throughput and the mean lengths."""
        return self.throughput_tokens_per_s / (self.isl + self.osl)


class Plan(msgspec.Struct, frozen=True):
    """The planner's answer; the first seven fields are the ``--json`` line the CLI prints."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    pd_ratio: float
    prefill_instances_exact: float
    decode_instances_exact: float
    prefill_instances: int
    decode_instances: int
    method: Method
    min_ttft_s: float
    request_rate: float
    prefill_load_tokens_per_s: float
    prefill_utilization: float
    predicted_ttft_s: float
    decode_load_tokens_per_s: float
    decode_streams_per_instance: float
    notes: tuple[str, ...] = ()

    def summary(self) -> dict[str, float | int]:
        """The seven headline figures, in the documented order."""
        return {name: getattr(self, name) for name in PLAN_JSON_FIELDS}


def min_ttft_s(profile: Profile, isl: float) -> float:
    """TTFT of a request that finds the prefill instance idle: its service time plus the overhead."""
    return isl / profile.prefill_max_tokens_per_s + profile.ttft_overhead_s


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def prefill_tokens_per_s(
    profile: Profile,
    isl: float,
    ttft_s: float,
    method: Method = Method.MM1,
    efficiency: float = DEFAULT_PREFILL_EFFICIENCY,
) -> float:
    """Prefill tokens/s one P instance sustains with its mean TTFT at ``ttft_s``.

    Raises ``InfeasibleError`` when the SLO is not above the unloaded TTFT, the least any load can achieve.
    """
    _check_positive(isl=isl, ttft_s=ttft_s)
    tp_max = profile.prefill_max_tokens_per_s
    floor = min_ttft_s(profile, isl)
    if ttft_s <= floor:
        raise InfeasibleError(
            f"TTFT SLO {ttft_s:g} s is not above the minimum achievable TTFT {floor:.4g} s at {isl:g} input "
            f"tokens (prefill {isl / tp_max:.4g} s at {tp_max:.4g} tokens/s + overhead "
            f"{profile.ttft_overhead_s:.4g} s): relax the TTFT SLO, shorten prompts, or use faster P instances"
        )
    if method is Method.MM1:
        return tp_max - isl / (ttft_s - profile.ttft_overhead_s)
    if method is Method.MD1:
        service = isl / tp_max
        wait = ttft_s - profile.ttft_overhead_s - service
        rho = 2 * wait / (service + 2 * wait)
        return rho * tp_max
    return tp_max * efficiency


def decode_tokens_per_s(
    profile: Profile,
    tpot_s: float,
    method: Method = Method.MM1,
    efficiency: float = DEFAULT_DECODE_EFFICIENCY,
) -> tuple[float, list[str]]:
    """Decode tokens/s one D instance sustains at TPOT ``tpot_s``, and notes on how it was read.

    Fits throughput (batch / TPOT) as a quadratic in TPOT (lower degree with fewer than three points) and
    evaluates it at the SLO, clamped to the measured range: the fit is not trusted outside it.
    """
    _check_positive(tpot_s=tpot_s)
    points = profile.sorted_decode()
    tpots = np.array([p.tpot_s for p in points])
    throughputs = np.array([p.batch / p.tpot_s for p in points])
    notes: list[str] = []
    if tpot_s < tpots[0]:
        raise InfeasibleError(
            f"TPOT SLO {tpot_s * 1e3:g} ms is below the minimum measured TPOT {tpots[0] * 1e3:.4g} ms "
            f"(batch {points[0].batch}): no batch size decodes that fast; relax the TPOT SLO or use faster "
            f"D instances"
        )
    if tpot_s >= tpots[-1]:
        value = float(throughputs[-1])
        if tpot_s > tpots[-1]:
            notes.append(
                f"TPOT SLO is above the largest measured TPOT ({tpots[-1] * 1e3:.4g} ms at batch "
                f"{points[-1].batch}); decode throughput capped at that point (profile larger batches to use "
                f"the headroom)"
            )
    elif len(points) == 1:
        value = float(throughputs[0])
    else:
        degree = min(2, len(points) - 1)
        coefficients = np.polyfit(tpots, throughputs, degree)
        fitted = float(np.polyval(coefficients, tpot_s))
        value = min(max(fitted, float(throughputs.min())), float(throughputs.max()))
    if method is Method.RATE_MATCH:
        value *= efficiency
    return value, notes


def whole(count: float) -> int:
    """Instances to buy for a fractional need: round up, at least one."""
    return max(1, math.ceil(count - _ROUND_TOLERANCE))


def mm1_ttft_s(profile: Profile, isl: float, prefill_load_tokens_per_s: float) -> float:
    """Mean TTFT of one M/M/1 prefill instance at this load (infinite when it is saturated)."""
    mu = profile.prefill_max_tokens_per_s / isl
    lam = prefill_load_tokens_per_s / isl
    return profile.ttft_overhead_s + 1 / (mu - lam) if lam < mu else math.inf


def plan(
    profile: Profile,
    workload: Workload,
    method: Method = Method.MM1,
    prefill_efficiency: float = DEFAULT_PREFILL_EFFICIENCY,
    decode_efficiency: float = DEFAULT_DECODE_EFFICIENCY,
) -> Plan:
    """Size the P and D pools for ``workload``; raises ``InfeasibleError`` with the reason when none can."""
    _check_positive(
        throughput_tokens_per_s=workload.throughput_tokens_per_s,
        isl=workload.isl,
        osl=workload.osl,
        ttft_s=workload.ttft_s,
        tpot_s=workload.tpot_s,
    )
    notes: list[str] = []
    if profile.isl is not None and abs(profile.isl - workload.isl) > 0.25 * workload.isl:
        notes.append(
            f"profile prefill was measured at {profile.isl} input tokens, the workload has {workload.isl:g}: "
            f"re-profile at the workload's length for an accurate prefill throughput"
        )
    tp_prefill = prefill_tokens_per_s(profile, workload.isl, workload.ttft_s, method, prefill_efficiency)
    tp_decode, decode_notes = decode_tokens_per_s(profile, workload.tpot_s, method, decode_efficiency)
    notes.extend(decode_notes)
    total_len = workload.isl + workload.osl
    prefill_need = workload.throughput_tokens_per_s * workload.isl / total_len
    decode_need = workload.throughput_tokens_per_s * workload.osl / total_len
    n_p_exact = prefill_need / tp_prefill
    n_d_exact = decode_need / tp_decode
    n_p, n_d = whole(n_p_exact), whole(n_d_exact)
    prefill_load = prefill_need / n_p
    decode_load = decode_need / n_d
    return Plan(
        prefill_tokens_per_s=tp_prefill,
        decode_tokens_per_s=tp_decode,
        pd_ratio=(workload.isl * tp_decode) / (workload.osl * tp_prefill),
        prefill_instances_exact=n_p_exact,
        decode_instances_exact=n_d_exact,
        prefill_instances=n_p,
        decode_instances=n_d,
        method=method,
        min_ttft_s=min_ttft_s(profile, workload.isl),
        request_rate=workload.request_rate,
        prefill_load_tokens_per_s=prefill_load,
        prefill_utilization=prefill_load / profile.prefill_max_tokens_per_s,
        predicted_ttft_s=mm1_ttft_s(profile, workload.isl, prefill_load),
        decode_load_tokens_per_s=decode_load,
        decode_streams_per_instance=decode_load * workload.tpot_s,
        notes=tuple(notes),
    )
