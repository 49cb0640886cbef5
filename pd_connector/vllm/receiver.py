"""D side of the transfer: one loader thread per request, writing P's pushed blocks into D's KV cache.

Started by the worker-side connector (``start_load_kv``, D's worker process) for each request the
scheduler parked in WAITING_FOR_REMOTE_KVS. A loader connects to P's side channel, sends ``Hello`` with
the block range it needs, receives each layer's bytes directly into its own blocks (zero copy), and acks
``Done``. Every wait is bounded by ``load_timeout_s`` from the start of the load; on timeout, error or a
closed connection the load is reported failed and vLLM applies ``kv_load_failure_policy``. An aborted
request (client gone) closes the connection, which tells P to stop and free its blocks.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import socket
import threading
import time
from dataclasses import dataclass

from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.kv_layout import KVLayers, contiguous_runs
from pd_connector.vllm.metadata import RecvSpec
from pd_connector.vllm.stats import StatsRecorder
from pd_connector.vllm.wire import (
    PROTOCOL_VERSION,
    Ack,
    Done,
    Error,
    Hello,
    Layer,
    auth_token,
    recv_exact_into,
    recv_message,
    send_message,
)

# Under "vllm." so records go through the handlers vLLM configures in its processes.
logger = logging.getLogger(f"vllm.{__name__}")


class _Outcome(enum.Enum):
    RUNNING = "running"
    LOADED = "loaded"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass
class _Load:
    spec: RecvSpec
    outcome: _Outcome = _Outcome.RUNNING
    sock: socket.socket | None = None
    aborted: bool = False


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 hosts in brackets) -> ``(host, port)``; ``ValueError`` if malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"prefill address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


class KVLoader:
    """All loads of one D worker (thread-safe; the forward thread only starts, aborts and polls)."""

    def __init__(
        self, config: PDConnectorConfig, layers: KVLayers, block_size: int, stats: StatsRecorder
    ) -> None:
        self._config = config
        self._layers = layers
        self._block_size = block_size
        self._stats = stats
        self._lock = threading.Lock()
        self._loads: dict[str, _Load] = {}

    def start(self, spec: RecvSpec) -> None:
        load = _Load(spec)
        with self._lock:
            if spec.req_id in self._loads:
                raise RuntimeError(f"load for {spec.req_id} started twice")
            self._loads[spec.req_id] = load
        threading.Thread(target=self._run, args=(load,), name="pd-load", daemon=True).start()

    def abort(self, req_id: str) -> None:
        """Stop a load (its request was aborted); it is reported finished once the thread let go."""
        with self._lock:
            load = self._loads.get(req_id)
            if load is None:
                return
            load.aborted = True
            if load.sock is not None:
                with contextlib.suppress(OSError):
                    load.sock.shutdown(socket.SHUT_RDWR)

    def poll(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)`` request ids since the last poll; failed ids are also in finished."""
        finished: set[str] = set()
        failed: set[str] = set()
        with self._lock:
            for req_id, load in list(self._loads.items()):
                if load.outcome is _Outcome.RUNNING:
                    continue
                del self._loads[req_id]
                finished.add(req_id)
                if load.outcome is _Outcome.FAILED:
                    failed.add(req_id)
        return finished, failed

    def close(self) -> None:
        with self._lock:
            req_ids = list(self._loads)
        for req_id in req_ids:
            self.abort(req_id)

    def _run(self, load: _Load) -> None:
        spec = load.spec
        started = time.monotonic()
        deadline = started + self._config.load_timeout_s
        outcome = _Outcome.FAILED
        try:
            received = self._transfer(load, deadline)
            outcome = _Outcome.LOADED
            self._stats.received(received, transfer_s=time.monotonic() - started)
        except (OSError, ConnectionError, ValueError) as exc:
            if load.aborted:
                outcome = _Outcome.ABORTED
            else:
                logger.warning(
                    "PDConnector: loading %s from %s failed: %s", spec.transfer_id, spec.prefill_addr, exc
                )
                self._stats.failure()
        finally:
            with self._lock:
                if load.aborted and outcome is _Outcome.FAILED:
                    outcome = _Outcome.ABORTED
                load.outcome = outcome
                sock, load.sock = load.sock, None
            if sock is not None:
                sock.close()

    def _transfer(self, load: _Load, deadline: float) -> int:
        spec = load.spec
        end_block = -(-spec.num_tokens // self._block_size)
        sock = socket.create_connection(parse_addr(spec.prefill_addr), timeout=self._config.connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            load.sock = sock
            if load.aborted:
                raise ConnectionError("aborted")
        send_message(
            sock,
            Hello(
                version=PROTOCOL_VERSION,
                transfer_id=spec.transfer_id,
                auth=auth_token(self._config.secret, spec.transfer_id),
                start_block=spec.start_block,
                end_block=end_block,
                num_layers=self._layers.num_layers,
                block_bytes=self._layers.block_bytes,
                dtype=self._layers.dtype,
            ),
        )
        wanted = range(spec.start_block, end_block)
        received = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no KV within load_timeout_s={self._config.load_timeout_s}")
            sock.settimeout(remaining)
            message = recv_message(sock)
            if isinstance(message, Layer):
                if not 0 <= message.layer < self._layers.num_layers or any(
                    i not in wanted for i in message.block_indices
                ):
                    raise ConnectionError(f"P sent blocks outside the requested range: {message}")
                blocks = self._layers.blocks[message.layer]
                for first, count in contiguous_runs(message.block_indices, spec.block_ids):
                    run = blocks[first : first + count]
                    recv_exact_into(sock, run.data.cast("B"))
                    received += run.nbytes
            elif isinstance(message, Done):
                send_message(sock, Ack())
                return received
            elif isinstance(message, Error):
                raise ConnectionError(f"P refused: {message.reason}")
            else:
                raise ConnectionError(f"unexpected {type(message).__name__} from P")
