"""Iteration-time model ``t = a + b*prefill_tokens + c*decodes + d*attended_context + e*prefill_depth``,
fitted online (``e`` only where the adapter turns the depth term on: ``depth_term``).

Called in the engine's scheduler process: ``predict`` while choosing a step's token budget, ``observe`` after
the step ran, with the time measured between handing the batch to the workers and getting its output back.

The fit is a least-squares solve over recent steps (five coefficients: the normal equations are a 5x5
system), redone when a prediction is next asked for after new steps were observed, not after every step:
with the trimming and the non-negativity below it is the scheduler's largest per-step cost, a CPU engine's
scheduler shares its core with the model, and most steps (decodes with no prefill pending) ask for no
prediction (docs/performance.md ``## scheduler`` measured what a refit after every step cost the decodes).
It is not a recursive filter. Why: the first version was recursive least squares, and it failed both ways
on real runs. With a confident prior it stayed near the prior's pessimistic per-token cost for several long
prompts, because every chunk of a prompt has nearly the same shape (32-token chunks where 48 fitted). With
a weak prior, a start-up stall followed by large corrections made it diverge to absurd values (chunks stuck
at the floor). A solve over a window has no state to wind up or diverge. It is kept robust and physical by
three rules:

- two windows: the last ``prefill_window`` steps that carried a prefill chunk and the last
  ``decode_window`` that did not, so a long decode-only phase cannot push the prefill cost out of memory;
- coefficients are non-negative (every term is a cost, so more work never predicts less time): the
  constrained solve enumerates which coefficients are free (up to 30 small systems with the depth term,
  14 without) and keeps the best feasible one;
- a weak ridge pull toward the prior keeps coefficients the data does not determine (e.g. the prefill cost
  before any chunk ran) at the prior; and after a first solve, steps whose residual exceeds
  ``outlier_factor`` times the median absolute residual (a step stalled by another process) are dropped
  and the system is solved again.

It starts from a deliberately pessimistic prior (a slow CPU: ~2 ms per prefill token), so the first chunks
are small and safe; the first measured chunk steps replace it.

Why a depth term: on SGLang CPU (``torch_native`` attention) a prefill chunk's step costs in proportion to
how deep in its prompt it is, whatever its size (measured: a 16-token chunk 7 ms at the start of a
1500-token prompt and 52 ms at its end; a 128-token chunk 10 and 46 ms): each step gathers the prompt's
whole KV so far. ``attended_context`` (chunk x depth) cannot express that, so without the term the model
under-predicted deep chunks there (docs/performance.md ``## scheduler``, SGLang). vLLM's adapter leaves it
off (its fits were measured without it), and with it off the model is the four-term one exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

# Feature scales: coefficients are fitted per scaled unit so the normal equations are well conditioned.
_SCALE = np.array([1.0, 256.0, 16.0, 256.0 * 1024.0, 1024.0])
_TERMS = len(_SCALE)
# Prior in seconds: 20 ms fixed, 2 ms per prefill token, 1 ms per decode, 10 ns per attended token pair, none
# per token of prefill depth (a cost the data must show).
DEFAULT_PRIOR_S = (0.020, 2e-3, 1e-3, 1e-8, 0.0)
_TRIM_PASSES = 3  # outlier-trimming solves per observation, at most
_MIN_RESIDUAL_S = 1e-4  # floor of the residual scale: exact data must not trim everything but perfect fits


@dataclass(frozen=True)
class StepShape:
    """What one iteration computes, in the model's terms.

    ``attended_context`` is the number of (query, key) token pairs attention touches: a request that runs
    ``n`` new tokens after ``c`` cached ones adds ``n * c + n * (n + 1) / 2`` (a decode adds ``c + 1``).
    ``prefill_depth``: the cached tokens of the rows that prefill (each is read again by its next chunk).
    """

    prefill_tokens: int
    decodes: int
    attended_context: float
    prefill_depth: float = 0.0

    def features(self) -> npt.NDArray[np.float64]:
        raw = np.array([1.0, self.prefill_tokens, self.decodes, self.attended_context, self.prefill_depth])
        return raw / _SCALE


def attended_pairs(new_tokens: int, cached_tokens: int) -> float:
    """Attention (query, key) pairs for ``new_tokens`` appended after ``cached_tokens`` (causal)."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


def step_shape(rows: Iterable[tuple[int, int]]) -> StepShape:
    """The shape of a step from its rows ``(new tokens, tokens already cached)``: a row of one new token is a
    decode, any other row's tokens are prefill tokens. Each engine adapter lists the rows of the step it
    ran."""
    prefill_tokens = decodes = 0
    pairs = depth = 0.0
    for new, cached in rows:
        pairs += attended_pairs(new, max(0, cached))
        if new == 1:
            decodes += 1
        else:
            prefill_tokens += new
            depth += max(0, cached)
    return StepShape(prefill_tokens, decodes, pairs, depth)


