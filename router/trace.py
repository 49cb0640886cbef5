"""The router's part of the first-token trace: when each stage of a P->D request happened in the router.

``Proxy`` (router process, one ``Stamps`` per disaggregated request attempt) marks the stages as the request
passes them; ``Tracer.end`` exports the spans between them as ``pd_router_stage_seconds{stage}`` and, with
``[server] trace_path`` set, appends a ``pd_connector.trace.TraceRecord`` (component ``router``) that joins the
engines' records on the transfer id (docs/architecture.md ``## First-token trace``).

Stages, in their usual order: ``received`` (the request reached the proxy), ``prefill_sent`` (P's leg
posted), ``decode_sent`` (D's leg posted or its stream opened), ``prefill_returned`` (P's leg answered: before
D's leg in vllm-standard, concurrently in the other flows), ``decode_first_event`` (D's first event or unary
answer; D's first token event where D's stream carries P's token), ``client_first_byte`` (the response
started towards the client), and where P's answer is the first token ``decode_continued`` (the first bytes of
D's own stream, the token after P's: the hand-off's end).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from pd_connector.timeline import Timeline, spans
from pd_connector.trace import TraceRecord, TraceWriter

STAGES = (
    "received",
    "prefill_sent",
    "decode_sent",
    "prefill_returned",
    "decode_first_event",
    "client_first_byte",
    "decode_continued",
)
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Stamps(Timeline):
    """The stages one disaggregated request passed in the router (first stamp of each stage kept), and the
    transfer id the engines know it by."""

    __slots__ = ("transfer_id",)

    def __init__(self, received: float) -> None:
        """``received``: the ``time.monotonic()`` reading taken when the request arrived."""
        super().__init__()
        self.transfer_id = ""
        self.mark("received", received)


class Tracer:
    """Exports each ended request's stamps: histograms always, trace lines when a path is configured."""

    def __init__(self, registry: CollectorRegistry, trace_path: str = "") -> None:
        self._stages = Histogram(
            "pd_router_stage_seconds",
            "P->D requests: seconds between consecutive stages in the router (label stage 'a->b', in the order "
            "they happened; docs/architecture.md, First-token trace)",
            ["stage"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self._writer = TraceWriter(trace_path) if trace_path else None

    def end(self, stamps: Stamps, state: str) -> None:
        """A disaggregated request ended (``state``: ``ok`` or why not)."""
        for span, seconds in spans(stamps.stamps, STAGES).items():
            self._stages.labels(span).observe(seconds)
        if self._writer is not None:
            self._writer.write(TraceRecord("router", stamps.transfer_id, dict(stamps.stamps), state))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
