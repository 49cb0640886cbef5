"""Worker pools and load balancing: P by least outstanding prefill tokens, D by power of two choices.

Lives in the router process and is mutated only from its event loop (no locks needed): the request path
reserves a worker (``lease``) before sending and releases it when the leg ends, so ``active`` and
``outstanding_tokens`` always reflect legs in flight. The admin API adds, removes and drains workers here;
a removed or draining worker finishes its legs but gets no new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from router.config import CircuitConfig, WorkerConfig
from router.health import CircuitBreaker, Clock
from router.policy import PoolLoad


@dataclass(eq=False)
class Worker:
    """One engine server and its live load (identity semantics: two workers are never equal)."""

    cfg: WorkerConfig
    role: str
    circuit: CircuitBreaker
    healthy: bool = True
    health_streak: int = 0
    draining: bool = False
    active: int = 0
    outstanding_tokens: int = 0

    @property
    def url(self) -> str:
        return self.cfg.url

    def usable(self) -> bool:
        return self.healthy and not self.draining and self.circuit.allows()


@dataclass
class Pool:
    """The workers of one role; ``changed`` wakes requests waiting for a decode slot."""

    role: str
    workers: list[Worker] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def usable(self) -> list[Worker]:
        return [w for w in self.workers if w.usable()]

    def find(self, url: str) -> Worker | None:
        return next((w for w in self.workers if w.url == url), None)

    def load(self) -> PoolLoad:
        usable = self.usable()
        if not usable:
            return PoolLoad()
        return PoolLoad(
            workers=len(usable),
            min_outstanding_tokens=min(w.outstanding_tokens for w in usable),
            min_active=min(w.active for w in usable),
        )

    def notify(self) -> None:
        """Wake waiters (a slot freed, a worker came back); they re-check and wait again if needed."""
        self.changed.set()
        self.changed = asyncio.Event()


class Balancer:
    """Picks workers for each leg; ``rng`` and ``clock`` are injectable so tests are deterministic."""

    def __init__(
        self, circuit: CircuitConfig, rng: random.Random | None = None, clock: Clock = time.monotonic
    ):
        self._circuit = circuit
        self._rng = rng or random.Random()
        self._clock = clock
        self.prefill = Pool("prefill")
        self.decode = Pool("decode")

    def pool(self, role: str) -> Pool:
        return self.prefill if role == "prefill" else self.decode

    def add(self, cfg: WorkerConfig, role: str) -> Worker:
        pool = self.pool(role)
        if pool.find(cfg.url) is not None:
            raise ValueError(f"{role} worker {cfg.url} already exists")
        worker = Worker(cfg, role, CircuitBreaker(self._circuit, self._clock))
        pool.workers.append(worker)
        pool.notify()
        return worker

    def remove(self, url: str, role: str) -> Worker:
        pool = self.pool(role)
        worker = pool.find(url)
        if worker is None:
            raise KeyError(url)
        pool.workers.remove(worker)
        worker.draining = True
        return worker

    def all_workers(self) -> list[Worker]:
        return [*self.prefill.workers, *self.decode.workers]

    def pick_prefill(self, exclude: set[Worker] | frozenset[Worker] = frozenset()) -> Worker | None:
        """Least outstanding prefill tokens; ties go to the fewest active legs, then at random."""
        candidates = [w for w in self.prefill.usable() if w not in exclude]
        if not candidates:
            return None
        best = min((w.outstanding_tokens, w.active) for w in candidates)
        return self._rng.choice([w for w in candidates if (w.outstanding_tokens, w.active) == best])

    def pick_decode(
        self, max_active: int, exclude: set[Worker] | frozenset[Worker] = frozenset()
    ) -> Worker | None:
        """Power of two choices on active requests among usable workers below ``max_active``."""
        candidates = [w for w in self.decode.usable() if w not in exclude and w.active < max_active]
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        a, b = self._rng.sample(candidates, 2)
        return a if a.active <= b.active else b

    @contextlib.contextmanager
    def lease(self, worker: Worker, prefill_tokens: int = 0) -> Iterator[Worker]:
        """Count a leg on ``worker`` for as long as the block runs (released on any exit)."""
        worker.active += 1
        worker.outstanding_tokens += prefill_tokens
        worker.circuit.acquire()
        try:
            yield worker
        finally:
            worker.active -= 1
            worker.outstanding_tokens -= prefill_tokens
            self.pool(worker.role).notify()
