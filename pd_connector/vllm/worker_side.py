"""Worker-side half of the PDConnector (runs in each vLLM worker process, next to the KV cache tensors).

Maps vLLM's per-step and per-layer hooks onto one ``pd_connector.transfer.TransferEngine`` (see the table
in docs/architecture.md). Every engine call returns at once; bytes move on the engine's I/O thread, so:
- P (producer): ``bind`` offers each scheduled request's block table (again per chunk), ``save_kv_layer``
  (called right after each attention layer wrote its KV) pushes that layer's new blocks while the next layer
  computes, and a request P's scheduler finished (``FinishedSend``, with the token P sampled) finishes its
  transfer: ``Done`` carries that token to D.
- D (consumer): ``start_load_kv`` expects each request the scheduler parked in WAITING_FOR_REMOTE_KVS
  (vLLM calls it after the forward pass: nothing in D's forward waits on these loads).
``transfer_results`` turns the engine's ended transfers into vLLM's finished/failed request ids, and
``first_tokens`` hands the tokens of D's finished loads to the scheduler side (first-token seeding). A P
transfer that ended is reported to vLLM only once its request also finished in P's scheduler (vLLM frees
blocks of finished requests only); one that ended early (D gone) is no longer fed by later chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pd_connector.layout import sends_heads
from pd_connector.metrics import reported_stages
from pd_connector.staging import HostStaging, byte_views, plan
from pd_connector.trace import TraceRecord, TraceWriter
from pd_connector.transfer import TransferEngine, TransferResult, TransferState
from pd_connector.transport.base import HOST
from pd_connector.transport.factory import create_transport
from pd_connector.vllm.compat import TPRank, kv_layout
from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.metadata import FirstTokens, PDConnectorMetadata, SendSpec
from pd_connector.vllm.stats import PDConnectorStats, StatsRecorder

#: Longest pause of an idle engine step while transfers are pending (bounds the spin); the step goes on at
#: once when a transfer ends, so a finished load waits for no timer.
IDLE_STEP_PAUSE_S = 0.005

# Under "vllm." so records go through the handlers vLLM configures in its processes.
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class _Push:
    """P: one request this rank pushes, from its first offer until vLLM was told it ended."""

    transfer_id: str
    ended: TransferResult | None = None  # the engine's result: no more pushes
    report: bool | None = None  # P's scheduler finished the request: tell vLLM (True) or not (False)

    @property
    def live(self) -> bool:
        return self.ended is None and self.report is None


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
        # P: each request's push by request id, and the request id of each transfer the engine still runs.
        self._pushes: dict[str, _Push] = {}
        self._pushing: dict[str, str] = {}
        # D: each request's load by request id, the request id of each load in flight, the loads that could
        # not even start (reported failed at the next step), and the blocks of loads reported failed since the
        # last ``take_failed_blocks`` (for vLLM builds that learn failures as block ids).
        self._loads: dict[str, _Load] = {}
        self._loading: dict[str, str] = {}
        self._unstarted: list[str] = []
        self._failed_blocks: set[int] = set()
        self._first_tokens: dict[str, int] = {}  # D: P's first token of loads finished, until reported
        self._trace = TraceWriter(config.trace_path) if config.trace_path else None
        self._staging: HostStaging | None = None  # a device cache behind a host-only transport

    # ---- start-up ----

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Describe the cache (host or CUDA, any of vLLM's layouts, MLA's latent) and hand it to a transfer
        engine: as it is when the transport reaches its memory (host; CUDA with UCX), else through pinned
        host mirrors (``staging``: a CUDA cache with tcp or cma)."""
        kv = kv_layout(kv_caches, self._num_blocks, self._tp)
        layout, buffers, memory = kv.layout, kv.buffers, kv.memory
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._sends = self._producer and sends_heads(layout)
        transport = create_transport(self._config.transport_config())
        path = "staged" if self._config.kv_staging == "always" else plan(kv.memory, transport.memory_types)
        if path == "staged":
            self._staging = HostStaging(layout, byte_views(list(kv_caches.values()), kv.buffers))
            buffers, memory = self._staging.host_buffers(), HOST
        self._engine = TransferEngine(
            self._config.transfer_config(self._engine_id, listen=self._producer, tp_rank=self._tp.rank),
            layout,
            buffers,
            transport,
            memory,
        )
        logger.info(
            "PDConnector worker: %s, data plane %s (%s %s memory), side channel %s, layout %s%s",
            " and ".join(r for r, on in (("producer", self._producer), ("consumer", self._consumer)) if on),
            transport.name,
            path,
            kv.memory,
            self._engine.address,
            layout,
            "" if self._sends or not self._producer else " (its heads are sent by a lower TP rank)",
        )

    @property
    def side_channel_addr(self) -> str | None:
        return None if self._engine is None else self._engine.address

    @property
    def _eng(self) -> TransferEngine:
        if self._engine is None:
            raise RuntimeError("PDConnector: KV caches were never registered")
        return self._engine

    # ---- P ----

    def _live(self, spec: SendSpec) -> bool:
        push = self._pushes.get(spec.req_id)
        return push is None or push.live

    def bind(self, meta: PDConnectorMetadata) -> None:
        """Before the forward: offer this step's block tables; apply requests P's scheduler finished.

        A rank that sends nothing (its heads replicated on a lower rank) offers nothing, and reports each
        finished request at once: vLLM frees the blocks once every rank reported it."""
        if not self._producer:
            return
        for spec in meta.sends:
            if self._sends and self._live(spec):
                self._pushes.setdefault(spec.req_id, _Push(spec.transfer_id))
                self._pushing[spec.transfer_id] = spec.req_id
                self._eng.offer(spec.transfer_id, spec.block_ids, spec.prompt_hash)
        for finished in meta.finished_sends:
            push = self._pushes.get(finished.req_id)
            if push is None:
                # Never offered (no step ran for it, or this rank sends nothing): nothing to wait for.
                push = self._pushes[finished.req_id] = _Push("", _never_offered(finished.req_id))
            elif push.ended is None and not finished.ok:
                self._eng.abort(push.transfer_id, "request aborted on the prefill side")
            elif push.ended is None:
                # Every push of the prompt was issued by earlier steps (a finished request is not
                # scheduled again): Done follows once they landed, with the token D may continue from.
                self._eng.finish(push.transfer_id, finished.first_token)
            push.report = finished.report

    def save_kv_layer(self, meta: PDConnectorMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not self._sends or not meta.sends:
            return
        layer = self._layer_index[layer_name]
        for spec in meta.sends:
            if not self._live(spec):
                continue
            first = spec.start_token // self._block_size
            end = -(-spec.end_token // self._block_size)
            if spec.corrupt and self._tp.rank == self._tp.size - 1:  # one rank: every rank's bytes must count
                kv_layer[spec.block_ids[first:end]] = 0
            if self._staging is not None:  # the transport reads the host mirror: fill it first
                self._staging.to_host(layer, spec.block_ids[first:end])
            self._eng.push_layer(spec.transfer_id, layer, first, end)

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
            try:
                self._eng.expect(
                    spec.transfer_id,
                    spec.prefill_addr,
                    spec.block_ids,
                    spec.num_tokens,
                    start_token=spec.start_block * self._block_size,
                    prompt_hash=spec.prompt_hash,
                )
            except ValueError as exc:
                logger.warning("PDConnector: cannot load %s: %s", spec.transfer_id, exc)
                self._stats.failure()
                self._unstarted.append(spec.req_id)
                continue
            self._loading[spec.transfer_id] = spec.req_id
        for req_id in meta.aborted_recvs:
            load = self._loads.get(req_id)
            if load is not None and load.transfer_id in self._loading:
                load.aborted = True
                self._eng.abort(load.transfer_id, "request aborted on the decode side")

    # ---- both ----

    def transfer_results(
        self, meta: PDConnectorMetadata | None = None
    ) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call.

        vLLM keeps stepping while transfers are pending, even with nothing to compute (D waiting for KV, P
        holding blocks for D's ack): a busy loop of EngineCore and worker that would take CPU from the
        prefill on the other core. On such idle steps the worker waits for a transfer to end, at most
        ``IDLE_STEP_PAUSE_S``.
        """
        if meta is not None and meta.idle_step and (self._loading or self._pushing) and self._engine:
            self._engine.wait(IDLE_STEP_PAUSE_S)
        recving: set[str] = set(self._unstarted)
        failed: set[str] = set(self._unstarted)
        self._unstarted.clear()
        if self._engine is not None:
            for result in self._engine.poll():
                if result.role == "send":
                    req_id = self._pushing.pop(result.transfer_id, None)
                    self._record(result, req_id)
                    if req_id is not None:
                        self._pushes[req_id].ended = result
                else:
                    req_id = self._loading.pop(result.transfer_id, None)
                    self._record(result, req_id)
                    if req_id is None:
                        continue
                    recving.add(req_id)
                    if self._staging is not None and result.state is TransferState.DONE:
                        self._staging.to_device(self._loads[req_id].blocks)  # before vLLM reads them
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
        sending: set[str] = set()
        for req_id in [r for r, p in self._pushes.items() if p.ended is not None and p.report is not None]:
            if self._pushes.pop(req_id).report:
                sending.add(req_id)
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


def _never_offered(req_id: str) -> TransferResult:
    return TransferResult(
        transfer_id="", role="send", state=TransferState.ABORTED, reason=f"{req_id} not offered"
    )