class CostModel:
    """Online linear model of iteration time (seconds). Not thread-safe: one scheduler owns one model."""

    def __init__(
        self,
        prior_s: tuple[float, ...] = DEFAULT_PRIOR_S,
        *,
        depth_term: bool = False,
        prefill_window: int = 128,
        decode_window: int = 64,
        prior_weight: float = 1e-4,
        outlier_factor: float = 4.0,
    ) -> None:
        """``prior_s``: (a, b, c, d) or (a, b, c, d, e) in seconds per unit (e = 0 when left out).
        ``depth_term``: fit ``e`` (else it stays 0 and the depth is not looked at)."""
        if len(prior_s) not in (_TERMS - 1, _TERMS) or min(prior_s) < 0:
            raise ValueError(f"prior coefficients are 4 or 5 non-negative times, got {prior_s}")
        if prefill_window < 4 or decode_window < 4:
            raise ValueError(f"windows must hold at least 4 steps, got {prefill_window}, {decode_window}")
        self._mask = np.array([1.0] * (_TERMS - 1) + [1.0 if depth_term else 0.0])
        self._prior = np.array([*prior_s, 0.0][:_TERMS], dtype=np.float64) * _SCALE * self._mask
        self._theta = self._prior.copy()
        self._stale = False  # steps were observed since the last fit
        self._windows = (_Window(prefill_window), _Window(decode_window))
        self._prior_weight = prior_weight
        self._outlier_factor = outlier_factor
        self.observations = 0
        self.prefill_observations = 0

    @property
    def coefficients_s(self) -> tuple[float, float, float, float, float]:
        """(a, b, c, d, e) in seconds per unscaled unit, as fitted now."""
        a, b, c, d, e = (self._fitted() / _SCALE).tolist()
        return a, b, c, d, e

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds for ``shape``; coefficients are non-negative, so more work never predicts less
        time (the budget search relies on that)."""
        return float(self._fitted() @ (shape.features() * self._mask))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Add one measured step (invalid measurements are ignored); the next prediction refits."""
        if not np.isfinite(seconds) or seconds <= 0:
            return
        self._windows[0 if shape.prefill_tokens else 1].add(shape.features() * self._mask, seconds)
        self._stale = True
        self.observations += 1
        self.prefill_observations += bool(shape.prefill_tokens)

    def _fitted(self) -> npt.NDArray[np.float64]:
        """The coefficients fitted to every step observed so far (refitted once after new ones)."""
        if self._stale:
            self._theta = self._refit()
            self._stale = False
        return self._theta

    def _refit(self) -> npt.NDArray[np.float64]:
        x = np.concatenate([w.x for w in self._windows])
        y = np.concatenate([w.y for w in self._windows])
        keep = np.ones(len(y), dtype=bool)
        for _ in range(_TRIM_PASSES):  # a few passes: huge stalls also inflate the first pass's median
            theta = self._solve(x[keep], y[keep])
            residual = np.abs(y - x @ theta)
            scale = max(float(np.median(residual[keep])), _MIN_RESIDUAL_S)
            trimmed = residual <= self._outlier_factor * scale
            if (trimmed == keep).all():
                break
            keep = trimmed
        return theta

    def _solve(self, x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """argmin |y - x theta|^2 + w |theta - prior|^2 over theta >= 0 (w: ``prior_weight``)."""
        w = self._prior_weight
        gram = x.T @ x + w * np.eye(_TERMS)
        rhs = x.T @ y + w * self._prior
        theta = np.linalg.solve(gram, rhs)
        if theta.min() >= 0:  # the usual case: the unconstrained optimum is feasible
            return theta
        best, best_cost = np.zeros(_TERMS), np.inf
        terms = np.flatnonzero(self._mask)  # a term that is off stays 0: no subset needs to free it
        # Bit i of ``mask``: term ``terms[i]`` is free; the others sit at the bound 0. The all-free mask was
        # just tried; mask 1 (intercept only) is always feasible, since every measured time is positive.
        for mask in range(1, 2 ** len(terms) - 1):
            free = np.zeros(_TERMS, dtype=bool)
            free[[t for i, t in enumerate(terms) if mask >> i & 1]] = True
            theta = np.zeros(_TERMS)
            theta[free] = np.linalg.solve(gram[np.ix_(free, free)], rhs[free])
            if theta.min() < 0:
                continue
            cost = float(theta @ gram @ theta - 2 * rhs @ theta)
            if cost < best_cost:
                best, best_cost = theta, cost
        return best


class _Window:
    """The last ``size`` (features, seconds) samples of one kind of step, oldest overwritten first."""

    def __init__(self, size: int) -> None:
        self._x = np.zeros((size, _TERMS))
        self._y = np.zeros(size)
        self._count = 0

    def add(self, features: npt.NDArray[np.float64], seconds: float) -> None:
        slot = self._count % len(self._y)
        self._x[slot], self._y[slot] = features, seconds
        self._count += 1

    @property
    def x(self) -> npt.NDArray[np.float64]:
        return self._x[: min(self._count, len(self._y))]

    @property
    def y(self) -> npt.NDArray[np.float64]:
        return self._y[: min(self._count, len(self._y))]
