"""Worker pools and load balancing: P by least outstanding prefill tokens, D by power of two choices, both
weighed against cached prefixes when KV-aware routing is on.

Lives in the router process and is mutated only from its event loop (no locks needed): the request path
reserves a worker (``lease``) before sending and releases it when the leg ends, so ``active`` and
``outstanding_tokens`` always reflect legs in flight. The admin API adds, removes, drains and switches
(``router.roles``) workers here; a removed or draining worker finishes its legs but gets no new ones.

KV-aware routing (``[kv_routing]``): the balancer owns the router's ``PrefixIndex``. The proxy records each
routed prompt's block hashes on the workers it went to (``record``), and ``place_decode`` / ``pick_prefill``
weigh each candidate's cached prefix against its load with ``policy.CacheCost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from router.config import CircuitConfig, KvRoutingConfig, WorkerConfig
from router.health import CircuitBreaker, Clock
from router.policy import CacheCost, PoolLoad
from router.prefix_index import PrefixIndex


@dataclass(eq=False)
class Worker:
    """One engine server and its live load (identity semantics: two workers are never equal)."""

    cfg: WorkerConfig
    role: str
    circuit: CircuitBreaker
    healthy: bool = True
    health_streak: int = 0
    # Times the health checker brought it back: a request may return to a worker that failed it once this
    # has grown since (``comeback.py``).
    recoveries: int = 0
    draining: bool = False
    active: int = 0
    outstanding_tokens: int = 0
    switching_to: str = ""  # the role an admin switch is draining it for ("" = none; router.roles)

    @property
    def url(self) -> str:
        return self.cfg.url

    def describe(self) -> dict[str, Any]:
        """What the admin API shows of the worker."""
        return {
            "role": self.role,
            "url": self.url,
            "engine": self.cfg.engine,
            "roles": list(self.cfg.roles or (self.role,)),
            "healthy": self.healthy,
            "draining": self.draining,
            "switching_to": self.switching_to or None,
            "circuit": self.circuit.state.value,
            "active": self.active,
            "outstanding_prefill_tokens": self.outstanding_tokens,
        }

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

    def lendable(self) -> list[Worker]:
        """Usable workers with no prefill leg in flight: those a short request may be lent to (P pool;
        ``ThresholdPolicy``, ``Balancer.place_lent``)."""
        return [w for w in self.usable() if not w.outstanding_tokens]

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
            lendable_min_active=min((w.active for w in self.lendable()), default=None),
        )

    def notify(self) -> None:
        """Wake waiters (a slot freed, a worker came back); they re-check and wait again if needed."""
        self.changed.set()
        self.changed = asyncio.Event()


#: Why a decode worker was chosen: it holds a prefix of the prompt (``prefix``); another candidate did, but
#: this one was cheaper by ``CacheCost`` (``load``); no candidate held any, power of two choices (``balance``);
#: the policy lent the request to an idle prefill worker (``lent``, ``place_lent``).
PlaceReason = Literal["prefix", "load", "balance", "lent"]


class Placement(NamedTuple):
    """The decode worker for a request (None: no candidate below capacity) and its cached prompt tokens."""

    worker: Worker | None
    cached_tokens: int = 0
    reason: PlaceReason = "balance"


class Balancer:
    """Picks workers for each leg; ``rng`` and ``clock`` are injectable so tests are deterministic.

    ``kv``: KV-aware routing settings; None or ``enabled = false`` routes on load alone (``prefixes`` None).
    """

    def __init__(
        self,
        circuit: CircuitConfig,
        rng: random.Random | None = None,
        clock: Clock = time.monotonic,
        kv: KvRoutingConfig | None = None,
    ):
        self._circuit = circuit
        self._rng = rng or random.Random()
        self._clock = clock
        self.prefill = Pool("prefill")
        self.decode = Pool("decode")
        self.prefixes: PrefixIndex | None = None
        self._cost = CacheCost(0)
        if kv is not None and kv.enabled:
            self.prefixes = PrefixIndex(kv.block_size, kv.max_blocks_per_worker, self._rng)
            self._cost = CacheCost(kv.load_tokens)

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
        if self.prefixes is not None:
            self.prefixes.forget(worker)
        return worker

    def all_workers(self) -> list[Worker]:
        return [*self.prefill.workers, *self.decode.workers]

    def hashes(self, ids: Sequence[int] | None) -> list[int]:
        """The prompt's block hashes for ``place_decode``, ``pick_prefill`` and ``record``; empty when
        KV-aware routing is off or the prompt's token ids are unknown (a prompt routed on its length bound)."""
        if self.prefixes is None or not ids:
            return []
        return self.prefixes.hashes(ids)

    def _cached(self, worker: Worker, hashes: Sequence[int]) -> int:
        if self.prefixes is None or not hashes:
            return 0
        return self.prefixes.match(worker, hashes) * self.prefixes.block_size

    def record(self, hashes: Sequence[int], *workers: Worker | None) -> None:
        """The prompt of ``hashes`` was sent to ``workers``: they will hold its blocks in their prefix caches."""
        if self.prefixes is not None and hashes:
            for w in workers:
                if w is not None:
                    self.prefixes.record(w, hashes)

    def pick_prefill(
        self,
        exclude: set[Worker] | frozenset[Worker] = frozenset(),
        hashes: Sequence[int] = (),
        prompt_tokens: int = 0,
    ) -> Worker | None:
        """Least expected prefill work (``CacheCost.prefill``: outstanding tokens plus the prompt's uncached
        tokens there; without hashes, least outstanding tokens); ties go to the fewest active legs, then at
        random."""
        candidates = [w for w in self.prefill.usable() if w not in exclude]
        if not candidates:
            return None
        keyed = [
            (self._cost.prefill(prompt_tokens, self._cached(w, hashes), w.outstanding_tokens), w.active, w)
            for w in candidates
        ]
        best = min(k[:2] for k in keyed)
        return self._rng.choice([w for cost, active, w in keyed if (cost, active) == best])

    def place_decode(
        self,
        max_active: int,
        exclude: set[Worker] | frozenset[Worker] = frozenset(),
        hashes: Sequence[int] = (),
        prompt_tokens: int = 0,
    ) -> Placement:
        """The decode worker of least ``CacheCost.decode`` among usable workers below ``max_active`` when one
        of them holds a prefix of the prompt (ties: fewest active, then at random); else power of two
        choices on active requests."""
        candidates = [w for w in self.decode.usable() if w not in exclude and w.active < max_active]
        if hashes and len(candidates) > 1:
            cached = [self._cached(w, hashes) for w in candidates]
            if any(cached):
                keyed = [
                    (self._cost.decode(prompt_tokens, c, w.active), w.active, c, w)
                    for c, w in zip(cached, candidates, strict=True)
                ]
                best = min(k[:2] for k in keyed)
                _, _, c, w = self._rng.choice([k for k in keyed if k[:2] == best])
                return Placement(w, c, "prefix" if c else "load")
        worker = self._two_choices(candidates)
        held = self._cached(worker, hashes) if worker is not None else 0
        return Placement(worker, held, "prefix" if held else "balance")

    def place_lent(self, hashes: Sequence[int] = ()) -> Placement:
        """The prefill worker a short request the policy lent (reason ``lent``) runs on alone: of those with no
        prefill leg in flight, the least active (ties at random); the policy saw it below its limits."""
        idle = self.prefill.lendable()
        if not idle:
            return Placement(None)
        least = min(w.active for w in idle)
        worker = self._rng.choice([w for w in idle if w.active == least])
        return Placement(worker, self._cached(worker, hashes), "lent")

    def _two_choices(self, candidates: list[Worker]) -> Worker | None:
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
