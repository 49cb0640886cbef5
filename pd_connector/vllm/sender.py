"""P side of the transfer: the side-channel listener and the per-transfer push queues (P's worker process).

The forward thread (``save_kv_layer`` inside each attention layer) only appends "layer L, blocks i..j" to
the transfer's queue and returns: it never touches the network. Each D connection is served by its own
thread, which sends queued layers straight from P's KV cache memory (zero copy) while the next layers
compute. Blocks of a request stay allocated on P until the transfer is released: D acknowledged, the
connection failed, the request was aborted, or the lease after the end of the prefill expired. The worker
reports released requests to vLLM's scheduler (``finished_sending``) which then frees the blocks.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.kv_layout import KVLayers, contiguous_runs
from pd_connector.vllm.metadata import SendSpec
from pd_connector.vllm.stats import StatsRecorder
from pd_connector.vllm.wire import (
    PROTOCOL_VERSION,
    Ack,
    Done,
    Error,
    Hello,
    Layer,
    check_auth,
    recv_message,
    send_message,
)

# Under "vllm." so records go through the handlers vLLM configures in its processes.
logger = logging.getLogger(f"vllm.{__name__}")

#: How often a connection thread waiting for the next layer checks that D is still there (seconds).
_PEER_CHECK_S = 0.1

#: How many released transfer ids P remembers, to answer a late D "expired" at once instead of waiting.
_RELEASED_MEMORY = 4096


def _peer_closed(conn: socket.socket) -> bool:
    """True if D closed its end (EOF or reset); D sends nothing while P pushes, so any readable is EOF."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class _State(enum.Enum):
    OPEN = "open"
    ACKED = "acked"
    FAILED = "failed"
    ABORTED = "aborted"
    EXPIRED = "expired"


@dataclass
class _Item:
    """One queue entry: a layer's blocks to push, or the end of the prefill (``layer is None``)."""

    layer: int | None
    indices: list[int]


@dataclass
class _Outgoing:
    req_id: str
    transfer_id: str
    prompt_len: int
    corrupt: bool = False
    block_ids: list[int] = field(default_factory=list)
    queue: collections.deque[_Item] = field(default_factory=collections.deque)
    state: _State = _State.OPEN
    connected: bool = False
    handler_active: bool = False
    sock: socket.socket | None = None
    scheduler_finished: bool = False
    report_release: bool = False
    lease_deadline: float | None = None
    compute_done_at: float | None = None
    first_push_at: float | None = None


