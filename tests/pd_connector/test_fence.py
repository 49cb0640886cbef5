"""The data fence: when D declares its control link to P dead, no write of P's can land in D's blocks after D
reported the load failed (vLLM hands those blocks to another request at once).

The hazard, staged with ``test_support.fault_proxy`` between two real engines over the TCP data plane: P's
writes are held in the data proxy (a stall, as a congested path or a stopped relay would), D's control link
to P is reset, D reports the load FAILED, the test writes a marker into the blocks (another request's KV),
and then the stall ends and P's held bytes reach D. Without the fence they overwrite the marker: a later
request decodes from the wrong KV, a 200 with wrong tokens. With it, D revoked that control session's data
grant before reporting (``Transport.revoke``), so the connection carrying them is closed unread.

The control (same stall, no reset) shows the held bytes do land in D's memory once the stall ends, so the
marker surviving is the fence's doing, not the proxy's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import numpy as np
import pytest

from pd_connector.transfer import TransferState
from pd_connector.transport.base import BlockCopy, MemoryRegion
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.loopback import LoopbackFabric, LoopbackTransport
from pd_connector.transport.tcp import TcpConfig, TcpTransport
from pd_connector.transport.tcp_wire import PROTOCOL_VERSION, Hello, encode_frame
from pd_disagg.servers import free_port
from test_support.fault_proxy import Fault, FaultProxy, Schedule
from tests.pd_connector.engines import (
    FAST,
    FAULT_CONFIG,
    FAULT_DST,
    FAULT_SRC,
    SLACK_S,
    SMALL,
    KVCache,
    addr,
    assert_no_state,
    closing,
    make_engine,
)
from tests.pd_connector.engines import wait_results as wait
from tests.polling import wait_until

pytestmark = pytest.mark.unit

#: How long the data proxy holds P's writes: long enough for D to report before they can land.
STALL_S = 1.5
#: The data connection's first frame (P's hello) and one byte of P's first write go through; the rest is held.
#: (The stall strikes in the chunk that crosses this byte, so it strikes only once P wrote.)
HELD_AFTER = len(encode_frame(Hello(PROTOCOL_VERSION, bytes(16)))) + 1
MARKER = 0x5A


class StalledPair:
    """P and D over tcp; D's control link goes through ``control``, P's data connection through ``data``,
    which holds everything after ``HELD_AFTER`` bytes for ``STALL_S``."""

    def __init__(self) -> None:
        data_port = free_port()
        stall = Schedule.fixed({0: Fault("stall", after_bytes=HELD_AFTER, seconds=STALL_S)})
        self.data = FaultProxy(("127.0.0.1", data_port), stall)
        self.data.start()
        self.pc, self.dc = KVCache(SMALL, 32, seed=1), KVCache(SMALL, 32, seed=None)
        d_tcp = TcpConfig(port=data_port, advertise_port=self.data.port)
        self.d_transport = create_transport(TransportConfig(kind="tcp", tcp=d_tcp))
        self.p = make_engine(
            self.pc, create_transport(TransportConfig(kind="tcp")), True, "P", **FAULT_CONFIG
        )
        self.d = make_engine(self.dc, self.d_transport, False, "D", **FAULT_CONFIG)
        host, port = addr(self.p).rsplit(":", 1)
        self.control = FaultProxy((host, int(port)))
        self.control.start()

    def start_stalled_transfer(self, tid: str) -> None:
        """D expects ``tid``; P writes all of it, and the writes are held in the data proxy."""
        self.d.expect(tid, self.control.address, FAULT_DST, 12)
        self.p.offer(tid, FAULT_SRC)
        for layer in range(SMALL.num_layers):
            self.p.push_layer(tid, layer)
        self.p.finish(tid)
        wait_until(lambda: self.data.injected["stall"] == 1, what="P's writes held in the data proxy")
        assert self.data.relayed["to_target"] == HELD_AFTER

    def blocks(self) -> list[bytes]:
        return [self.dc.tokens(r, FAULT_DST, 12) for r in range(len(self.dc.arrays))]

    def close(self) -> None:
        with closing(self.p, self.d):
            self.control.stop()
            self.data.stop()


@pytest.fixture
def stalled() -> Iterator[StalledPair]:
    pair = StalledPair()
    try:
        yield pair
    finally:
        pair.close()


def test_writes_held_in_flight_land_when_nothing_fails(stalled: StalledPair) -> None:
    """The control: the held writes do reach D's memory once the stall ends, and the transfer completes."""
    stalled.start_stalled_transfer("slow")
    assert wait(stalled.d, {"slow"}, STALL_S + SLACK_S)["slow"].state is TransferState.DONE
    want = [stalled.pc.tokens(r, FAULT_SRC, 12) for r in range(len(stalled.pc.arrays))]
    assert stalled.blocks() == want


