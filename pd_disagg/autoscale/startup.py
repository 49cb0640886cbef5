"""Replica start time as measured: from the order that scaled a role up until that many of its replicas run.

The controller tells ``StartTimes`` of every count it applies (``ordered``) and shows it the replicas each
interval (``observe``); ``lead_s`` is how far ahead the plan must look. The configured ``replica_start_s`` is
the guess until a start was measured; then the latest measurement of each role counts (the larger of the two
roles), so a cluster whose replicas start slower than configured is planned further ahead, and one that starts
faster is not over-provisioned for ever. Measured to the resolution of one interval.
"""

from __future__ import annotations

from pd_disagg.autoscale.policy import Replicas


class StartTimes:
    def __init__(self, configured_s: float) -> None:
        self._configured_s = configured_s
        self._pending: dict[str, tuple[float, int]] = {}  # role -> (when ordered, count ordered)
        self.measured_s: dict[str, float] = {}

    def ordered(self, role: str, target: int, replicas: Replicas, now: float) -> None:
        """A count was applied: a scale-up starts a measurement (the first one, while one runs); a scale-down
        below the count being waited for ends it unmeasured."""
        if target > replicas.running:
            self._pending.setdefault(role, (now, target))
        waiting = self._pending.get(role)
        if waiting is not None and target < waiting[1]:
            del self._pending[role]

    def observe(self, current: dict[str, Replicas], now: float) -> None:
        """End the measurements whose ordered count now runs."""
        for role, (since, target) in list(self._pending.items()):
            if current[role].running >= target:
                self.measured_s[role] = now - since
                del self._pending[role]

    def lead_s(self) -> float:
        return max(self.measured_s.values()) if self.measured_s else self._configured_s
