"""What one engine iteration costs as a client sees it.

Called in the engine's scheduler process by an adapter at three points of every iteration: when it starts
building a step (``begin``), when the step is handed to the workers (``scheduled``), and when the step's
output has been handled (``updated``). ``scheduler_plugins.vllm`` calls them from ``schedule()`` and
``update_from_output()`` and knows at ``updated`` whether the engine loops on; ``scheduler_plugins.sglang``
calls ``begin`` and ``scheduled`` just before ``run_batch``, ``updated`` after ``process_batch_result``, and
``idle`` when SGLang's loop finds nothing to run (it cannot tell earlier).

Why the whole cycle and not the forward pass: a client sees one token per iteration, and an iteration is the
forward pass plus the scheduler's own work, the engine's output handling, and, when the API server runs on
the engine's core, the API server's per-token work (detokenizing, HTTP), which takes the core away from the
engine between and during steps. Measured on one core (docs/performance.md ``## scheduler``), the forward pass
alone left that out and the cost model under-predicted the gaps clients saw. So a step's cost is the time
from its ``begin`` to the next step's ``begin`` when the engine loops straight on (it had work left), and
from ``begin`` to ``updated`` when the engine goes idle after it (the idle wait is not the step's cost).

``StepStats`` keeps the figures of the steps between two log lines (forward, cycle, the process's CPU time
over the cycle, the cycle against the prediction, and how long the model's workers waited for a CPU during
the forward pass) so the server log shows where the time goes. ``RunQueueWait`` reads that wait from Linux's
``/proc/<pid>/task/<tid>/schedstat`` (time spent runnable but not running): a step that took longer than
predicted while the workers waited was slowed by other processes on their cores, not by the cost model.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from scheduler_plugins.cost_model import StepShape


@dataclass(frozen=True)
class StepSample:
    """One measured iteration (seconds)."""

    shape: StepShape
    predicted_s: float  # the cost model's prediction for this shape when the step was built
    forward_s: float  # handed to the workers -> output back (the forward pass and sampling)
    cycle_s: float  # begin -> next begin (engine looped on), or begin -> output handled (engine went idle)
    cpu_s: float  # the scheduler process's CPU time (all its threads) over the cycle
    worker_wait_s: float = 0.0  # the workers' main threads' wait for a CPU during the forward pass


class StepClock:
    """Pairs each step's timestamps; ``begin`` and ``updated`` return the step they complete, if any."""

    def __init__(self) -> None:
        self._begin: tuple[float, float] | None = None  # (wall, cpu) when the step being built started
        # shape, prediction, begin wall, begin cpu, then: sent + workers' wait at sent / forward + their wait
        self._step: tuple[StepShape, float, float, float, float, float] | None = None
        # A step whose output was handled while the engine had work left: the sample as it stands if the
        # engine goes idle now (``idle``), and its begin (wall, cpu), for the cycle that ends at the next one.
        self._done: tuple[StepSample, float, float] | None = None

    def begin(self, now: float, cpu: float) -> StepSample | None:
        """A new iteration starts building its step: completes the previous step if the engine looped on."""
        sample = None
        if self._done is not None:
            handled, began, cpu0 = self._done
            sample = replace(handled, cycle_s=now - began, cpu_s=cpu - cpu0)
            self._done = None
        self._begin = (now, cpu)
        return sample

    def idle(self) -> StepSample | None:
        """The engine found nothing to run after a step reported with ``more_work=True``: that step's cycle
        ended when its output was handled (the idle wait is not its cost)."""
        sample = self._done[0] if self._done is not None else None
        self._done = None
        return sample

    def scheduled(self, shape: StepShape | None, predicted_s: float, now: float, wait_s: float = 0.0) -> None:
        """The step was built (``shape`` None: nothing to run, so nothing to measure). ``wait_s``: the
        workers' total wait for a CPU so far (``RunQueueWait.seconds``)."""
        if shape is None or self._begin is None:
            self._step = None
        else:
            self._step = (shape, predicted_s, *self._begin, now, wait_s)
        self._begin = None

    def updated(
        self, forward_end: float, now: float, cpu: float, more_work: bool, wait_s: float = 0.0
    ) -> StepSample | None:
        """The step's output was handled. ``forward_end``: when the output came back from the workers (and
        ``wait_s`` their total wait for a CPU then). ``more_work``: the engine loops straight into the next
        step (so the cycle ends at its ``begin``), or may (``idle`` then says it did not)."""
        if self._step is None:
            return None
        shape, predicted, began, cpu0, sent, wait0 = self._step
        self._step = None
        handled = StepSample(
            shape, predicted, forward_end - sent, now - began, cpu - cpu0, max(0.0, wait_s - wait0)
        )
        if more_work:
            self._done = (handled, began, cpu0)
            return None
        return handled


