"""The side channel under hostile or broken peers: foreign bytes, bad versions, silence, killed processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import msgspec
import numpy as np
import pytest

from pd_connector.protocol import (
    HEADER,
    MAGIC,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Destinations,
    Heartbeat,
    Hello,
    HelloAck,
    Memory,
    Message,
    Ready,
    Refused,
)
from pd_connector.transfer import TransferEngine, TransferState
from pd_connector.transport.base import BlockCopy
from pd_connector.transport.loopback import LoopbackFabric, LoopbackTransport
from pd_connector.transport.tcp import TcpTransport
from tests.pd_connector.engines import (
    SLACK_S,
    SMALL,
    KVCache,
    addr,
    assert_no_state,
    closing,
    make_engine,
    wait_results,
)
from tests.pd_connector.raw_peer import RawPeer, hello
from tests.polling import wait_until

FAST = {
    "heartbeat_interval_s": 0.1,
    "heartbeat_timeout_s": 0.6,
    "abort_grace_s": 0.5,
    "connect_timeout_s": 1.0,
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Prefill:
    """A listening prefill engine, plus decode memory registered in the same fabric for raw peers."""

    def __init__(self, transport: type[LoopbackTransport] = LoopbackTransport, **config: object) -> None:
        self.fabric = LoopbackFabric()
        self.cache = KVCache(SMALL, 16, seed=3)
        self.engine = make_engine(self.cache, transport(self.fabric), True, "P", **{**FAST, **config})
        self.addr = addr(self.engine)
        self.d_cache = KVCache(SMALL, 16, seed=None)
        self.d_transport = LoopbackTransport(self.fabric)
        self.d_memory = self.d_transport.register(SMALL.regions(self.d_cache.buffers()))

    def close(self) -> None:
        self.engine.close()
        self.d_transport.close()


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    p = Prefill()
    yield p
    p.close()


def _run_transfer(p: TransferEngine, d: TransferEngine, tid: str) -> None:
    d.expect(tid, addr(p), [5, 6], 8)
    p.offer(tid, [1, 2])
    for layer in range(SMALL.num_layers):
        p.push_layer(tid, layer)
    p.finish(tid)
    assert wait_results(d, {tid})[tid].state is TransferState.DONE
    assert wait_results(p, {tid})[tid].state is TransferState.DONE


def test_foreign_and_garbage_bytes_are_dropped_while_others_work(
    prefill: Prefill, caplog: pytest.LogCaptureFixture
) -> None:
    d_cache = KVCache(SMALL, 16, None)  # must outlive the engine: it holds raw addresses
    d = make_engine(d_cache, LoopbackTransport(prefill.fabric), False, "D", **FAST)
    with closing(d):
        _run_transfer(prefill.engine, d, "before")  # an established, healthy connection
        attacks = {
            "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            "random": np.random.default_rng(0).integers(0, 256, 64, np.uint8).tobytes(),
            "huge": HEADER.pack(MAGIC, 1 << 31),
            "msgpack": HEADER.pack(MAGIC, 5) + b"\xc1\xc1\xc1\xc1\xc1",
        }
        socks = {}
        for name, payload in attacks.items():
            socks[name] = RawPeer.connect(prefill.addr)
            socks[name].sock.sendall(payload)
        # A peer that handshakes correctly and then sends garbage is dropped too.
        late = RawPeer.connect(prefill.addr)
        assert isinstance(late.handshake(hello(SMALL), prefill.d_memory), Ready)
        late.sock.sendall(b"\x00" * 32)
        for name, peer in [*socks.items(), ("late", late)]:
            assert peer.closed_by_peer(), f"{name} connection was not dropped"
            peer.close()
        _run_transfer(prefill.engine, d, "after")  # the old connection still works
        d2_cache = KVCache(SMALL, 16, None)  # must outlive the engine: it holds raw addresses
        d2 = make_engine(d2_cache, LoopbackTransport(prefill.fabric), False, "D2", **FAST)
        with closing(d2):
            _run_transfer(prefill.engine, d2, "new")  # and the server accepts new ones
        for text in ("bad magic", "exceeds max_frame_bytes", "undecodable", "dropping connection"):
            assert text in caplog.text, text
        assert prefill.engine.counters().rejected_connections == 4
        assert_no_state(prefill.engine, d)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, f"protocol version mismatch: decode speaks 99, prefill {PROTOCOL_VERSION}"),
        ({"transport": "tcp"}, "transport mismatch: decode uses 'tcp', prefill 'loopback'"),
        ({"layout_hash": "0" * 64}, "layout_hash does not match"),
        ({"nonce": b"short"}, "nonce must be 16 bytes"),
        ({"memory": b"\x00\x00\x00\x00\x00\x00\x99\x99"}, "cannot attach loopback transport"),
    ],
)
def test_bad_handshakes_are_refused_with_a_clear_message(
    prefill: Prefill, change: dict[str, object], message: str
) -> None:
    peer = RawPeer.connect(prefill.addr)
    memory = change.pop("memory", prefill.d_memory)
    assert isinstance(memory, bytes)
    reply = peer.handshake(msgspec.structs.replace(hello(SMALL), **change), memory)
    assert isinstance(reply, Refused) and message in reply.reason
    assert peer.closed_by_peer()
    peer.close()


def test_handshake_must_come_within_the_connect_timeout(prefill: Prefill) -> None:
    peer = RawPeer.connect(prefill.addr)
    t0 = time.monotonic()
    assert peer.closed_by_peer(timeout_s=5)
    assert time.monotonic() - t0 < FAST["connect_timeout_s"] + SLACK_S
    peer.close()


def test_silent_decode_is_dropped_and_its_transfers_released(prefill: Prefill) -> None:
    peer = RawPeer.connect(prefill.addr)
    assert isinstance(peer.handshake(hello(SMALL), prefill.d_memory), Ready)
    peer.send(Destinations("hb", 8, 30.0, block_ids=[1, 2]))
    prefill.engine.offer("hb", [3, 4])
    prefill.engine.push_layer("hb", 0)
    t0 = time.monotonic()
    r = wait_results(prefill.engine, {"hb"}, timeout_s=5)["hb"]  # no heartbeats from the raw peer
    assert r.state is TransferState.FAILED and "no heartbeat" in r.reason
    assert time.monotonic() - t0 < FAST["heartbeat_timeout_s"] + SLACK_S
    sizes = prefill.engine.table_sizes()
    assert sizes["peers"] == 0
    assert_no_state(prefill.engine)
    peer.close()


def test_silent_prefill_fails_decode_before_its_load_timeout() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def fake_prefill() -> None:  # completes the handshake, then never says anything again
        sock, _ = server.accept()
        peer = RawPeer(sock)
        hello_msg = peer.recv()
        assert isinstance(hello_msg, Hello)
        peer.send(HelloAck("silent", SMALL.compat_hash(), b"p" * NONCE_BYTES, hello_msg.nonce, SMALL))
        peer.codec = peer.codec.session(hello_msg.nonce, b"p" * NONCE_BYTES)
        assert isinstance(peer.recv(), Memory)
        peer.send(Ready())
        stop.wait(10)
        peer.close()

    thread = threading.Thread(target=fake_prefill, daemon=True)
    thread.start()
    d_cache = KVCache(SMALL, 16, None)  # must outlive the engine: it holds raw addresses
    # tcp: D can fence a lost P's data connections, so it fails at once (a transport that cannot fence keeps
    # the blocks until P's deadline instead: tests/pd_connector/test_fence.py).
    d = make_engine(d_cache, TcpTransport(), False, "D", **FAST)
    with closing(d):
        t0 = time.monotonic()
        d.expect("s", f"127.0.0.1:{server.getsockname()[1]}", [1], 4, timeout_s=30)
        r = wait_results(d, {"s"}, timeout_s=5)["s"]
        assert r.state is TransferState.FAILED and "no heartbeat" in r.reason
        assert time.monotonic() - t0 < FAST["heartbeat_timeout_s"] + SLACK_S
        assert_no_state(d)
    stop.set()
    thread.join(5)
    server.close()


def test_unreachable_prefill_fails_fast() -> None:
    port = socket.create_server(("127.0.0.1", 0))
    dead = port.getsockname()[1]
    port.close()
    d_cache = KVCache(SMALL, 16, None)  # must outlive the engine: it holds raw addresses
    d = make_engine(d_cache, LoopbackTransport(LoopbackFabric()), False, "D", **FAST)
    with closing(d):
        d.expect("u", f"127.0.0.1:{dead}", [1], 4, timeout_s=30)
        r = wait_results(d, {"u"}, timeout_s=5)["u"]
        assert r.state is TransferState.FAILED and "cannot connect" in r.reason
        assert_no_state(d)


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.pd_connector.raw_peer", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _read_until(proc: subprocess.Popen[str], word: str, timeout_s: float = 20) -> str:
    assert proc.stdout is not None
    result: list[str] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(word):
                result.append(line)
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert result, f"peer process never printed {word!r}"
    return result[0]


def test_decode_process_killed_mid_transfer_releases_prefill(prefill: Prefill) -> None:
    layout_json = msgspec.json.encode(SMALL).decode()
    proc = _spawn("decode", prefill.addr, layout_json, prefill.d_memory.hex())
    try:
        _read_until(proc, "Ready")
        prefill.engine.offer("killme", [3, 4])
        prefill.engine.push_layer("killme", 0)
        _read_until(proc, "LayerDone")  # layer 0 landed, layers 1-2 still to come: mid-transfer
        assert prefill.engine.state("killme") is TransferState.TRANSFERRING
        os.killpg(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        r = wait_results(prefill.engine, {"killme"}, timeout_s=5)["killme"]
        assert r.state is TransferState.FAILED and "lost" in r.reason
        assert time.monotonic() - t0 < FAST["heartbeat_timeout_s"] + SLACK_S
        prefill.engine.push_layer("killme", 1)  # the adapter's late call is harmless
        assert prefill.engine.table_sizes()["peers"] == 0
        assert_no_state(prefill.engine)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_prefill_process_killed_mid_transfer_fails_decode() -> None:
    proc = _spawn("prefill", msgspec.json.encode(SMALL).decode())
    d_cache = KVCache(SMALL, 16, None)  # must outlive the engine: it holds raw addresses
    d = make_engine(d_cache, LoopbackTransport(LoopbackFabric()), False, "D", **FAST)
    try:
        with closing(d):
            port = _read_until(proc, "listening").split()[1]
            d.expect("k", f"127.0.0.1:{port}", [1, 2], 8, timeout_s=30)
            _read_until(proc, "Destinations")
            wait_until(lambda: d.state("k") is TransferState.TRANSFERRING, 5, "D receiving")
            os.killpg(proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            r = wait_results(d, {"k"}, timeout_s=5)["k"]
            assert r.state is TransferState.FAILED and "lost" in r.reason
            assert time.monotonic() - t0 < FAST["heartbeat_timeout_s"] + SLACK_S
            assert_no_state(d)
            assert d.table_sizes()["links"] == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _connected_raw_decode(prefill: Prefill) -> RawPeer:
    peer = RawPeer.connect(prefill.addr)
    assert isinstance(peer.handshake(hello(SMALL), prefill.d_memory), Ready)
    return peer


def _next_non_heartbeat(peer: RawPeer) -> Message | None:
    while isinstance(msg := peer.recv(), Heartbeat):
        pass
    return msg


def test_bad_or_duplicate_destinations_are_answered_with_abort(prefill: Prefill) -> None:
    peer = _connected_raw_decode(prefill)
    peer.send(Destinations("small", 12, 30.0, block_ids=[1, 2]))  # 2 blocks of 4 cannot hold 12 tokens
    msg = _next_non_heartbeat(peer)
    assert isinstance(msg, Abort) and msg.failure and "cannot hold 12 tokens" in msg.reason
    peer.send(Destinations("dup", 8, 30.0, block_ids=[1, 2]))
    peer.send(Destinations("dup", 8, 30.0, block_ids=[3, 4]))
    msg = _next_non_heartbeat(peer)
    assert isinstance(msg, Abort) and "already given" in msg.reason
    peer.send(Abort("dup", "never mind"))
    msg = _next_non_heartbeat(peer)
    assert msg == Ack("dup")
    assert_no_state(prefill.engine)
    peer.close()


def test_destinations_never_offered_expire_with_the_lease() -> None:
    prefill = Prefill(lease_s=0.3)
    try:
        peer = _connected_raw_decode(prefill)
        peer.send(Destinations("ghost", 8, 30.0, block_ids=[1, 2]))
        msg = _next_non_heartbeat(peer)
        assert isinstance(msg, Abort) and msg.failure and "never offered" in msg.reason
        assert prefill.engine.counters().expired_leases == 1
        assert_no_state(prefill.engine)
        peer.close()
    finally:
        prefill.close()


def test_write_error_fails_the_transfer_and_tells_decode(prefill: Prefill) -> None:
    peer = _connected_raw_decode(prefill)
    peer.send(Destinations("w", 8, 30.0, block_ids=[1, 2]))
    prefill.d_transport.close()  # D's memory is deregistered under P's feet
    prefill.engine.offer("w", [3, 4])
    prefill.engine.push_layer("w", 0)
    r = wait_results(prefill.engine, {"w"})["w"]
    assert r.state is TransferState.FAILED and "write failed" in r.reason
    msg = _next_non_heartbeat(peer)
    assert isinstance(msg, Abort) and msg.failure and "write failed" in msg.reason
    assert_no_state(prefill.engine)
    peer.close()


class StallingTransport(LoopbackTransport):
    """Writes never complete until the peer is detached (a hung link); detach fails them, as UCX/TCP do."""

    def __init__(self, fabric: LoopbackFabric) -> None:
        super().__init__(fabric)
        self.pending: dict[str, list[Future[int]]] = {}

    def write(self, peer_id: str, copies: Sequence[BlockCopy]) -> Future[int]:
        future: Future[int] = Future()
        self.pending.setdefault(peer_id, []).append(future)
        return future

    def detach(self, peer_id: str) -> None:
        for future in self.pending.pop(peer_id, []):
            future.set_exception(ConnectionError("detached"))
        super().detach(peer_id)


def test_write_timeout_drops_the_peer_and_releases_the_blocks() -> None:
    prefill = Prefill(StallingTransport, write_timeout_s=0.3)
    d_cache = KVCache(SMALL, 16, None)  # must outlive the engine: it holds raw addresses
    d = make_engine(d_cache, StallingTransport(prefill.fabric), False, "D", **FAST)
    try:
        # P drops D with its write still stuck in the transport, which loopback (like ucx and cma) cannot
        # fence: D keeps the blocks until the deadline it gave P plus abort_grace_s (test_fence.py), short here.
        d.expect("stall", prefill.addr, [1, 2], 8, timeout_s=1.0)
        prefill.engine.offer("stall", [3, 4])
        prefill.engine.push_layer("stall", 0)
        t0 = time.monotonic()
        p = wait_results(prefill.engine, {"stall"})["stall"]
        assert p.state is TransferState.FAILED and "within 0.3 s" in p.reason
        assert time.monotonic() - t0 < 0.3 + SLACK_S
        r = wait_results(d, {"stall"})["stall"]
        assert r.state is TransferState.FAILED and "lost" in r.reason
        assert_no_state(prefill.engine, d)
    finally:
        d.close()
        prefill.close()
