"""The first-token trace: one JSON line per transfer side and per routed request, joined by transfer id.

Written, when a trace path is configured, by the vLLM connector's workers (``trace_path`` in
``kv_connector_extra_config``: one record per transfer each P and D rank took part in, with the engine's
request id) and by pd-router (``[server] trace_path``: one record per P->D request, with its stages in the
router). ``benchmarks.first_token`` and an operator's ``jq`` read them back; records of P, D and the router
for one request share ``transfer_id``, and their stamps are wall-clock seconds (same host: same clock).

Appends with one ``write`` per line on a file opened ``O_APPEND``, so the workers of several TP ranks (and
the router) can share one file without tearing lines.
"""

from __future__ import annotations

import os
import threading
from typing import Literal

import msgspec


class TraceRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """One side of one transfer (``component`` prefill/decode) or one routed request (router).

    ``stages``: stage -> wall-clock seconds (``pd_connector.timeline`` for the engines,
    ``router.trace`` for the router). ``state``: the transfer's end (done, failed, aborted) or, for the
    router, how the request ended (ok or the error kind).
    """

    component: Literal["prefill", "decode", "router"]
    transfer_id: str
    stages: dict[str, float]
    state: str = ""
    request_id: str = ""
    engine_id: str = ""
    bytes: int = 0
    reason: str = ""


class TraceWriter:
    """Appends ``TraceRecord`` lines to one file (thread-safe; a failed write is counted, never raised)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()
        self.errors = 0

    def write(self, record: TraceRecord) -> None:
        line = self._encoder.encode(record) + b"\n"
        with self._lock:
            try:
                os.write(self._fd, line)
            except OSError:
                self.errors += 1

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_trace(path: str) -> list[TraceRecord]:
    """Every record of a trace file, in the order written."""
    decoder = msgspec.json.Decoder(TraceRecord)
    with open(path, "rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]
