"""The pure arithmetic of ``benchmarks.goodput``: workloads, SLOs, per-request attainment, goodput and the JSON.

No servers and no I/O here (unit-tested in tests/test_bench_goodput.py). The benchmark process calls
``slos`` once per workload with the idle figures measured on the aggregated servers, ``score`` once per
``vllm bench serve`` result, ``goodput_rps`` on each system's sweep, and ``summarize`` at the end.

Definitions (DistServe's): a request attains the SLOs when its TTFT is within its class's TTFT SLO and its
TPOT (``(latency - ttft) / (output tokens - 1)``, as vLLM's ``--goodput`` computes it) within the TPOT SLO; a
failed request attains nothing. Attainment = attaining requests / requests sent. Goodput = the highest
request rate at which attainment is >= ``ATTAINMENT`` (90%), interpolated linearly between the last rate of
the sweep that holds it and the first that does not; 0 when the lowest rate run does not hold it; the
highest rate run when every rate holds it (then a lower bound, flagged ``capped``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

ATTAINMENT = 0.9


@dataclass(frozen=True)
class RequestClass:
    """Requests of one kind in a workload: ``share`` of them, ``prompt_tokens`` in, ``output_tokens`` out."""

    name: str
    share: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    classes: tuple[RequestClass, ...]
    rates: tuple[float, ...]  # default Poisson request rates of its sweep (requests/s), ascending

    def counts(self, n: int) -> dict[str, int]:
        """How many of ``n`` requests each class gets (shares rounded; the first class takes the remainder)."""
        rest = {c.name: round(c.share * n) for c in self.classes[1:]}
        return {self.classes[0].name: n - sum(rest.values()), **rest}

    def class_of(self, prompt_len: int) -> RequestClass:
        """The class whose prompt length is nearest (vLLM reports each request's tokenized prompt length,
        which may differ from the class's by a few tokens of text round-tripping)."""
        return min(self.classes, key=lambda c: abs(c.prompt_tokens - prompt_len))


# A document: ISL:OSL 10:1, as long as the test model's 2048 positions allow (the bench model's 2000-token
# prompts take ~70 s to prefill on an AVX2-only CPU in bfloat16; docs/performance.md ``## goodput``).
LONG = RequestClass("long", 0.4, 1800, 180)
SHORT = RequestClass("short", 0.6, 128, 128)  # a chat turn
WORKLOADS = {
    "long": Workload("long", (RequestClass("long", 1.0, 1800, 180),), (0.125, 0.25, 0.5, 1.0)),
    "mixed": Workload("mixed", (SHORT, LONG), (0.25, 0.5, 1.0, 2.0)),
    "short": Workload("short", (RequestClass("short", 1.0, 128, 128),), (1.0, 2.0, 4.0, 8.0)),
}


@dataclass(frozen=True)
class Slo:
    ttft_ms: dict[str, float]  # per request class
    tpot_ms: float

    def as_json(self) -> dict[str, Any]:
        return {
            "ttft_ms": {k: round(v, 1) for k, v in self.ttft_ms.items()},
            "tpot_ms": round(self.tpot_ms, 1),
        }


def slos(idle_ttft_ms: dict[str, float], idle_step_ms: float, scale: float) -> Slo:
    """SLOs at ``scale`` (k): TTFT = k x the class's idle TTFT, TPOT = k x an idle decode step."""
    if scale <= 0 or idle_step_ms <= 0 or any(v <= 0 for v in idle_ttft_ms.values()):
        raise ValueError(f"SLO scale and idle figures must be > 0: {scale}, {idle_ttft_ms}, {idle_step_ms}")
    return Slo({name: scale * ms for name, ms in idle_ttft_ms.items()}, scale * idle_step_ms)


def tpot_s(latency_s: float, ttft_s: float, output_tokens: int) -> float:
    """Time per output token after the first (vLLM's definition; 0 for a one-token answer)."""
    return (latency_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else 0.0


def attained(result: dict[str, Any], workload: Workload, slo: Slo) -> int:
    """Requests of one ``vllm bench serve --save-detailed`` result that met both SLOs."""
    good = 0
    for prompt_len, out, ttft, latency, error in zip(
        result["input_lens"],
        result["output_lens"],
        result["ttfts"],
        result["latencies"],
        result["errors"],
        strict=True,
    ):
        if error or not out:
            continue
        cls = workload.class_of(prompt_len)
        if 1000 * ttft <= slo.ttft_ms[cls.name] and 1000 * tpot_s(latency, ttft, out) <= slo.tpot_ms:
            good += 1
    return good


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def score(
    result: dict[str, Any], workload: Workload, slo_by_scale: dict[float, Slo], sent: int
) -> dict[str, Any]:
    """One run's figures: attainment per SLO scale (of ``sent`` requests), TTFT and ITL p50/p99, the worst
    inter-token gap (ms), and vLLM's own counts (failed requests, its ``--goodput`` figure)."""
    ttfts = [1000 * t for t, e in zip(result["ttfts"], result["errors"], strict=True) if not e]
    gaps = [1000 * g for itl in result["itls"] for g in itl]
    return {
        "sent": sent,
        "completed": int(result.get("completed", 0)),
        "failed": int(result.get("failed", sent)),
        "attainment": {
            str(k): round(attained(result, workload, slo) / sent, 4) for k, slo in slo_by_scale.items()
        },
        "ttft_p50_ms": round(percentile(ttfts, 0.5), 1),
        "ttft_p99_ms": round(percentile(ttfts, 0.99), 1),
        "itl_p50_ms": round(percentile(gaps, 0.5), 1),
        "itl_p99_ms": round(percentile(gaps, 0.99), 1),
        "worst_gap_ms": round(max(gaps, default=0.0), 1),
        "vllm_goodput_rps": result.get("request_goodput"),
        "duration_s": round(float(result.get("duration", 0.0)), 1),
    }


def failed_run(sent: int, why: str, scales: list[float]) -> dict[str, Any]:
    """A run that produced no result (``vllm bench serve`` timed out or crashed): every request failed."""
    return {
        "sent": sent,
        "completed": 0,
        "failed": sent,
        "attainment": {str(k): 0.0 for k in scales},
        "error": why,
    }


def stage_means(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per engine, the requests it finished between two ``System.stage_seconds`` reads and their mean queue,
    prefill and decode times (ms): queueing on P vs on D, P's prefill, D's wait for its first step."""
    out: dict[str, Any] = {}
    for role, b in before.items():
        a = after[role]
        n = a["requests"] - b["requests"]
        out[role] = {"requests": int(n)} | {
            key.replace("_s", "_ms_mean"): round(1000 * (a[key] - b[key]) / n, 1) if n else None
            for key in a
            if key != "requests"
        }
    return out


def goodput_rps(points: list[tuple[float, float]], target: float = ATTAINMENT) -> tuple[float, bool]:
    """Goodput from a sweep's (rate, attainment) points and whether it is capped by the highest rate run.

    First crossing from the lowest rate up: the rate where attainment falls below ``target``, interpolated
    between the neighbouring rates; 0 if the lowest rate already misses it."""
    if not points:
        raise ValueError("no sweep points")
    points = sorted(points)
    if points[0][1] < target:
        return 0.0, False
    for (r0, a0), (r1, a1) in itertools.pairwise(points):
        if a1 < target:
            return r0 + (a0 - target) / (a0 - a1) * (r1 - r0), False
    return points[-1][0], True


def ratio_terms(goodput: dict[str, float]) -> dict[str, tuple[float | None, float | None]]:
    """Numerator and denominator of the issue's ratios for one workload (``None`` for a system not run);
    ``best_ours`` is the best of ``pd``, ``pd_lend``, ``pd_lend_slo`` and ``aggregated_slo`` (what our router
    plus scheduler offer)."""
    ours = [goodput[s] for s in ("pd", "pd_lend", "pd_lend_slo", "aggregated_slo") if s in goodput]
    agg = goodput.get("aggregated")
    return {
        "pd_over_aggregated": (goodput.get("pd"), agg),
        "pd_over_nixl": (goodput.get("pd"), goodput.get("nixl")),
        "best_ours_over_aggregated": (max(ours) if ours else None, agg),
    }


def ratios(goodput: dict[str, float]) -> dict[str, float | None]:
    """The ratios, ``None`` where undefined (a system not run, or a denominator of 0 goodput)."""
    return {
        name: round(num / den, 3) if num is not None and den else None
        for name, (num, den) in ratio_terms(goodput).items()
    }


def target_met(goodput: dict[str, float], name: str, least: float) -> bool | None:
    """Whether ratio ``name`` is >= ``least`` (a positive numerator over 0 goodput is); ``None`` if a system
    of it was not run."""
    num, den = ratio_terms(goodput)[name]
    if num is None or den is None:
        return None
    return num > 0 and num >= least * den


#: (workload, ratio, at least) the issue's targets, at SLO scale 2.
TARGETS = (
    ("long", "pd_over_aggregated", 2.0),
    ("long", "pd_over_nixl", 1.2),
    ("mixed", "best_ours_over_aggregated", 1.5),
    ("short", "best_ours_over_aggregated", 0.95),
)


def summarize(
    runs: dict[str, dict[str, list[tuple[float, dict[str, Any]]]]],
    slo_by_workload: dict[str, dict[float, Slo]],
    scales: list[float],
    headline_scale: float,
) -> dict[str, Any]:
    """The benchmark's JSON (without ``conditions``) from every run: ``runs[workload][system]`` is the list
    of (rate, ``score``) in the order run. Headline figures at ``headline_scale``, every scale under
    ``by_slo_scale``; latency figures at ``at_rate_rps``, the highest rate every system of the workload ran."""
    out: dict[str, Any] = {"workloads": {}, "ratios": {}, "by_slo_scale": {}, "targets": {}}
    for k in scales:
        per_k: dict[str, Any] = {"workloads": {}, "ratios": {}}
        for wname, systems in runs.items():
            goodput, capped = {}, {}
            for system, points in systems.items():
                g, c = goodput_rps([(r, s["attainment"][str(k)]) for r, s in points])
                goodput[system], capped[system] = round(g, 3), c
            per_k["workloads"][wname] = {
                "slo": slo_by_workload[wname][k].as_json(),
                "goodput_rps": goodput,
                "capped": capped,
            }
            per_k["ratios"][wname] = ratios(goodput)
        out["by_slo_scale"][str(k)] = per_k
    head = out["by_slo_scale"][str(headline_scale)]
    out["ratios"] = head["ratios"]
    for wname, systems in runs.items():
        common = min(max(r for r, _ in points) for points in systems.values())
        at = {system: dict(points)[common] for system, points in systems.items()}
        entry = dict(head["workloads"][wname])
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "worst_gap_ms"):
            entry[key] = {system: s.get(key) for system, s in at.items()}
        entry["at_rate_rps"] = common
        entry["failed_requests"] = {s: sum(p["failed"] for _, p in pts) for s, pts in systems.items()}
        entry["runs"] = {s: [{"rate": r, **p} for r, p in pts] for s, pts in systems.items()}
        out["workloads"][wname] = entry
    for wname, name, least in TARGETS:
        if wname in runs:
            met = target_met(head["workloads"][wname]["goodput_rps"], name, least)
            if met is not None:
                out["targets"][f"{wname}.{name}>={least}"] = met
    failed = sum(n for w in out["workloads"].values() for n in w["failed_requests"].values())
    out["targets"]["zero_failed_requests"] = failed == 0
    return out
