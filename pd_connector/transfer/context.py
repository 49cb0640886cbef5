"""What the sender and receiver halves of a transfer engine share: settings, transport, loop, results.

The I/O thread mutates transfer state; adapter threads read counters and drain results. The lock guards
exactly the data both sides of that boundary touch (counters and unreported results).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

from pd_connector.layout import KVLayout
from pd_connector.protocol import FrameCodec
from pd_connector.transfer.integrity import RegionBytes
from pd_connector.transfer.types import TransferConfig, TransferCounters, TransferResult, TransferState
from pd_connector.transport.base import Transport
from pd_connector.transport.loop_thread import LoopThread
from pd_connector.trust import PeerPolicy

logger = logging.getLogger("pd_connector.transfer")


class EngineContext:
    """Shared by ``Sender`` and ``Receiver`` of one ``TransferEngine``."""

    def __init__(
        self,
        config: TransferConfig,
        layout: KVLayout,
        transport: Transport,
        policy: PeerPolicy,
        kv_bytes: RegionBytes | None = None,
    ) -> None:
        self.config = config
        #: Our KV buffers' bytes, for the integrity checksums (``config.integrity_check``; None when off).
        self.kv_bytes = kv_bytes
        self.layout = layout
        self.transport = transport
        self.codec = FrameCodec(config.secret, config.max_frame_bytes)
        self.policy = policy
        self.io = LoopThread(f"pd-transfer-{config.engine_id}")
        self.lock = threading.Lock()
        self._counters = TransferCounters()
        self._results: dict[tuple[str, str], TransferResult] = {}
        self._reported = threading.Event()  # set while ``_results`` holds something

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.io.loop

    def count(self, **increments: float) -> None:
        """Add to named counters (any thread)."""
        with self.lock:
            for name, value in increments.items():
                setattr(self._counters, name, getattr(self._counters, name) + value)

    def count_layer(self, layer: int, nbytes: int, seconds: float) -> None:
        with self.lock:
            c = self._counters
            c.bytes_sent += nbytes
            c.layer_writes += 1
            c.layer_seconds += seconds
            c.per_layer_seconds[layer] = c.per_layer_seconds.get(layer, 0.0) + seconds

    def counters(self) -> TransferCounters:
        with self.lock:
            copy = dataclasses.replace(self._counters)
            copy.per_layer_seconds = dict(self._counters.per_layer_seconds)
            return copy

    def report(self, result: TransferResult) -> None:
        """Queue an ended transfer for ``poll`` (I/O thread; the caller already dropped its state)."""
        with self.lock:
            self._results[(result.role, result.transfer_id)] = result
            self._reported.set()
            if result.state is TransferState.FAILED:
                self._counters.failures += 1
            elif result.state is TransferState.ABORTED:
                self._counters.aborts += 1
        log = logger.info if result.state is TransferState.DONE else logger.warning
        log("transfer %s (%s) %s %s", result.transfer_id, result.role, result.state.value, result.reason)

    def reported_state(self, transfer_id: str) -> TransferState | None:
        with self.lock:
            for role in ("send", "recv"):
                if (role, transfer_id) in self._results:
                    return self._results[(role, transfer_id)].state
        return None

    def drain(self) -> list[TransferResult]:
        with self.lock:
            results = list(self._results.values())
            self._results.clear()
            self._reported.clear()
        return results

    def wait_reported(self, timeout_s: float) -> bool:
        """Block the calling (adapter) thread until a result is waiting for ``drain``, at most ``timeout_s``."""
        return self._reported.wait(timeout_s)

    def unreported(self) -> int:
        with self.lock:
            return len(self._results)