#: The most steps ``StepStats`` keeps: the adapter logs (and so resets) them only on steps that plan a
#: prefill chunk, and a node with none for a while (decodes only, or prefill mode) would keep every step.
MAX_SAMPLES = 4096


@dataclass
class StepStats:
    """The steps measured since the last log line (the latest ``MAX_SAMPLES`` of them), summarised for it."""

    samples: deque[StepSample] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def add(self, sample: StepSample) -> None:
        self.samples.append(sample)

    def worker_wait_share(self) -> float:
        """The workers' wait for a CPU over the steps' wall time (0 when they had their cores)."""
        cycle = sum(s.cycle_s for s in self.samples)
        return sum(s.worker_wait_s for s in self.samples) / cycle if cycle > 0 else 0.0

    def summary(self) -> str:
        """``steps=N forward_ms=p50/max cycle_ms=p50/max cpu_share=.. worker_wait_ms=p50/max
        worker_wait_share=.. cycle/predicted=p50/max``; then reset.

        ``cpu_share``: the scheduler's process's CPU time (all its threads) over the steps' wall time. On
        vLLM CPU the model runs in a worker process of its own, so this is what the scheduler's process
        itself burns per step, its wait for the worker's output included: on a core it shares with the
        worker, that share is taken from the forward pass."""
        if not self.samples:
            return "steps=0"
        forward = np.array([s.forward_s for s in self.samples]) * 1e3
        cycle = np.array([s.cycle_s for s in self.samples]) * 1e3
        cpu = sum(s.cpu_s for s in self.samples)
        ratio = np.array([s.cycle_s / s.predicted_s for s in self.samples if s.predicted_s > 0])
        wait = np.array([s.worker_wait_s for s in self.samples]) * 1e3
        text = (
            f"steps={len(self.samples)} forward_ms={np.median(forward):.1f}/{forward.max():.1f} "
            f"cycle_ms={np.median(cycle):.1f}/{cycle.max():.1f} cpu_share={cpu / (cycle.sum() / 1e3):.2f} "
            f"worker_wait_ms={np.median(wait):.1f}/{wait.max():.1f} "
            f"worker_wait_share={self.worker_wait_share():.3f}"
        )
        if ratio.size:
            text += f" cycle/predicted={np.median(ratio):.2f}/{ratio.max():.2f}"
        self.samples.clear()
        return text


class RunQueueWait:
    """Seconds the main threads of some processes have spent runnable but waiting for a CPU (Linux
    schedstat: the second field of ``/proc/<pid>/task/<pid>/schedstat``); 0 where ``/proc`` lacks it.

    The main thread only: in a vLLM CPU worker it runs the forward pass (OpenMP's first thread), while other
    threads (message-queue pollers) spin beside it and wait whenever it runs, which says nothing about the
    step. With several OpenMP threads, the others' waits are not counted: a lower bound.
    """

    def __init__(self, pids: Iterable[int], proc: Path = Path("/proc")) -> None:
        self._paths = [proc / str(pid) / "task" / str(pid) / "schedstat" for pid in pids]

    @staticmethod
    def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
        """The child processes of ``pid`` (e.g. vLLM's model workers, children of the EngineCore)."""
        out: list[int] = []
        for path in (proc / str(pid) / "task").glob("*/children"):
            try:
                out += [int(c) for c in path.read_text().split()]
            except (OSError, ValueError):
                continue
        return out

    def seconds(self) -> float:
        total = 0
        for path in self._paths:
            try:
                total += int(path.read_text().split()[1])
            except (OSError, ValueError, IndexError):
                continue  # the process ended, or the kernel keeps no schedstat
        return total / 1e9


def pinned_cores(
    pids: Iterable[int],
    proc: Path = Path("/proc"),
    affinity: Callable[[int], set[int]] = os.sched_getaffinity,
) -> set[int]:
    """The CPUs that threads of ``pids`` are pinned to one each (vLLM's CPU workers bind every OpenMP thread
    to one core of ``VLLM_CPU_OMP_THREADS_BIND``); threads that may run anywhere are not counted."""
    cores: set[int] = set()
    for pid in pids:
        for task in (proc / str(pid) / "task").glob("*"):
            try:
                allowed = affinity(int(task.name))
            except (OSError, ValueError):
                continue  # the thread ended
            if len(allowed) == 1:
                cores |= allowed
    return cores
