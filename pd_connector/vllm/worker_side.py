"""Worker-side half of the PDConnector (runs in each vLLM worker process, next to the KV cache tensors).

Maps vLLM's per-step and per-layer hooks onto one ``pd_connector.transfer.TransferEngine`` (see the table
in docs/architecture.md). Every engine call returns at once; bytes move on the engine's I/O thread, so:
- P (producer): ``bind`` and ``save_kv_layer`` go to ``worker_pushes.Pushes``, which offers each scheduled
  request's block table, pushes each layer's new blocks while the next layer computes, and finishes a push
  once P's scheduler finished its request (``Done`` carries the token P sampled).
- D (consumer): ``start_load_kv`` expects each request the scheduler parked in WAITING_FOR_REMOTE_KVS
  (vLLM calls it after the forward pass: nothing in D's forward waits on these loads).
When the cache is staged (``pd_connector.staging``: a device cache behind tcp or cma, or ``kv_staging =
always``), the engine sees slot ids of a bounded host pool instead of block ids (``staging.BlockTables``):
D reserves slots before it expects a load (a load that finds none waits in a queue, started as slots free up
or failed after ``kv_staging_wait_s``) and copies a load that ended well out of them; P's side is described
in ``worker_pushes``. Every transfer returns its slots when the engine reports its end.
``transfer_results`` turns the engine's ended transfers into vLLM's finished/failed request ids, and
``first_tokens`` hands the tokens of D's finished loads to the scheduler side (first-token seeding).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pd_connector.layout import sends_heads
from pd_connector.metrics import reported_stages
from pd_connector.staging import BlockTables, StagingPool, byte_views, plan, pool_slots, transfer_owner
from pd_connector.trace import TraceRecord, TraceWriter
from pd_connector.transfer import TransferEngine, TransferResult, TransferState
from pd_connector.transport.base import HOST
from pd_connector.transport.factory import create_transport
from pd_connector.vllm.compat import TPRank, kv_layout
from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.metadata import FirstTokens, PDConnectorMetadata, RecvSpec
from pd_connector.vllm.stats import PDConnectorStats, StatsRecorder
from pd_connector.vllm.worker_pushes import Pushes

#: Longest pause of an idle engine step while transfers are pending (bounds the spin); the step goes on at
#: once when a transfer ends, so a finished load waits for no timer.
IDLE_STEP_PAUSE_S = 0.005

# Under "vllm." so records go through the handlers vLLM configures in its processes.
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class _Load:
    """D: one request's load, from ``start_load_kv`` until vLLM was told it ended."""

    transfer_id: str
    blocks: list[int]  # the blocks it writes (failed loads report them)
    aborted: bool = False  # D's scheduler aborted the request itself: not a load failure


