"""When each stage of one transfer happened, on one side: the raw material of the first-token trace.

Engine-agnostic, and importable without the transfer engine: pd-router stamps its own stages of a request with
the same ``Timeline`` and ``spans`` (``router/trace.py``). The sender (P) and receiver (D) stamp stages on the engine's I/O thread as they happen and hand the stamps to
the adapter in ``TransferResult.stages``; the adapter adds its own (D: when vLLM learnt the load finished),
exports the spans between consecutive stages as histograms and, when asked, writes the whole record to a
trace file (``trace.py``). Stamps are wall-clock seconds (``time.time()``) so the records of P, D and the
router, which run in different processes, line up on one host (across hosts, as far as their clocks agree).

Stages (named here in their usual order; D's destinations may reach P after P's prefill ended, as they always
do in vLLM's standard P-then-D flow):
- P: ``offered`` (P's scheduler gave the request's blocks: its prefill step started), ``destinations`` (the
  first D rank's block table arrived), ``prompt_done`` (the step that completed the prompt ended),
  ``done`` (every write landed and ``Done`` went to every D rank).
- D: ``expected`` (D's scheduler planned the load), ``destinations_sent``, ``first_layer`` (P's first
  ``LayerDone``), ``done`` (P's ``Done`` arrived), then in the adapter ``reported`` (handed to vLLM).
"""

from __future__ import annotations

import itertools
import time

#: The stages of each side, in order; a record holds those that happened.
SEND_STAGES = ("offered", "destinations", "prompt_done", "done")
RECV_STAGES = ("expected", "destinations_sent", "first_layer", "done", "reported")


class Timeline:
    """The first time each stage of one transfer happened on this side (later marks of a stage are ignored)."""

    __slots__ = ("stamps",)

    def __init__(self) -> None:
        self.stamps: dict[str, float] = {}

    def mark(self, stage: str, monotonic_at: float | None = None) -> None:
        """Stamp ``stage`` now, or at ``monotonic_at`` (a ``time.monotonic()`` reading taken by the caller
        on another thread: the hop to the I/O thread is then not counted in the stage)."""
        if stage in self.stamps:
            return
        now = time.time()
        self.stamps[stage] = now if monotonic_at is None else now - (time.monotonic() - monotonic_at)


def spans(stages: dict[str, float], order: tuple[str, ...]) -> dict[str, float]:
    """Seconds between stages that happened one after the other, keyed ``"a->b"`` in the order they happened
    (``order`` breaks ties and drops unknown stages). So the names tell the story: ``prompt_done->destinations``
    is P waiting for D after its prefill, ``offered->destinations`` D's block table arriving during it."""
    rank = {stage: i for i, stage in enumerate(order)}
    seen = sorted((t, rank[s], s) for s, t in stages.items() if s in rank)
    return {f"{a}->{b}": tb - ta for (ta, _, a), (tb, _, b) in itertools.pairwise(seen)}
