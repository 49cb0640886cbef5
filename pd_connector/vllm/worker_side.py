"""Worker-side half of the PDConnector (runs in each vLLM worker process, next to the KV cache tensors).

Maps vLLM's per-step and per-layer hooks onto the transfer objects:
- P (producer): ``PushServer`` listens on the side channel; ``bind`` registers this step's transfers,
  ``save_kv_layer`` (called right after each attention layer wrote its KV) queues that layer's new blocks,
  ``wait_for_save`` queues Done after the step that completed a prompt. Pushes run on connection threads, so
  the next layer computes while the previous one is on the wire.
- D (consumer): ``KVLoader`` runs one loader per parked request; ``start_load_kv`` starts them (vLLM calls
  it after the forward pass: loads are fully asynchronous, nothing in D's forward waits on them), and
  ``get_transfer_results`` reports finished and failed loads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.kv_layout import KVLayers
from pd_connector.vllm.metadata import PDConnectorMetadata
from pd_connector.vllm.receiver import KVLoader
from pd_connector.vllm.sender import PushServer
from pd_connector.vllm.stats import PDConnectorStats, StatsRecorder

# Under "vllm." so records go through the handlers vLLM configures in its processes.
logger = logging.getLogger(f"vllm.{__name__}")


class WorkerSide:
    """One worker's transfer endpoints (P: side-channel server, D: loader), created at KV registration."""

    def __init__(
        self, config: PDConnectorConfig, block_size: int, num_blocks: int, producer: bool, consumer: bool
    ) -> None:
        self._config = config
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._producer = producer
        self._consumer = consumer
        self._stats = StatsRecorder()
        self._server: PushServer | None = None
        self._loader: KVLoader | None = None
        self._layer_index: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        layers = KVLayers(kv_caches, self._num_blocks)
        self._layer_index = layers.index
        if self._producer:
            self._server = PushServer(self._config, layers, self._block_size, self._stats)
            logger.info(
                "PDConnector: side channel on %s:%d (%d layers, %d B/block, %s)",
                self._config.side_channel_host,
                self._server.port,
                layers.num_layers,
                layers.block_bytes,
                layers.dtype,
            )
        if self._consumer:
            self._loader = KVLoader(self._config, layers, self._block_size, self._stats)

    @property
    def side_channel_port(self) -> int | None:
        return None if self._server is None else self._server.port

    def bind(self, meta: PDConnectorMetadata) -> None:
        """Before the forward: announce this step's pushes and apply finished/aborted sends."""
        if self._server is None:
            return
        for spec in meta.sends:
            self._server.offer(spec)
        for finished in meta.finished_sends:
            self._server.request_finished(finished.req_id, finished.ok, finished.report)

    def start_load_kv(self, meta: PDConnectorMetadata) -> None:
        if self._loader is None:
            if meta.recvs:
                raise RuntimeError("PDConnector: loads scheduled on a worker without the consumer role")
            return
        for spec in meta.recvs:
            self._loader.start(spec)
        for req_id in meta.aborted_recvs:
            self._loader.abort(req_id)

    def save_kv_layer(self, meta: PDConnectorMetadata, layer_name: str) -> None:
        if self._server is None or not meta.sends:
            return
        layer = self._layer_index[layer_name]
        for spec in meta.sends:
            self._server.push_layer(spec, layer)

    def wait_for_save(self, meta: PDConnectorMetadata) -> None:
        """End of the step: Done follows the last layer of every prompt completed in this step."""
        if self._server is None:
            return
        for spec in meta.sends:
            if spec.completes_prompt:
                self._server.finish_prompt(spec)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call."""
        sending = self._server.poll_released() if self._server is not None else set()
        recving, failed = self._loader.poll() if self._loader is not None else (set(), set())
        return sending, recving, failed

    def stats(self) -> PDConnectorStats | None:
        return self._stats.drain()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._loader is not None:
            self._loader.close()