def _reuse_after_the_link_is_lost(stalled: StalledPair) -> tuple[list[bytes], list[bytes]]:
    """Lose the link while P's writes are held; once D reported, reuse the blocks; let the stall end. Returns
    what the blocks held when reused and once every held byte was delivered or dropped."""
    stalled.start_stalled_transfer("cut")
    assert stalled.control.reset_connections() == 1
    got = wait(stalled.d, {"cut"})["cut"]
    assert got.state is TransferState.FAILED and "lost" in got.reason, got
    assert wait(stalled.p, {"cut"})["cut"].state is TransferState.FAILED

    # vLLM gives the blocks to another request, which writes its own KV there.
    for array in stalled.dc.arrays:
        for block in FAULT_DST:
            array[block * SMALL.block_bytes : (block + 1) * SMALL.block_bytes] = MARKER
    reused = stalled.blocks()

    # The stall ends; every byte the proxy held is delivered or dropped, and D is done reading.
    wait_until(lambda: stalled.data.relaying == 0, STALL_S + SLACK_S, "the data proxy relayed what it held")
    assert isinstance(stalled.d_transport, TcpTransport)
    transport = stalled.d_transport
    wait_until(lambda: transport.inbound_connections == 0, SLACK_S, "D's data connection closed")
    return reused, stalled.blocks()


def test_no_write_lands_after_decode_reported_the_link_lost(stalled: StalledPair) -> None:
    reused, after = _reuse_after_the_link_is_lost(stalled)
    assert after == reused, "a write from the lost session landed in reused blocks"
    assert_no_state(stalled.p, stalled.d)


