"""P's half of the PDConnector worker side: the requests one vLLM worker rank pushes to D, layer by layer.

Called by ``pd_connector.vllm.worker_side.WorkerSide`` in each worker process of a prefill server, from vLLM's
per-step hooks (``bind`` before the forward, ``save_kv_layer`` after each attention layer wrote its KV) and
from ``transfer_results`` when the transfer engine reports a push's end. It offers each scheduled request's
block table (again per chunk), pushes each layer's new blocks while the next layer computes, and finishes a
push once P's scheduler finished its request (``FinishedSend``: ``Done`` carries the token P sampled).

Staged (``pd_connector.staging``: the engine sees slots of a bounded host pool), a push takes slots only once
D's destinations arrived: until then it is held (``_Held``) and offered with no blocks, so D's destinations
wait for it at P's engine; P's slots are then only ever held by transfers whose D holds its own, which can
always finish, so P's and D's pools never wait on each other. A held push gets its slots first come, first
served, replays what it missed from the device cache (which keeps the request's blocks until vLLM is told
the push ended), and is aborted, never left waiting, when no slot came within ``kv_staging_wait_s``.
A push that ended early (D gone) is no longer fed by later chunks; it is reported to vLLM only once its
request also finished in P's scheduler (vLLM frees blocks of finished requests only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pd_connector.staging import BlockTables, transfer_owner
from pd_connector.transfer import TransferEngine, TransferResult, TransferState
from pd_connector.vllm.compat import TPRank
from pd_connector.vllm.metadata import PDConnectorMetadata, SendSpec

# Under "vllm." so records go through the handlers vLLM configures in its processes.
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class _Held:
    """A push waiting for staging slots: what it did meanwhile, replayed once the slots come."""

    block_ids: list[int]  # the latest table offered
    deadline: float | None = None  # set when it could use slots (D's destinations arrived)
    pushes: list[tuple[int, int, int]] = field(default_factory=list)  # (layer, first, end) table positions
    finished: tuple[int | None] | None = None  # (first token,) once P's scheduler finished the request


@dataclass
class _Push:
    """One request this rank pushes, from its first offer until vLLM was told it ended."""

    transfer_id: str
    ended: TransferResult | None = None  # the engine's result: no more pushes
    report: bool | None = None  # P's scheduler finished the request: tell vLLM (True) or not (False)
    offered: bool = False  # the engine knows the transfer (it ends and reports only those)
    aborted: bool = False  # abort sent (P's scheduler aborted it, or no staging slots came)
    held: _Held | None = None  # waiting for staging slots

    @property
    def live(self) -> bool:
        return self.ended is None and self.report is None and not self.aborted


class Pushes:
    """The pushes of one P worker rank, by request id, and the request of each transfer the engine runs."""

    def __init__(
        self, engine: TransferEngine, tables: BlockTables, block_size: int, tp: TPRank, wait_s: float
    ) -> None:
        self._eng = engine
        self._tables = tables
        self._block_size = block_size
        self._tp = tp
        self._wait_s = wait_s
        self._pushes: dict[str, _Push] = {}
        self._pushing: dict[str, str] = {}

    @property
    def pending(self) -> bool:
        """Whether the engine still runs a push of this rank."""
        return bool(self._pushing)

    def push(self, req_id: str) -> _Push | None:
        """The push of ``req_id`` (tests look at its state)."""
        return self._pushes.get(req_id)

    def bind(self, meta: PDConnectorMetadata, sends: bool) -> None:
        """Before the forward: offer this step's block tables (``sends``: this rank sends heads at all) and
        apply the requests P's scheduler finished. A rank that sends nothing reports each finished request at
        once: vLLM frees the blocks once every rank reported it."""
        self.release_held()  # pushes waiting for slots go before this step's new ones
        for spec in meta.sends:
            if sends and self._live(spec):
                self._offer(spec)
        for finished in meta.finished_sends:
            push = self._pushes.get(finished.req_id)
            if push is None:
                # Never offered (no step ran for it, or this rank sends nothing): nothing to wait for.
                push = self._pushes[finished.req_id] = _Push("", _never_offered(finished.req_id))
            elif push.ended is None and not finished.ok:
                self._abort(push, b"", "request aborted on the prefill side", warn=False)
            elif push.held is not None:
                push.held.finished = (finished.first_token,)
            elif push.ended is None and not push.aborted:
                # Every push of the prompt was issued by earlier steps (a finished request is not
                # scheduled again): Done follows once they landed, with the token D may continue from.
                self._eng.finish(push.transfer_id, finished.first_token)
            push.report = finished.report

    def save_kv_layer(self, meta: PDConnectorMetadata, layer: int, kv_layer: torch.Tensor) -> None:
        """After attention layer ``layer`` wrote its KV: push its new blocks of every live request."""
        for spec in meta.sends:
            if not self._live(spec):
                continue
            first = spec.start_token // self._block_size
            end = -(-spec.end_token // self._block_size)
            if spec.corrupt and self._tp.rank == self._tp.size - 1:  # one rank: every rank's bytes must count
                kv_layer[self._tables.kernel(spec.block_ids[first:end])] = 0
            held = self._pushes[spec.req_id].held
            if held is not None:
                held.pushes.append((layer, first, end))
            else:
                self._push(spec.transfer_id, spec.block_ids, layer, first, end)

    def release_held(self) -> None:
        """Give the held pushes whose D's destinations arrived their slots, in order while they suffice, and
        replay what they missed; one still without slots ``kv_staging_wait_s`` after its destinations came is
        aborted (D's load fails and falls back). Pushes behind one that waits wait too (first come, first
        served); one whose D never comes ends with P's lease."""
        now, blocked = time.monotonic(), False
        for push, held in [(p, p.held) for p in self._pushes.values() if p.held is not None]:
            if push.ended is not None:  # ended while it waited (lease): nothing to replay
                push.held = None
                continue
            if held.deadline is None:
                if self._eng.state(push.transfer_id) is not TransferState.TRANSFERRING:
                    continue  # no destinations yet: it needs no slots
                held.deadline = now + self._wait_s
            try:
                table = (
                    None
                    if blocked
                    else self._tables.reserve(transfer_owner("send", push.transfer_id), held.block_ids)
                )
            except ValueError as exc:  # the table grew past the pool while it waited
                self._abort(push, b"", str(exc))
                continue
            if table is None:
                blocked = True
                if now >= held.deadline:
                    self._abort(push, b"", f"no free staging slot within {self._wait_s} s")
                continue
            push.held = None
            self._eng.offer(push.transfer_id, table)
            for layer, first, end in held.pushes:
                self._push(push.transfer_id, held.block_ids, layer, first, end)
            if held.finished is not None:
                self._eng.finish(push.transfer_id, held.finished[0])

    def ended(self, result: TransferResult) -> str | None:
        """The engine reported this push's end: no more pushes; its request id, None if not this rank's."""
        req_id = self._pushing.pop(result.transfer_id, None)
        if req_id is not None:
            self._pushes[req_id].ended = result
        return req_id

    def reportable(self) -> set[str]:
        """The requests to report to vLLM as finished sending: their push ended and P's scheduler finished
        them (a push that ended for a request vLLM must not hear of is dropped silently)."""
        done = [r for r, p in self._pushes.items() if p.ended is not None and p.report is not None]
        return {req_id for req_id in done if self._pushes.pop(req_id).report}

    def _live(self, spec: SendSpec) -> bool:
        push = self._pushes.get(spec.req_id)
        return push is None or push.live

    def _offer(self, spec: SendSpec) -> None:
        """Offer ``spec``'s block table (staged: the slots standing for it, or none while the push is held).
        A longer table of a push holding slots is held too when the pool cannot extend it."""
        push = self._pushes.setdefault(spec.req_id, _Push(spec.transfer_id))
        self._pushing[spec.transfer_id] = spec.req_id
        if push.held is not None:  # still waiting: the table grew
            push.held.block_ids = list(spec.block_ids)
            return
        owner = transfer_owner("send", spec.transfer_id)
        table: list[int] | None
        try:
            if self._tables.holds_slots(owner):
                table = self._tables.reserve(owner, spec.block_ids)
            else:  # staged, before D's destinations: no slots yet, but refuse what could never fit
                self._tables.check_fits(owner, spec.block_ids)
                table = None
        except ValueError as exc:  # PoolTooSmall, or a table naming a block twice
            self._abort(push, spec.prompt_hash, str(exc))
            return
        if table is None:
            push.held = _Held(list(spec.block_ids))
            if push.offered:  # holds slots, so D's destinations are there: the wait starts now
                push.held.deadline = time.monotonic() + self._wait_s
        if not push.offered:
            self._eng.offer(spec.transfer_id, table or [], spec.prompt_hash)
            push.offered = True
        elif table is not None:
            self._eng.offer(spec.transfer_id, table)

    def _push(self, transfer_id: str, block_ids: Sequence[int], layer: int, first: int, end: int) -> None:
        """Push ``layer``'s manager table positions ``[first, end)``; staged, copy them into their slots first
        (the transport reads the slots)."""
        self._tables.to_slots(transfer_owner("send", transfer_id), layer, block_ids[first:end])
        per_block = self._tables.per_block
        self._eng.push_layer(transfer_id, layer, first * per_block, end * per_block)

    def _abort(self, push: _Push, prompt_hash: bytes, reason: str, warn: bool = True) -> None:
        """Abort ``push``'s transfer; the engine reports its end (offering it first if it never was)."""
        if push.aborted:
            return
        if warn:
            logger.warning("PDConnector: push of %s aborted: %s", push.transfer_id, reason)
        if not push.offered:
            self._eng.offer(push.transfer_id, [], prompt_hash)
            push.offered = True
        push.aborted, push.held = True, None
        self._eng.abort(push.transfer_id, reason)


def _never_offered(req_id: str) -> TransferResult:
    return TransferResult(
        transfer_id="", role="send", state=TransferState.ABORTED, reason=f"{req_id} not offered"
    )
