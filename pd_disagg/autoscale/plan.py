"""How many P and D replicas the live workload needs: ``planner.tails`` on the estimated distributions.

Called by the controller once per interval with the window's ``Estimate``. The per-replica capacities are the
planner's percentile sizing (docs/planner.md, ``pd-plan trace``): a P replica takes
``tails.prefill_rate(profile, prompt lengths, TTFT SLO, q)`` requests/s (M/G/1 with the lognormal prompt
lengths: long prompts count twice, as wait and as service), a D replica ``tails.decode_rate(profile, output
lengths, TPOT SLO, q)`` (Little's law with the batch's percentile on the profile's TPOT curve). Not the mean
lengths: a mean-only plan (Dynamo's) misses percentile SLOs under long-tailed lengths (docs/planner.md).

Start time: a replica ordered now serves ``replica_start_s`` later, so the plan sizes for the larger of the
rate now and the rate extrapolated that far ahead along the estimate's trend (never lower: a falling trend
does not remove replicas before the load has fallen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pd_disagg.autoscale.estimate import Estimate
from planner import tails
from planner.model import InfeasibleError
from planner.profile import Profile
from planner.trace import Lognormal

# A need within this of a whole number is that number (3.0000000004 replicas is 3).
_ROUND_TOLERANCE = 1e-9


@dataclass(frozen=True)
class RolePlan:
    """Replicas a role needs (None: the planner could not say; ``why`` tells), and the sizing behind it."""

    replicas: int | None
    why: str


def replicas_for(rate: float, per_replica: float) -> int:
    """Whole replicas that serve ``rate`` at ``per_replica`` each (0 for no load)."""
    return max(0, math.ceil(rate / per_replica - _ROUND_TOLERANCE)) if rate > 0 else 0


class Planner:
    """Per-replica capacities from the profile and the SLOs, cached per length distribution."""

    def __init__(self, profile: Profile, ttft_slo_s: float, tpot_slo_s: float, percentile: float) -> None:
        self._profile = profile
        self._ttft_slo_s, self._tpot_slo_s = ttft_slo_s, tpot_slo_s
        self._q = percentile / 100
        self._cache: dict[tuple[str, float, float], float] = {}

    def _capacity(self, role: str, lengths: Lognormal) -> float:
        # Fits move a little every window; three significant digits keep the cache small and the answer stable.
        key = (role, float(f"{lengths.median:.3g}"), float(f"{lengths.sigma:.3g}"))
        if key not in self._cache:
            rounded = Lognormal(median=key[1], sigma=key[2])
            if role == "prefill":
                rate = tails.prefill_rate(self._profile, rounded, self._ttft_slo_s, self._q)
            else:
                rate = tails.decode_rate(self._profile, rounded, self._tpot_slo_s, self._q)
            self._cache[key] = rate
        return self._cache[key]

    def plan(self, estimate: Estimate, lead_s: float) -> dict[str, RolePlan]:
        """Each role's need for the load ``lead_s`` ahead (see the module)."""
        growth = 1.0
        if estimate.trend > 0 and estimate.arrival_rate > 0:
            growth = 1 + estimate.trend * lead_s / estimate.arrival_rate
        loads = {
            "prefill": (estimate.disagg_rate * growth, estimate.prompt, "P->D prompt lengths"),
            "decode": (estimate.arrival_rate * growth, estimate.output, "output limits"),
        }
        plans = {}
        for role, (rate, lengths, what) in loads.items():
            if rate <= 0:
                plans[role] = RolePlan(0, f"no {role} load")
            elif lengths is None:
                plans[role] = RolePlan(None, f"{rate:.3g} req/s but no {what} recorded")
            else:
                try:
                    capacity = self._capacity(role, lengths)
                except InfeasibleError as e:
                    plans[role] = RolePlan(None, f"infeasible: {e}")
                    continue
                plans[role] = RolePlan(
                    replicas_for(rate, capacity),
                    f"{rate:.3g} req/s ({what} median {lengths.median:.0f}, sigma {lengths.sigma:.2f}) at"
                    f" {capacity:.3g} req/s per replica",
                )
        return plans