def test_without_the_fence_the_held_writes_corrupt_reused_blocks(
    stalled: StalledPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: a revoke that claims the fence but closes nothing lets P's held bytes overwrite
    the reused blocks, so the test above fails without the fence."""
    monkeypatch.setattr(TcpTransport, "revoke", lambda self, key: True)
    reused, after = _reuse_after_the_link_is_lost(stalled)
    want = [stalled.pc.tokens(r, FAULT_SRC, 12) for r in range(len(stalled.pc.arrays))]
    assert after != reused and any(a == w for a, w in zip(after, want, strict=True))


def test_the_next_session_writes_again_after_the_fence(stalled: StalledPair) -> None:
    """The fence is per control session: D's next link to the same P gets a new grant and a new data
    connection, and its transfer lands whole."""
    stalled.start_stalled_transfer("cut")
    stalled.control.reset_connections()
    assert wait(stalled.d, {"cut"})["cut"].state is TransferState.FAILED
    wait(stalled.p, {"cut"})
    started = time.monotonic()
    stalled.d.expect("next", stalled.control.address, FAULT_DST, 12)
    stalled.p.offer("next", FAULT_SRC)
    for layer in range(SMALL.num_layers):
        stalled.p.push_layer("next", layer)
    stalled.p.finish("next")
    assert wait(stalled.d, {"next"})["next"].state is TransferState.DONE
    assert wait(stalled.p, {"next"})["next"].state is TransferState.DONE
    assert time.monotonic() - started < STALL_S  # not held behind the fenced connection's stall
    want = [stalled.pc.tokens(r, FAULT_SRC, 12) for r in range(len(stalled.pc.arrays))]
    assert stalled.blocks() == want
    assert stalled.data.accepted == 2
    assert_no_state(stalled.p, stalled.d)


class GatedTransport(LoopbackTransport):
    """A loopback transport whose writes wait for ``gate``: P's writes in flight, as long as the test wants."""

    def __init__(self, fabric: LoopbackFabric) -> None:
        super().__init__(fabric)
        self.gate = threading.Event()
        self.started = threading.Event()

    def _copy(self, key: int, local: dict[int, MemoryRegion], copies: list[BlockCopy]) -> int:
        self.started.set()
        if not self.gate.wait(SLACK_S * 5):
            raise TimeoutError("gate never opened")
        return super()._copy(key, local, copies)


HOLD = {**FAST, "lease_s": 30.0, "load_timeout_s": 3.0}


def test_a_transport_that_cannot_fence_keeps_the_blocks_until_prefill_cannot_write() -> None:
    """Loopback, like ucx and cma, cannot refuse a writer: D keeps the blocks of a lost link's transfer until
    the deadline it gave P plus ``abort_grace_s``, so P's write still in flight lands before they are reused."""
    fabric = LoopbackFabric()
    pc, dc = KVCache(SMALL, 32, seed=1), KVCache(SMALL, 32, seed=None)
    gated = GatedTransport(fabric)
    p = make_engine(pc, gated, True, "P", **HOLD)
    d = make_engine(dc, LoopbackTransport(fabric), False, "D", **HOLD)
    host, port = addr(p).rsplit(":", 1)
    with closing(p, d), FaultProxy((host, int(port))) as control:
        expected_at = time.monotonic()
        d.expect("held", control.address, FAULT_DST, 12)
        p.offer("held", FAULT_SRC)
        p.push_layer("held", 0)
        assert gated.started.wait(SLACK_S)
        assert control.reset_connections() == 1
        wait_until(lambda: p.table_sizes()["peers"] == 0, what="P saw the link lost")
        assert d.poll() == []  # the link is lost, but P's write is in flight: D keeps the blocks
        gated.gate.set()  # the write lands, into blocks D still holds
        got = wait(d, {"held"}, HOLD["load_timeout_s"] + SLACK_S)["held"]
        held_s = time.monotonic() - expected_at
        assert got.state is TransferState.FAILED and "lost" in got.reason, got
        assert held_s >= HOLD["load_timeout_s"] + HOLD["abort_grace_s"]
        assert dc.tokens(0, FAULT_DST, 12) == pc.tokens(
            0, FAULT_SRC, 12
        )  # it landed while the blocks were D's
        wait(p, {"held"})
        assert_no_state(p, d)


def test_blocks_held_for_a_prefill_that_is_gone_go_back_at_once() -> None:
    """A P whose side channel refuses connections (process dead, engine closed) writes nothing more: D's probe
    sees it and releases the held blocks well before the deadline."""
    fabric = LoopbackFabric()
    pc, dc = KVCache(SMALL, 32, seed=1), KVCache(SMALL, 32, seed=None)
    p = make_engine(pc, LoopbackTransport(fabric), True, "P", **{**HOLD, "load_timeout_s": 30.0})
    d = make_engine(dc, LoopbackTransport(fabric), False, "D", **{**HOLD, "load_timeout_s": 30.0})
    host, port = addr(p).rsplit(":", 1)
    with closing(p, d), FaultProxy((host, int(port))) as control:
        d.expect("gone", control.address, FAULT_DST, 12)
        p.offer("gone", FAULT_SRC)
        wait_until(lambda: p.state("gone") is TransferState.TRANSFERRING, what="P got D's destinations")
        control.reset_connections()  # the link is lost first: no Abort from P reaches D
        wait_until(lambda: p.table_sizes()["peers"] == 0, what="P saw the link lost")
        assert d.poll() == []  # held: P is alive and D cannot fence its writes
        closed_at = time.monotonic()
        p.close()
        control.stop()  # P's address refuses connections now
        got = wait(d, {"gone"})["gone"]
        assert got.state is TransferState.FAILED and "lost" in got.reason, got
        assert time.monotonic() - closed_at < HOLD["heartbeat_interval_s"] + SLACK_S
        assert_no_state(d)


def test_a_revoke_the_io_thread_does_not_confirm_in_time_is_not_a_fence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D trusts ``revoke`` to mean nothing of the session lands any more; if the tcp transport's I/O thread,
    which reads the data connections, cannot confirm the close in time, revoke must say False (D then holds
    the blocks as for a transport that cannot fence), not True."""
    transport, memory = TcpTransport(), np.zeros(64, np.uint8)
    try:
        transport.register([MemoryRegion(0, memory.ctypes.data, 64, 64)])

        def stuck(coro: Coroutine[Any, Any, None], timeout_s: float) -> None:
            coro.close()
            raise TimeoutError

        monkeypatch.setattr(transport._io, "run", stuck)
        assert transport.revoke("session-1") is False
        monkeypatch.undo()
        assert transport.revoke("session-1") is True
    finally:
        transport.close()
