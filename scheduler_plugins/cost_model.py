"""Iteration-time model ``t = a + b*prefill_tokens + c*decodes + d*attended_context``, fitted online.

Called in the engine's scheduler process: ``predict`` while choosing a step's token budget, ``observe`` after
the step ran, with the time measured between handing the batch to the workers and getting its output back.
Fitting is recursive least squares (RLS) with a forgetting factor, so the model follows the hardware it runs
on and slow drifts (other tenants, longer contexts) without storing history.

It starts from a deliberately pessimistic prior (a slow CPU: ~2 ms per prefill token), so the first chunks
are small and safe; the prior is held with low confidence, and the first measured chunk steps replace it.
``prior_variance`` is relative to the error variance RLS assumes for one measurement, so it must be large:
with 1 the prior weighed like hundreds of steps, and since every chunk of a long prompt has nearly the same
shape, the per-token cost stayed near the pessimistic 2 ms for several prompts (32-token chunks where 48
fitted the target).
Features that never vary (e.g. no prefill yet) keep their prior. Coefficients are projected onto
non-negative values after each update (each term is a cost). Two guards keep one bad sample from
wrecking the fit on a shared machine: the innovation is clipped to a few times its running mean absolute
value when the step was slower than predicted (a step stalled by another process counts as a bounded error;
a faster one is never a stall, so it is taken whole and the pessimistic prior is left quickly), and the
covariance is not inflated by forgetting beyond its initial size (no wind-up while the workload only
decodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

# Feature scales: coefficients are fitted per scaled unit so the RLS covariance is well conditioned.
_SCALE = np.array([1.0, 256.0, 16.0, 256.0 * 1024.0])
# Prior in seconds: 20 ms fixed, 2 ms per prefill token, 1 ms per decode, 10 ns per attended token pair.
DEFAULT_PRIOR_S = (0.020, 2e-3, 1e-3, 1e-8)


@dataclass(frozen=True)
class StepShape:
    """What one iteration computes, in the model's terms.

    ``attended_context`` is the number of (query, key) token pairs attention touches: a request that runs
    ``n`` new tokens after ``c`` cached ones adds ``n * c + n * (n + 1) / 2`` (a decode adds ``c + 1``).
    """

    prefill_tokens: int
    decodes: int
    attended_context: float

    def features(self) -> npt.NDArray[np.float64]:
        raw = np.array([1.0, self.prefill_tokens, self.decodes, self.attended_context])
        return raw / _SCALE


def attended_pairs(new_tokens: int, cached_tokens: int) -> float:
    """Attention (query, key) pairs for ``new_tokens`` appended after ``cached_tokens`` (causal)."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


class CostModel:
    """Online linear model of iteration time (seconds). Not thread-safe: one scheduler owns one model."""

    def __init__(
        self,
        prior_s: tuple[float, float, float, float] = DEFAULT_PRIOR_S,
        *,
        forgetting: float = 0.98,
        prior_variance: float = 100.0,
        outlier_factor: float = 4.0,
    ) -> None:
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if min(prior_s) < 0:
            raise ValueError(f"prior coefficients are times and cannot be negative, got {prior_s}")
        self._theta = np.array(prior_s, dtype=np.float64) * _SCALE
        self._p0 = np.eye(4) * prior_variance
        self._p = self._p0.copy()
        self._forgetting = forgetting
        self._outlier_factor = outlier_factor
        self._mean_abs_err = 0.01  # seconds; running mean |innovation|, seeds the outlier clip
        self.observations = 0

    @property
    def coefficients_s(self) -> tuple[float, float, float, float]:
        """(a, b, c, d) in seconds per unscaled unit, as fitted now."""
        a, b, c, d = (self._theta / _SCALE).tolist()
        return a, b, c, d

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds for ``shape``; coefficients are kept non-negative, so more work never predicts
        less time (the budget search relies on that)."""
        return float(self._theta @ shape.features())

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Update the fit with one measured step (RLS with forgetting, clipped innovation)."""
        if not np.isfinite(seconds) or seconds <= 0:
            return
        x = shape.features()
        err = seconds - float(self._theta @ x)
        clip = self._outlier_factor * self._mean_abs_err
        # Only slow steps can be stalls (another process had the CPU); a step faster than predicted is
        # information, taken whole: clipping it kept the fit near its pessimistic prior for hundreds of steps.
        clipped = min(err, clip)
        self._mean_abs_err = 0.9 * self._mean_abs_err + 0.1 * min(abs(err), 2 * clip)
        px = self._p @ x
        gain = px / (self._forgetting + float(x @ px))
        # Projected RLS: every term is a cost, so a noisy fit must not trade a negative intercept for an
        # inflated per-token cost (that would make chunks far too small, or too large, at other shapes).
        self._theta = np.maximum(self._theta + gain * clipped, 0.0)
        p = (self._p - np.outer(gain, px)) / self._forgetting
        # No wind-up: directions the workload does not excite must not grow without bound.
        self._p = p if np.trace(p) <= np.trace(self._p0) else p * (np.trace(self._p0) / np.trace(p))
        self.observations += 1