class PushServer:
    """Side-channel listener plus push state of every transfer this P worker serves (thread-safe)."""

    def __init__(
        self, config: PDConnectorConfig, layers: KVLayers, block_size: int, stats: StatsRecorder
    ) -> None:
        self._config = config
        self._layers = layers
        self._block_size = block_size
        self._stats = stats
        self._cond = threading.Condition()
        self._by_transfer: dict[str, _Outgoing] = {}
        self._by_req: dict[str, _Outgoing] = {}
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._closed = False
        self._listener = socket.create_server(
            (config.side_channel_host, config.side_channel_port), reuse_port=False, backlog=128
        )
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="pd-side-channel", daemon=True)
        self._acceptor.start()

    # ---- called from the forward thread (vLLM worker) ----

    def offer(self, spec: SendSpec) -> None:
        """Register (or refresh) a transfer before this step's forward writes its blocks."""
        with self._cond:
            out = self._by_req.get(spec.req_id)
            if out is None:
                out = _Outgoing(spec.req_id, spec.transfer_id, spec.prompt_len, spec.corrupt)
                self._by_req[spec.req_id] = out
                self._by_transfer[spec.transfer_id] = out
                cached_blocks = -(-spec.start_token // self._block_size)
                if cached_blocks:
                    # Prefix-cache hit on P: those blocks are already computed; push them first.
                    for layer in range(self._layers.num_layers):
                        out.queue.append(_Item(layer, list(range(cached_blocks))))
            out.block_ids = list(spec.block_ids)
            self._cond.notify_all()

    def push_layer(self, spec: SendSpec, layer: int) -> None:
        """Queue the blocks this step wrote for ``layer``; the connection thread sends them."""
        first = spec.start_token // self._block_size
        last = -(-min(spec.end_token, spec.prompt_len) // self._block_size)
        with self._cond:
            out = self._by_req.get(spec.req_id)
            if out is None or out.state is not _State.OPEN:
                return
            if out.first_push_at is None:
                out.first_push_at = time.monotonic()
            out.queue.append(_Item(layer, list(range(first, last))))
            self._cond.notify_all()

    def finish_prompt(self, spec: SendSpec) -> None:
        """The step that wrote the last prompt token ended: queue Done behind the last layer."""
        with self._cond:
            out = self._by_req.get(spec.req_id)
            if out is None or out.state is not _State.OPEN:
                return
            out.compute_done_at = time.monotonic()
            out.queue.append(_Item(None, []))
            self._cond.notify_all()

    def request_finished(self, req_id: str, ok: bool, report: bool) -> None:
        """The scheduler finished the request: start the lease (ok) or abort the transfer (not ok)."""
        with self._cond:
            out = self._by_req.get(req_id)
            if out is None:
                if report:
                    # Never offered (no step ran): nothing to push, nothing holds the blocks.
                    out = _Outgoing(req_id, "", 0, state=_State.ABORTED)
                    self._by_req[req_id] = out
                else:
                    return
            out.scheduler_finished = True
            out.report_release = report
            if out.state is _State.OPEN:
                if ok:
                    out.lease_deadline = time.monotonic() + self._config.lease_s
                else:
                    self._end(out, _State.ABORTED)
            self._cond.notify_all()

    def poll_released(self) -> set[str]:
        """Request ids whose blocks P may free now (acked, failed, aborted or lease expired)."""
        now = time.monotonic()
        released: set[str] = set()
        with self._cond:
            for req_id, out in list(self._by_req.items()):
                if out.state is _State.OPEN and out.lease_deadline is not None and now > out.lease_deadline:
                    logger.warning("PDConnector: lease of transfer %s expired", out.transfer_id)
                    self._stats.expired_lease()
                    self._end(out, _State.EXPIRED)
                if out.scheduler_finished and out.state is not _State.OPEN and not out.handler_active:
                    del self._by_req[req_id]
                    if self._by_transfer.get(out.transfer_id) is out:
                        del self._by_transfer[out.transfer_id]
                    self._remember_released(out.transfer_id)
                    if out.report_release:
                        released.add(req_id)
        return released

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for out in self._by_req.values():
                if out.state is _State.OPEN:
                    self._end(out, _State.ABORTED)
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    # ---- internals (lock held where noted) ----

    def _end(self, out: _Outgoing, state: _State) -> None:
        """Move to a terminal state and wake the connection thread (lock held)."""
        out.state = state
        out.queue.clear()
        if out.sock is not None:
            with contextlib.suppress(OSError):
                out.sock.shutdown(socket.SHUT_RDWR)

    def _remember_released(self, transfer_id: str) -> None:
        self._released[transfer_id] = None
        while len(self._released) > _RELEASED_MEMORY:
            self._released.popitem(last=False)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="pd-push", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One D connection = one transfer: handshake, then push until Done+Ack, error or abort."""
        out: _Outgoing | None = None
        try:
            conn.settimeout(self._config.connect_timeout_s)
            hello = recv_message(conn)
            if not isinstance(hello, Hello):
                raise ConnectionError(f"expected Hello, got {type(hello).__name__}")
            problem = self._check_hello(hello)
            if problem:
                send_message(conn, Error(problem))
                logger.warning("PDConnector: refused transfer %s: %s", hello.transfer_id, problem)
                return
            out = self._attach(hello, conn)
            if out is None:
                send_message(conn, Error(f"transfer {hello.transfer_id} unknown or already released"))
                return
            conn.settimeout(self._config.load_timeout_s)
            self._push_loop(out, hello, conn)
        except (OSError, ConnectionError) as exc:
            if out is not None:
                with self._cond:
                    if out.state is _State.OPEN:
                        logger.warning("PDConnector: transfer %s failed: %s", out.transfer_id, exc)
                        self._stats.failure()
                        self._end(out, _State.FAILED)
        finally:
            if out is not None:
                with self._cond:
                    out.handler_active = False
                    out.sock = None
                    if out.state is _State.OPEN:
                        self._end(out, _State.FAILED)
                    self._cond.notify_all()
            conn.close()

    def _check_hello(self, hello: Hello) -> str:
        if hello.version != PROTOCOL_VERSION:
            return f"protocol version {hello.version} != {PROTOCOL_VERSION}"
        if not check_auth(self._config.secret, hello.transfer_id, hello.auth):
            return "authentication failed"
        layers = self._layers
        if (hello.num_layers, hello.block_bytes, hello.dtype) != (
            layers.num_layers,
            layers.block_bytes,
            layers.dtype,
        ):
            return (
                f"KV layout mismatch: D has {hello.num_layers} layers x {hello.block_bytes} B/block "
                f"{hello.dtype}, P has {layers.num_layers} x {layers.block_bytes} {layers.dtype}"
            )
        return ""

    def _attach(self, hello: Hello, conn: socket.socket) -> _Outgoing | None:
        """Wait until P's scheduler announced the transfer (D may be faster than P), then claim it."""
        deadline = time.monotonic() + self._config.load_timeout_s
        with self._cond:
            while True:
                if hello.transfer_id in self._released or self._closed:
                    return None
                out = self._by_transfer.get(hello.transfer_id)
                if out is not None:
                    if out.connected or out.state is not _State.OPEN:
                        return None
                    out.connected = True
                    out.handler_active = True
                    out.sock = conn
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def _next_item(self, out: _Outgoing, conn: socket.socket) -> _Item | None:
        """Block until the forward thread queued something; None once the transfer ended.

        While waiting, checks a few times a second whether D hung up (aborted or died), so P does not
        hold the blocks of a request nobody waits for until the prefill ends.
        """
        deadline = time.monotonic() + self._config.load_timeout_s
        with self._cond:
            while not out.queue:
                if out.state is not _State.OPEN:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"prefill of {out.transfer_id} made no progress")
                self._cond.wait(min(remaining, _PEER_CHECK_S))
                if not out.queue and _peer_closed(conn):
                    raise ConnectionError("D closed the connection")
            return out.queue.popleft()

    def _push_loop(self, out: _Outgoing, hello: Hello, conn: socket.socket) -> None:
        wanted = range(hello.start_block, hello.end_block)
        sent_bytes = 0
        while True:
            item = self._next_item(out, conn)
            if item is None:
                send_message(conn, Error(f"transfer {out.state.value} on P"))
                return
            if item.layer is None:
                break
            with self._cond:
                block_ids = list(out.block_ids)
            indices = [i for i in item.indices if i in wanted]
            if indices:
                send_message(conn, Layer(item.layer, indices))
                sent_bytes += self._send_blocks(conn, item.layer, indices, block_ids, out.corrupt)
        send_message(conn, Done(min(hello.end_block * self._block_size, out.prompt_len)))
        sent_at = time.monotonic()
        reply = recv_message(conn)
        if not isinstance(reply, Ack):
            raise ConnectionError(f"D answered {reply!r} instead of Ack")
        with self._cond:
            if out.state is _State.OPEN:
                out.state = _State.ACKED
            start = out.first_push_at or sent_at
            compute_done = out.compute_done_at or sent_at
        self._stats.sent(sent_bytes, transfer_s=sent_at - start, exposed_s=max(0.0, sent_at - compute_done))

    def _send_blocks(
        self, conn: socket.socket, layer: int, indices: list[int], block_ids: list[int], corrupt: bool
    ) -> int:
        blocks = self._layers.blocks[layer]
        total = 0
        for first, count in contiguous_runs(indices, block_ids):
            run = blocks[first : first + count]
            if corrupt:
                run = np.zeros_like(run)
            conn.sendall(run.data.cast("B"))
            total += run.nbytes
        return total