class WorkerSide:
    """One worker's transfer engine and the request-id bookkeeping around it."""

    def __init__(
        self,
        config: PDConnectorConfig,
        engine_id: str,
        block_size: int,
        num_blocks: int,
        producer: bool,
        consumer: bool,
        tp: TPRank | None = None,
    ) -> None:
        self._config = config
        self._tp = tp or TPRank()
        if producer and self._tp.size > 1 and config.side_channel_port == 0:
            raise ValueError(
                "PDConnector: side_channel_port must be set under tensor parallelism (rank k listens on it + k)"
            )
        self._engine_id = f"{engine_id}-tp{self._tp.rank}" if self._tp.size > 1 else engine_id
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._producer = producer
        self._consumer = consumer
        self._stats = StatsRecorder()
        self._engine: TransferEngine | None = None
        self._sends = producer  # False on a P rank whose heads every D takes from a lower rank
        self._layer_index: dict[str, int] = {}
        self._tables = BlockTables(1, None)  # set from the cache's shape and the staging plan
        self._pushes: Pushes | None = None  # P: set when the caches are registered
        # D: each request's load by request id, the request id of each load in flight, the loads that could
        # not even start (reported failed at the next step), and the blocks of loads reported failed since the
        # last ``take_failed_blocks`` (for vLLM builds that learn failures as block ids).
        self._loads: dict[str, _Load] = {}
        self._loading: dict[str, str] = {}
        self._queued: dict[str, tuple[RecvSpec, float]] = {}  # loads waiting for staging slots, deadline
        self._unstarted: list[str] = []
        self._dropped: list[str] = []  # queued loads D aborted: finished, not failed
        self._failed_blocks: set[int] = set()
        self._first_tokens: dict[str, int] = {}  # D: P's first token of loads finished, until reported
        self._trace = TraceWriter(config.trace_path) if config.trace_path else None
        self._ended: list[TransferResult] = []  # collected from the engine, not yet reported to vLLM

    # ---- start-up ----

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Describe the cache (host or CUDA, any of vLLM's layouts, MLA's latent) and hand it to a transfer
        engine: as it is when the transport reaches its memory (host; CUDA with UCX), else through pinned
        a bounded pool of pinned host slots (``staging``: a CUDA cache with tcp or cma)."""
        kv = kv_layout(kv_caches, self._num_blocks, self._tp, self._block_size)
        layout, buffers, memory = kv.layout, kv.buffers, kv.memory
        per_block = max(1, self._block_size // layout.block_tokens)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._sends = self._producer and sends_heads(layout)
        transport = create_transport(self._config.transport_config(self._tp.rank))
        path = "staged" if self._config.kv_staging == "always" else plan(kv.memory, transport.memory_types)
        staging: StagingPool | None = None  # a device cache behind a host-only transport
        if path == "staged":
            slots = pool_slots(layout, self._num_blocks * per_block, self._config.kv_staging_pool_mib)
            staging = StagingPool(layout, byte_views(list(kv_caches.values()), kv.buffers), slots)
            layout, buffers, memory = staging.layout, staging.host_buffers(), HOST
        self._tables = BlockTables(per_block, staging)
        self._engine = TransferEngine(
            self._config.transfer_config(self._engine_id, listen=self._producer, tp_rank=self._tp.rank),
            layout,
            buffers,
            transport,
            memory,
        )
        logger.info(
            "PDConnector worker: %s, data plane %s (%s %s memory%s), side channel %s, layout %s%s",
            " and ".join(r for r, on in (("producer", self._producer), ("consumer", self._consumer)) if on),
            transport.name,
            path,
            kv.memory,
            "" if staging is None else f", {staging.table.capacity} staging slots",
            self._engine.address,
            layout,
            "" if self._sends or not self._producer else " (its heads are sent by a lower TP rank)",
        )
        if self._producer:
            wait_s = self._config.kv_staging_wait_s
            self._pushes = Pushes(self._engine, self._tables, self._block_size, self._tp, wait_s)

    @property
    def side_channel_addr(self) -> str | None:
        return None if self._engine is None else self._engine.address

    @property
    def _eng(self) -> TransferEngine:
        if self._engine is None:
            raise RuntimeError("PDConnector: KV caches were never registered")
        return self._engine

    # ---- P ----

    @property
    def _p(self) -> Pushes:
        if self._pushes is None:
            raise RuntimeError("PDConnector: KV caches were never registered")
        return self._pushes

    def bind(self, meta: PDConnectorMetadata) -> None:
        """Before the forward: offer this step's block tables; apply requests P's scheduler finished."""
        if not self._producer:
            return
        self._drain()
        self._p.bind(meta, self._sends)

    def save_kv_layer(self, meta: PDConnectorMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        if self._sends and meta.sends:
            self._p.save_kv_layer(meta, self._layer_index[layer_name], kv_layer)

    # ---- D ----

    def start_load_kv(self, meta: PDConnectorMetadata) -> None:
        """Expect each load the scheduler planned; one that cannot start fails (vLLM's failure policy then
        applies to that request) and never raises: an exception here would kill the engine."""
        for spec in meta.recvs:
            self._loads[spec.req_id] = _Load(spec.transfer_id, spec.block_ids[spec.start_block :])
            if not self._consumer:
                logger.error(
                    "PDConnector: load of %s planned on a worker without the consumer role", spec.req_id
                )
                self._stats.failure()
                self._unstarted.append(spec.req_id)
                continue
            self._queued[spec.req_id] = (spec, time.monotonic() + self._config.kv_staging_wait_s)
        self._start_queued()
        for req_id in meta.aborted_recvs:
            if self._queued.pop(req_id, None) is not None:  # never started: nothing to abort
                self._dropped.append(req_id)
                continue
            load = self._loads.get(req_id)
            if load is not None and load.transfer_id in self._loading:
                load.aborted = True
                self._eng.abort(load.transfer_id, "request aborted on the decode side")

    def _start_queued(self) -> None:
        """Start the queued loads in order while slots suffice (direct: all at once); a load that cannot get
        slots within ``kv_staging_wait_s``, or ever (more than the pool), fails and never hangs. Loads behind
        one that waits wait too (first come, first served: a large load is not starved by small ones)."""
        now, blocked = time.monotonic(), False
        for req_id, (spec, deadline) in list(self._queued.items()):
            table: list[int] | None = None
            try:
                table = (
                    None
                    if blocked
                    else self._tables.reserve(transfer_owner("recv", spec.transfer_id), spec.block_ids)
                )
            except ValueError as exc:  # PoolTooSmall, or a table naming a block twice
                self._fail_unstarted(req_id, str(exc))
                continue
            if table is None:
                blocked = True
                if now >= deadline:
                    self._fail_unstarted(
                        req_id, f"no free staging slot within {self._config.kv_staging_wait_s} s"
                    )
                continue
            del self._queued[req_id]
            try:
                self._eng.expect(
                    spec.transfer_id,
                    spec.prefill_addr,
                    table,
                    spec.num_tokens,
                    start_token=spec.start_block * self._block_size,
                    prompt_hash=spec.prompt_hash,
                )
            except ValueError as exc:
                self._tables.release(transfer_owner("recv", spec.transfer_id))
                self._fail_unstarted(req_id, str(exc))
                continue
            self._loading[spec.transfer_id] = req_id

    def _fail_unstarted(self, req_id: str, reason: str) -> None:
        """A load that never reached the engine: reported failed at the next ``transfer_results``."""
        self._queued.pop(req_id, None)
        logger.warning("PDConnector: cannot load %s: %s", self._loads[req_id].transfer_id, reason)
        self._stats.failure()
        self._unstarted.append(req_id)

    # ---- both ----

    def _drain(self) -> None:
        """Collect the transfers that ended from the engine. A staged one returns its slots here, a load that
        ended well first copied out of them (before it is reported, so before vLLM reads the blocks)."""
        if self._engine is None:
            return
        for result in self._engine.poll():
            owner = transfer_owner(result.role, result.transfer_id)
            if result.role == "recv" and result.state is TransferState.DONE:
                req_id = self._loading.get(result.transfer_id)
                if req_id is not None:
                    self._tables.from_slots(owner, self._loads[req_id].blocks)
            self._tables.release(owner)
            self._ended.append(result)

    def transfer_results(
        self, meta: PDConnectorMetadata | None = None
    ) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call.

        vLLM keeps stepping while transfers are pending, even with nothing to compute (D waiting for KV, P
        holding blocks for D's ack): a busy loop of EngineCore and worker that would take CPU from the
        prefill on the other core. On such idle steps the worker waits for a transfer to end, at most
        ``IDLE_STEP_PAUSE_S``.
        """
        pending = self._loading or self._queued or (self._pushes is not None and self._pushes.pending)
        if meta is not None and meta.idle_step and pending and self._engine:
            self._engine.wait(IDLE_STEP_PAUSE_S)
        self._drain()
        # Slots the ended transfers freed go to the transfers waiting for them.
        if self._pushes is not None:
            self._pushes.release_held()
        self._start_queued()
        recving: set[str] = set(self._unstarted) | set(self._dropped)
        failed: set[str] = set(self._unstarted)
        self._unstarted.clear()
        self._dropped.clear()
        ended, self._ended = self._ended, []
        for result in ended:
            if result.role == "send":
                self._record(result, self._p.ended(result))
            else:
                req_id = self._loading.pop(result.transfer_id, None)
                self._record(result, req_id)
                if req_id is None:
                    continue
                recving.add(req_id)
                if result.first_token is not None:
                    self._first_tokens[req_id] = result.first_token
                # Anything but DONE leaves the blocks without (all of) the KV: unless D itself aborted
                # the request, vLLM must apply kv_load_failure_policy (P aborting counts as a failure).
                if result.state is not TransferState.DONE and not self._loads[req_id].aborted:
                    logger.warning(
                        "PDConnector: load of %s %s: %s",
                        result.transfer_id,
                        result.state.value,
                        result.reason,
                    )
                    failed.add(req_id)
        for req_id in recving:
            load = self._loads.pop(req_id, None)
            if req_id in failed and load is not None:
                self._failed_blocks.update(load.blocks)
        sending = set() if self._pushes is None else self._pushes.reportable()
        return sending, recving, failed

    def first_tokens(self) -> FirstTokens | None:
        """P's first token of each load reported finished since the last call (from P's ``Done``), for the
        scheduler side; None when there is none."""
        if not self._first_tokens:
            return None
        tokens, self._first_tokens = self._first_tokens, {}
        return FirstTokens(tokens)

    def take_failed_blocks(self) -> set[int]:
        """D block ids of loads reported failed since the last call (they hold no valid KV)."""
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def _record(self, result: TransferResult, req_id: str | None) -> None:
        """Count an ended transfer, export where its time went, and trace it (D: ``reported`` is now, when
        vLLM learns of it)."""
        stages = reported_stages(result)
        self._stats.record(result, stages)
        if self._trace is not None:
            self._trace.write(
                TraceRecord(
                    component="prefill" if result.role == "send" else "decode",
                    transfer_id=result.transfer_id,
                    stages=stages,
                    state=result.state.value,
                    request_id=req_id or "",
                    engine_id=self._engine_id,
                    bytes=result.bytes,
                    reason=result.reason,
                )
            )

    def stats(self) -> PDConnectorStats | None:
        if self._engine is not None:
            self._stats.write_total(self._engine.counters().layer_seconds)
        return self._stats.drain()

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.close()
        if self._trace is not None:
            self._trace.close()
