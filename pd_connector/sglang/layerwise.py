"""Layer-by-layer KV push on an SGLang prefill server (P): each layer's new pages go to D as the forward pass
writes them, so the transfer runs behind the remaining layers' compute instead of after the forward.

Who calls what (P's scheduler process, all on its scheduler thread):
- ``run_batch_hook``, AROUND SGLang's ``Scheduler.run_batch`` (registered by ``plugin.register`` through
  ``compat``): before the forward it hands the batch's requests (``compat.forward_requests``) to the pd KV
  manager, whose ``LayerPusher.plan`` offers each request's pages up to what this forward completes, pushes at
  once every layer of the pages computed before it (P's cached prefix, the pages of earlier chunks no push has
  covered) and returns the ``ForwardPlan``: the pages each room gets from this forward. The plan is current
  for the duration of the call (a ``ContextVar``: scoped to this call, invisible to other threads).
  Afterwards ``LayerPusher.forward_ended`` pushes the layers no event came for.
- ``set_kv_buffer_hook``, AFTER SGLang's ``MHATokenToKVPool.set_kv_buffer``: layer L of the current forward
  is written, so ``ForwardPlan.layer_written`` pushes layer L's new pages of every planned room.
- SGLang's own ``send_kv_chunk`` still calls ``PdKVSender.send`` once per chunk; ``LayerPusher.add_chunk``
  then offers the chunk's pages, pushes only what no plan pushed (so per-chunk sends remain the fallback) and
  the manager finishes on the last chunk (``Done`` goes after the last layer's writes landed).

Which pages go layer by layer: only pages SGLang keeps for the request. After a forward SGLang inserts the
computed tokens into its radix cache, and where the cache already holds them it swaps the request's new pages
for the cached ones and frees the new ones, which a push still being written could then read after reuse. So
the page of the prompt's last token (recomputed even on a full cache hit) and the pages of requests of one
batch that compute the same tokens go with the per-chunk send, after that swap; a sent page that differs from
one already offered fails the room (``merge_pages``), never a silent wrong byte.

Fallback: where no layer event arrives during a forward that had pages to push (an attention backend or pool
that does not write through ``MHATokenToKVPool.set_kv_buffer``, a forward on another thread), the missing
layers are pushed after the forward, and the pusher logs once that it sends per chunk from then on. Layer-wise
pushing is only turned on for a KV pool in host memory (``compat.layerwise_problem``): on a GPU the write is
still queued on a CUDA stream when ``set_kv_buffer`` returns, and this backend has no event to wait on.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from pd_connector.sglang import compat

logger = logging.getLogger(__name__)

#: Labels of ``TransferMetrics.layer_push``: when a layer's pages were pushed.
FORWARD = "forward"  # from the layer hook, as the forward pass wrote the layer
COMPUTED = "computed"  # at plan time: pages computed before this forward (cached prefix, earlier chunks)
CHUNK = "chunk"  # after a forward pass (per-chunk send, or a layer no event came for)


def transfer_id(room: int) -> str:
    """The transfer engine's id of bootstrap room ``room``."""
    return f"sgl-{room}"


class PushTarget(Protocol):
    """The part of ``TransferEngine`` the pusher drives (P side)."""

    def offer(self, transfer_id: str, src_blocks: Sequence[int], prompt_hash: bytes = b"") -> None: ...

    def push_layer(self, transfer_id: str, layer: int, start: int = 0, end: int | None = None) -> None: ...


