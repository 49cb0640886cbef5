"""``PDConnector``: the thin facade vLLM instantiates (``"kv_connector": "PDConnector"``).

vLLM creates one instance with role SCHEDULER in the EngineCore process and one with role WORKER in each
worker process; this class only routes each ``KVConnectorBase_V1`` hook to ``SchedulerSide`` or
``WorkerSide`` (which hold all state) and converts between their types and vLLM's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pd_connector.vllm.compat import (
    CONNECTOR_SYMBOLS,
    StreamedFirstToken,
    check_kv_cache,
    check_version,
    hook_step_output,
    limit_busy_poll,
    require,
    schedule_ended_loads_at_once,
    tp_rank,
)
from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.metadata import FirstTokens, PDConnectorMetadata
from pd_connector.vllm.scheduler_side import SchedulerSide
from pd_connector.vllm.stats import PDConnectorStats, PDPromMetrics
from pd_connector.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class PDConnector(KVConnectorBase_V1):
    """Layer-wise KV push from prefill to decode engines (see pd_connector/vllm/__init__.py)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        check_version()
        require("PDConnector", CONNECTOR_SYMBOLS)
        check_kv_cache(kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ValueError("PDConnector needs --kv-transfer-config")
        self._config = PDConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        # Engine spin on steps that compute nothing; set per step in build_connector_meta / bind_connector_metadata.
        self._busy_poll = limit_busy_poll(self._config.idle_spin_s)
        block_size = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._load_error_blocks: set[int] = set()  # worker: failed loads learnt through get_finished
        if role == KVConnectorRole.SCHEDULER:
            hook_step_output()  # loads_to_fail and streamed_first_tokens act on each step's output
            schedule_ended_loads_at_once()  # a load that ended is scheduled without vLLM's idle pause
            self._scheduler = SchedulerSide(
                block_size,
                self._config.side_channel_addr,
                vllm_config.model_config.get_vocab_size(),
                vllm_config.model_config.max_model_len,
                producer=transfer.is_kv_producer,
                consumer=transfer.is_kv_consumer,
                policy=self._config.peer_policy(),
                allow_corruption=self._config.test_allow_corruption,
            )
        else:
            if kv_cache_config is None:
                raise ValueError("PDConnector worker needs the KV cache config")
            self._worker = WorkerSide(
                self._config,
                str(transfer.engine_id),
                block_size,
                kv_cache_config.num_blocks,
                producer=transfer.is_kv_producer,
                consumer=transfer.is_kv_consumer,
                tp=tp_rank(vllm_config),
            )

    # ---- helpers ----

    @property
    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side hook called on a worker-side PDConnector")
        return self._scheduler

    @property
    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side hook called on a scheduler-side PDConnector")
        return self._worker

    def _meta(self) -> PDConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PDConnectorMetadata):
            raise TypeError(f"PDConnector got {type(meta).__name__} metadata")
        return meta

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        meta = self._meta()
        self._busy_poll.idle = meta.idle_step  # this step and the wait for the next one
        self._work.bind(meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: D's requests only run after their whole KV arrived (async loads)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self._work.save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Nothing to wait for: pushes are asynchronous, and a transfer finishes once P's scheduler finished
        its request (``WorkerSide.bind``), when the first sampled token is known."""

    def build_connector_worker_meta(self) -> FirstTokens | None:
        return self._work.first_tokens()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._meta() if self.has_connector_metadata() else None
        sending, recving, failed = self._work.transfer_results(meta)
        self._work.take_failed_blocks()  # failed_recving reports them: vLLM must not see them twice
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The older interface (vLLM builds without ``get_transfer_results``): a failed load is finished
        receiving, and its blocks go to ``get_block_ids_with_load_errors`` in the same step, so vLLM applies
        its failure policy instead of decoding from blocks that never got their KV."""
        sending, recving, _ = self._work.transfer_results()
        self._load_error_blocks |= self._work.take_failed_blocks()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's stats: transfers (worker) or refused requests (scheduler); vLLM aggregates both."""
        return self._worker.stats() if self._worker is not None else self._sched.stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side ----

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._sched.build_connector_meta(scheduler_output)
        self._busy_poll.idle = meta.idle_step  # EngineCore's wait for this step's output
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched.update_connector_output(
            set(connector_output.finished_recving or ()), _first_tokens(connector_output)
        )

    def loads_to_fail(self, connector_output: KVConnectorOutput) -> set[str]:
        """Asked by ``compat.hook_step_output``'s hook (EngineCore), each step before vLLM handles the
        step's output: the requests to end with an error rather than go on unseeded (``SchedulerSide.loads_to_fail``)."""
        ended = set(connector_output.finished_recving or ()) | set(connector_output.failed_recving or ())
        return self._sched.loads_to_fail(ended, _first_tokens(connector_output))

    @property
    def streamed_first_tokens(self) -> dict[str, StreamedFirstToken]:
        """Read by ``compat.hook_step_output``'s hook (EngineCore) after vLLM built each step's outputs:
        the seeded requests whose stream is to carry P's token (``SchedulerSide``'s)."""
        return self._sched.streamed_first_tokens

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched.has_pending_work()

    # ---- metrics (class level: built in the API server process) ----

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PDConnectorStats(data=data) if data is not None else PDConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _first_tokens(connector_output: KVConnectorOutput) -> dict[str, int]:
    """P's first tokens of the loads the workers reported finished in this output (``FirstTokens``)."""
    meta = connector_output.kv_connector_worker_meta
    return meta.tokens if isinstance(meta, FirstTokens) else {}
