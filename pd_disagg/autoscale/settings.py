"""The autoscaler's settings: one definition, read by the controller and by the Ray Serve application.

The Ray application takes them as its ``autoscale:`` argument (``pd_disagg.ray_serve.app_config``) and checks
them in ``serve run``'s process with ``check``, so a wrong SLO or an unreadable profile stops the deploy there
rather than in a replica. docs/configuration.md (``## Ray Serve``, ``autoscale.*``) documents each field.
"""

from __future__ import annotations

import msgspec

from planner.profile import Profile, ProfileError, load_profile

ROLES = ("prefill", "decode")


class AutoscaleSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """SLOs, the measured replica profile, the controller's timing and each role's replica bounds."""

    #: A planner profile of one P and one D replica (``pd-plan profile``), the same path on every node.
    profile: str
    #: TTFT that ``percentile`` % of requests must meet (s).
    ttft_slo_s: float
    #: Time per output token that ``percentile`` % of requests must meet (s).
    tpot_slo_s: float
    percentile: float = 90.0
    #: Seconds between two decisions.
    interval_s: float = 10.0
    #: Seconds of router metrics each estimate covers (rates, length distributions, SLO attainment).
    window_s: float = 60.0
    #: Seconds a new replica takes until it serves: the plan looks this far ahead.
    replica_start_s: float = 120.0
    #: A role scales down only after its plan has been lower for this long (s).
    scale_down_hold_s: float = 300.0
    #: After a role's count changed, no scale-down and no SLO-driven scale-up of it for this long (s).
    cooldown_s: float = 60.0
    #: Requests (TTFT) or token gaps (ITL) a window needs before its SLO attainment counts.
    min_samples: int = 20
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    #: The controller's own Prometheus ``/metrics`` (``pd_autoscale_*``); port 0: not served.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0

    def bounds(self, role: str) -> tuple[int, int]:
        """The fewest and most replicas of ``role``."""
        low: int = getattr(self, f"min_{role}")
        high: int = getattr(self, f"max_{role}")
        return low, high


def check(settings: AutoscaleSettings) -> Profile:
    """Raise ``ValueError`` naming every bad setting; return the profile the settings name."""
    errors = []
    for name in ("ttft_slo_s", "tpot_slo_s", "interval_s", "window_s"):
        if not getattr(settings, name) > 0:
            errors.append(f"{name}: must be > 0")
    for name in ("replica_start_s", "scale_down_hold_s", "cooldown_s"):
        if not getattr(settings, name) >= 0:
            errors.append(f"{name}: must be >= 0")
    if not 0 < settings.percentile < 100:
        errors.append("percentile: must be between 0 and 100 (exclusive)")
    if settings.min_samples < 1:
        errors.append("min_samples: must be >= 1")
    for role in ROLES:
        low, high = settings.bounds(role)
        if not 1 <= low <= high:
            errors.append(f"min_{role}, max_{role}: need 1 <= min <= max, got {low} and {high}")
    if not 0 <= settings.metrics_port <= 65535:
        errors.append(f"metrics_port: out of range: {settings.metrics_port}")
    try:
        profile = load_profile(settings.profile)
    except ProfileError as e:
        errors.append(f"profile: {e}")
    if errors:
        raise ValueError("; ".join(errors))
    return profile