def forward_pages(
    *, pushed: int, prefix_tokens: int, end_tokens: int, input_tokens: int, page_size: int
) -> tuple[int, int, int]:
    """``(start, mid, stop)`` page positions of one request for one forward pass.

    ``pushed``: pages already pushed on every layer; the forward computes tokens ``[prefix_tokens,
    end_tokens)`` of an ``input_tokens`` prompt. Pages ``[start, mid)`` were complete before the forward
    (push them now); pages ``[mid, stop)`` are completed by it and stay the request's (push each layer as it
    is written). ``stop`` ends before the page of a partial last chunk (the next forward completes it, as
    SGLang's ``_send_kv_chunk`` does) and before the page of the prompt's last token: SGLang recomputes that
    token even when its whole prompt is cached, then swaps the recomputed page for the cached copy (its radix
    cache deduplicates) and frees it, so that page goes with the per-chunk send, from the page SGLang keeps.
    """
    stop = max(min(end_tokens // page_size, (input_tokens - 1) // page_size), pushed)
    mid = min(max(pushed, prefix_tokens // page_size), stop)
    return pushed, mid, stop


def merge_pages(known: list[int], pages: Sequence[int], at: int) -> None:
    """Put ``pages`` at table position ``at`` of ``known`` (extending it): the engine's table only grows, so
    ``ValueError`` when that would leave a gap or change a page already offered."""
    if at > len(known):
        raise ValueError(f"pages from position {at} would leave a gap after the {len(known)} offered")
    overlap = known[at : at + len(pages)]
    if list(pages[: len(overlap)]) != overlap:
        raise ValueError(f"pages from position {at} differ from those offered before")
    known.extend(pages[len(overlap) :])


class ForwardPlan:
    """The pages each room gets from one forward pass, and the layers written so far."""

    def __init__(
        self,
        ranges: dict[int, tuple[int, int]],
        num_layers: int,
        push: Callable[[int, int, int, int, str], None],
    ) -> None:
        self.ranges = ranges  # room -> (first page, end page) pushed per layer
        self.num_layers = num_layers
        self._push = push  # (room, layer, start, stop, when)
        self.written: set[int] = set()

    def layer_written(self, layer: int) -> None:
        """Layer ``layer`` of this forward is in the pool: push its new pages of every planned room (again if
        the layer is written twice: a second push of a page is harmless)."""
        if not 0 <= layer < self.num_layers:
            return
        self.written.add(layer)
        for room, (start, stop) in self.ranges.items():
            self._push(room, layer, start, stop, FORWARD)

    def missing(self) -> list[int]:
        """The layers no event came for."""
        return [layer for layer in range(self.num_layers) if layer not in self.written]


@dataclasses.dataclass
class _Room:
    table: list[int] = dataclasses.field(default_factory=list)  # pages offered, in token order
    pushed: int = 0  # pages pushed on every layer


class LayerPusher:
    """P: per room, the page table offered to the engine and how far every layer was pushed; pushes layer by
    layer during a forward (``plan``), or per chunk after it (``add_chunk``). Thread-safe (the scheduler thread
    plans and sends, the manager's result thread forgets ended rooms). A push that raises leaves the room to
    the caller to fail (the engine fails the transfer on its own errors)."""

    def __init__(
        self,
        engine: PushTarget,
        num_layers: int,
        *,
        layerwise: bool,
        wrong_kv_rooms: frozenset[int] = frozenset(),
        skip_layer_rooms: frozenset[int] = frozenset(),
        count: Callable[[str, int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.num_layers = num_layers
        self.layerwise = layerwise
        self.wrong_kv_rooms = wrong_kv_rooms
        self.skip_layer_rooms = skip_layer_rooms
        self._count = count
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}

    # ---- per-room table ----------------------------------------------------------------------------------
    def open(self, room: int) -> None:
        with self._lock:
            self._rooms[room] = _Room()
        self.engine.offer(transfer_id(room), [])

    def forget(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def rooms(self) -> list[int]:
        with self._lock:
            return list(self._rooms)

    def _offer(self, room: int, pages: Sequence[int], at: int) -> int:
        """Merge ``pages`` at ``at`` into the room's table and offer it; returns the table's length."""
        with self._lock:
            state = self._rooms.setdefault(room, _Room())
            merge_pages(state.table, [int(p) for p in pages], at)
            table = list(state.table)
        if room in self.wrong_kv_rooms:
            logger.warning("pd backend: fault injection sends page 0's KV for every page of room %s", room)
            table = table[:1] * len(table)
        self.engine.offer(transfer_id(room), table)
        return len(table)

    def _push(self, room: int, layer: int, start: int, stop: int, when: str) -> None:
        if stop <= start:
            return
        if not (room in self.skip_layer_rooms and layer == self.num_layers - 1):
            self.engine.push_layer(transfer_id(room), layer, start, stop)
        if self._count is not None:
            self._count(when, layer)

    def _advance(self, room: int, stop: int) -> int:
        """Mark pages up to ``stop`` pushed on every layer; returns how far they were pushed before."""
        with self._lock:
            state = self._rooms.setdefault(room, _Room())
            before = state.pushed
            state.pushed = max(before, stop)
            return before

    # ---- SGLang's per-chunk send ---------------------------------------------------------------------------
    def add_chunk(self, room: int, pages: Sequence[int], start: int, stop: int) -> None:
        """One chunk's pages at table positions ``[start, stop)``: offer them and push every layer of the part
        no forward plan pushed."""
        if self._offer(room, pages, start) < stop:
            raise ValueError(f"chunk ends at page {stop} but fewer pages were offered")
        first = max(start, self._advance(room, stop))
        for layer in range(self.num_layers):
            self._push(room, layer, first, stop, CHUNK)

    # ---- layer-wise ----------------------------------------------------------------------------------------
    def plan(
        self, requests: Iterable[compat.ForwardRequest], page_size: int
    ) -> tuple[ForwardPlan | None, dict[int, Exception]]:
        """Before a forward: offer each live room's pages up to what the forward completes, push the pages
        completed before it, and return the plan of the rest (None when nothing is pushed per layer) and the
        rooms that could not be planned, with why (the caller fails them)."""
        ranges: dict[int, tuple[int, int]] = {}
        failed: dict[int, Exception] = {}
        if not self.layerwise:
            return None, failed
        requests = list(requests)
        leads = collections.Counter(req.lead for req in requests)
        for req in requests:
            with self._lock:
                state = self._rooms.get(req.room)
                pushed = state.pushed if state is not None else None
            if pushed is None:
                continue  # not opened here, or already ended
            start, mid, stop = forward_pages(
                pushed=pushed,
                prefix_tokens=req.prefix_tokens,
                end_tokens=req.end_tokens,
                input_tokens=req.input_tokens,
                page_size=page_size,
            )
            if leads[req.lead] > 1:
                # Another request of this batch computes the same tokens: whichever SGLang caches second gets
                # its new pages swapped for the first one's and freed, so only the pages computed before go now.
                stop = mid
            if stop <= start:
                continue
            try:
                if len(req.pages) < stop:
                    raise ValueError(
                        f"the forward completes {stop} pages but the request holds {len(req.pages)}"
                    )
                self._offer(req.room, req.pages[:stop], 0)
                self._advance(req.room, stop)
                for layer in range(self.num_layers):
                    self._push(req.room, layer, start, mid, COMPUTED)
            except Exception as e:
                failed[req.room] = e
                continue
            if stop > mid:
                ranges[req.room] = (mid, stop)
        plan = ForwardPlan(ranges, self.num_layers, self._push) if ranges else None
        return plan, failed

    def forward_ended(self, plan: ForwardPlan) -> None:
        """After the forward: push the layers no event came for; when none came, switch to per-chunk sends
        (logged once)."""
        missing = plan.missing()
        if not missing:
            return
        for room, (start, stop) in plan.ranges.items():
            for layer in missing:
                self._push(room, layer, start, stop, CHUNK)
        if len(missing) == self.num_layers:
            self.layerwise = False
            logger.warning(
                "pd backend: no layer of the forward pass was written through MHATokenToKVPool.set_kv_buffer "
                "(another attention backend or KV pool), so KV is pushed per chunk after each forward pass"
            )
        else:
            logger.warning(
                "pd backend: layers %s were pushed after the forward pass (no write seen)", missing
            )


#: The plan of the forward pass running on this thread (set by ``run_batch_hook`` for its call only).
_CURRENT: contextvars.ContextVar[tuple[ForwardPlan, LayerPusher] | None] = contextvars.ContextVar(
    "pd_sglang_forward_plan", default=None
)


def run_batch_hook(
    original: Callable[..., Any], scheduler: Any, batch: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``Scheduler.run_batch``: plan the forward for the pd manager's rooms, run it, push what no layer
    event pushed. Any other backend (no ``plan_forward``), a decode batch or a plan that fails runs as is."""
    planned = None
    try:
        manager = compat.prefill_kv_manager(scheduler)
        plan_forward = getattr(manager, "plan_forward", None)
        if plan_forward is not None:
            planned = plan_forward(scheduler, batch)
    except Exception:
        logger.exception("pd backend: planning the layer-wise push failed (pushing per chunk)")
    if planned is None:
        return original(scheduler, batch, *args, **kwargs)
    token = _CURRENT.set(planned)
    try:
        result = original(scheduler, batch, *args, **kwargs)
    finally:
        _CURRENT.reset(token)
    plan, pusher = planned
    try:
        pusher.forward_ended(plan)
    except Exception:
        logger.exception("pd backend: pushing the layers left after the forward pass failed")
    return result


def set_kv_buffer_hook(result: Any, pool: Any, layer: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``MHATokenToKVPool.set_kv_buffer``: push the written layer of the current plan (if any)."""
    planned = _CURRENT.get()
    if planned is None:
        return None
    try:
        planned[0].layer_written(compat.written_layer(pool, layer, args, kwargs))
    except Exception:
        logger.exception("pd backend: the layer-wise push failed")
    return None
