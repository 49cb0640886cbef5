"""Replica counts over time from per-window needs: scale up ahead of replica start time, down with hysteresis.

Called by ``planner.fleet`` for each pool (P and D) of each planning method. A controller acts every
``tick_s`` seconds:

- it wants the largest need of any window that overlaps [t, t + lead_s] (windows are ``window_s`` long from
  t = 0): with ``lead_s`` equal to the replica start time, a replica ordered at t is ready when the window
  needing it begins (``lead_s = 0`` is a planner unaware of start time: it orders at the window's start);
- it scales up at once; it scales down only after wanting fewer for ``hold_s`` seconds in a row, and then to
  the largest count it wanted during that hold (so a short dip does not drop replicas it will soon need again).

``ready`` turns the ordered counts into the replicas serving at each time: a replica serves ``start_s`` after it
was ordered, and a scale-down removes replicas still starting before ready ones, so the ready count at t is the
least ordered count over [t - start_s, t]. At t = 0 the first order is taken as already running.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def ordered(need: Sequence[int], window_s: float, tick_s: float, lead_s: float, hold_s: float) -> np.ndarray:
    """Replicas ordered on each tick [k tick_s, (k + 1) tick_s) of the horizon len(need) * window_s."""
    if window_s <= 0 or tick_s <= 0 or lead_s < 0 or hold_s < 0:
        raise ValueError("window and tick must be > 0, lead and hold >= 0")
    need_array = np.asarray(need, dtype=np.int64)
    ticks = math.ceil(len(need_array) * window_s / tick_s - 1e-9)
    counts = np.empty(ticks, dtype=np.int64)
    current = 0
    below_since: float | None = None
    wanted_while_below = 0
    for k in range(ticks):
        t = k * tick_s
        first = math.floor(t / window_s + 1e-9)
        last = min(math.floor((t + lead_s) / window_s + 1e-9), len(need_array) - 1)
        want = int(need_array[first : last + 1].max())
        if want >= current:
            current, below_since = want, None
        else:
            if below_since is None:
                below_since, wanted_while_below = t, want
            wanted_while_below = max(wanted_while_below, want)
            if t - below_since >= hold_s - 1e-9:
                current = wanted_while_below
                # The tick that scales down may already want fewer still: the next hold starts here.
                below_since, wanted_while_below = (t, want) if want < current else (None, 0)
        counts[k] = current
    return counts


def ready(counts: np.ndarray, tick_s: float, start_s: float, times_s: np.ndarray) -> np.ndarray:
    """Replicas serving at each of ``times_s``: the least count ordered over [t - start_s, t]."""
    if start_s < 0:
        raise ValueError("replica start time must be >= 0")
    times = np.asarray(times_s, dtype=float)
    last = np.clip(np.floor(times / tick_s + 1e-9).astype(np.int64), 0, len(counts) - 1)
    first = np.clip(np.floor((times - start_s) / tick_s + 1e-9).astype(np.int64), 0, len(counts) - 1)
    least = counts[last].copy()
    for offset in range(math.ceil(start_s / tick_s) + 1):  # every tick the span [t - start_s, t] touches
        least = np.minimum(least, counts[np.minimum(first + offset, last)])
    return least
