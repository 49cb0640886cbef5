"""The backend's ``sglang:pd_connector_*`` metrics on SGLang's ``/metrics`` endpoint (``--enable-metrics``).

Same names (engine prefix ``sglang:`` for ``vllm:``) and meanings as the vLLM connector's: both come from
``pd_connector.metrics``. How they reach SGLang's endpoint: SGLang runs ``prometheus_client`` in multiprocess
mode. Its launcher sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the scheduler processes; every metric a
scheduler process creates writes its values to files in that directory, and the HTTP server's ``/metrics``
collects them all (``MultiProcessCollector``). So the KV manager, in the scheduler process, only has to create
its metrics with ``prometheus_client``; they are registered in no in-process registry (``registry=None``), which
nothing reads and where a second manager in one process would collide. ``prometheus_client`` is imported here,
in the scheduler process, never at plugin registration (the launcher imports the plugin before it sets the
directory, and ``prometheus_client`` picks its storage when first imported).

One family is the SGLang backend's own: ``sglang:pd_connector_layer_pushes_total{when, layer}`` (P), the
layer pushes by when they were made (``layerwise.FORWARD``: as the forward pass wrote the layer,
``COMPUTED``: before the forward, of pages computed earlier, ``CHUNK``: after a forward pass), so a test or
an operator sees whether the KV went layer by layer.

Who calls it: ``conn.PdKVManager`` creates one ``TransferMetrics`` per scheduler process when SGLang exports
metrics; its result thread calls ``record`` for every ended transfer, the scheduler thread ``failure`` when the
backend fails a room itself and ``layer_push`` for every push of a layer's pages (``layerwise.LayerPusher``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from pd_connector.metrics import PromMetrics, StatsRecorder, counter_name, reported_stages
from pd_connector.transfer.types import TransferResult


class TransferMetrics:
    """One scheduler process's transfer metrics, labelled ``labels`` (model, prefill/decode, TP rank)."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        from prometheus_client import Counter, Histogram

        self._stats = StatsRecorder()
        self._prom = PromMetrics(
            "sglang",
            functools.partial(Counter, registry=None),
            functools.partial(Histogram, registry=None),
            list(labels),
            {0: list(labels.values())},
        )
        self._labels = list(labels.values())
        self._layer_pushes = Counter(
            counter_name("sglang", "layer_pushes"),
            "P: pushes of one layer's pages to decode, by when they were made (forward: as the forward pass "
            "wrote the layer; computed: before the forward, of pages computed earlier; chunk: after a forward).",
            labelnames=[*labels, "when", "layer"],
            registry=None,
        )

    def layer_push(self, when: str, layer: int) -> None:
        """P pushed ``layer``'s pages of one room (``when``: ``layerwise.FORWARD``, ``COMPUTED`` or ``CHUNK``)."""
        self._layer_pushes.labels(*self._labels, when, str(layer)).inc()

    def record(self, result: TransferResult, layer_write_s: float) -> None:
        """An ended transfer, now applied to its room (D: ``reported``); ``layer_write_s``: the engine's running
        total of layer-write seconds."""
        self._stats.record(result, reported_stages(result))
        self._stats.write_total(layer_write_s)
        self._export()

    def failure(self) -> None:
        """The backend failed a room itself (it could not start or finish the transfer)."""
        self._stats.failure()
        self._export()

    def _export(self) -> None:
        data = self._stats.take()
        if data is not None:
            self._prom.observe(data)
