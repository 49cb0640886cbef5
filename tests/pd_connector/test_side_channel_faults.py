"""Faults on the connections between two real transfer engines over the TCP data plane, injected by
``test_support.fault_proxy``: D's control connection to P's side channel, or P's data connection into D. A
reset mid-transfer fails the transfer on both sides at once (well inside the configured timeouts), leaves no
state and no lease behind, and the next transfer, on new connections, goes through."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pd_connector.transfer import TransferEngine, TransferState
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.tcp import TcpConfig
from pd_disagg.servers import free_port
from test_support.fault_proxy import FaultProxy
from tests.pd_connector.engines import (
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


@pytest.fixture
def tcp_pair() -> Iterator[tuple[TransferEngine, TransferEngine, KVCache, KVCache]]:
    pc, dc = KVCache(SMALL, 32, seed=1), KVCache(SMALL, 32, seed=None)
    tcp = TransportConfig(kind="tcp")
    p = make_engine(pc, create_transport(tcp), True, "P", **FAULT_CONFIG)
    d = make_engine(dc, create_transport(tcp), False, "D", **FAULT_CONFIG)
    with closing(p, d):
        yield p, d, pc, dc


def test_a_side_channel_reset_mid_transfer_fails_both_sides_cleanly(
    tcp_pair: tuple[TransferEngine, TransferEngine, KVCache, KVCache],
) -> None:
    p, d, pc, dc = tcp_pair
    host, port = addr(p).rsplit(":", 1)
    with FaultProxy((host, int(port))) as proxy:
        d.expect("cut", proxy.address, FAULT_DST, 12)
        p.offer("cut", FAULT_SRC)
        p.push_layer("cut", 0)
        # Mid-transfer: layer 0 landed in D's memory and D heard of it; layers 1 and 2 are still to come.
        wait_until(lambda: d.state("cut") is TransferState.TRANSFERRING, what="layer 0 landed on D")
        assert proxy.reset_connections() == 1
        reset_at = time.monotonic()
        got_d, got_p = wait(d, {"cut"})["cut"], wait(p, {"cut"})["cut"]
        took = time.monotonic() - reset_at
        assert got_d.state is TransferState.FAILED and "lost" in got_d.reason, got_d
        assert got_p.state is TransferState.FAILED and "lost" in got_p.reason, got_p
        assert not got_p.lease_expired and took < FAULT_CONFIG["heartbeat_timeout_s"] + SLACK_S
        p.push_layer("cut", 1)  # the engine's forward pass goes on: its late pushes are ignored, not queued
        p.finish("cut")
        assert d.counters().timeouts == 0 and p.counters().expired_leases == 0
        assert_no_state(p, d)

        # The next transfer dials again (a new connection through the proxy) and goes through.
        _next_transfer_goes_through(p, d, pc, dc, proxy.address, proxy)


def _next_transfer_goes_through(
    p: TransferEngine, d: TransferEngine, pc: KVCache, dc: KVCache, prefill: str, proxy: FaultProxy
) -> None:
    """After the fault, a new transfer from ``prefill`` lands whole over a new connection (the proxy's second)."""
    d.expect("next", prefill, FAULT_DST, 12)
    p.offer("next", FAULT_SRC)
    for layer in range(SMALL.num_layers):
        p.push_layer("next", layer)
    p.finish("next")
    assert wait(d, {"next"})["next"].state is TransferState.DONE
    assert wait(p, {"next"})["next"].state is TransferState.DONE
    assert all(pc.tokens(r, FAULT_SRC, 12) == dc.tokens(r, FAULT_DST, 12) for r in range(len(pc.arrays)))
    assert proxy.accepted == 2 and proxy.injected == {"reset": 1}
    assert_no_state(p, d)


def test_a_data_connection_reset_mid_transfer_fails_both_sides_and_the_next_transfer_redials() -> None:
    """P's data connection into D goes through the proxy (D advertises the proxy's port): reset after layer 0
    landed, P's next writes fail, both sides report FAILED at once, and the next transfer gets a new data
    connection instead of the dead one (P drops a decode whose write failed, so D dials again)."""
    data_port = free_port()
    with FaultProxy(("127.0.0.1", data_port)) as proxy:
        pc, dc = KVCache(SMALL, 32, seed=1), KVCache(SMALL, 32, seed=None)
        d_tcp = TcpConfig(port=data_port, advertise_port=proxy.port)
        p = make_engine(pc, create_transport(TransportConfig(kind="tcp")), True, "P", **FAULT_CONFIG)
        d = make_engine(
            dc, create_transport(TransportConfig(kind="tcp", tcp=d_tcp)), False, "D", **FAULT_CONFIG
        )
        with closing(p, d):
            d.expect("cut", addr(p), FAULT_DST, 12)
            p.offer("cut", FAULT_SRC)
            p.push_layer("cut", 0)
            wait_until(lambda: d.state("cut") is TransferState.TRANSFERRING, what="layer 0 landed on D")
            assert proxy.reset_connections() == 1
            reset_at = time.monotonic()
            for layer in (1, 2):
                p.push_layer("cut", layer)
            p.finish("cut")
            got_d, got_p = wait(d, {"cut"})["cut"], wait(p, {"cut"})["cut"]
            assert got_p.state is TransferState.FAILED and "write failed" in got_p.reason, got_p
            assert got_d.state is TransferState.FAILED, (
                got_d
            )  # P's Abort or P dropping the link, whichever first
            assert time.monotonic() - reset_at < FAULT_CONFIG["heartbeat_timeout_s"] + SLACK_S
            assert_no_state(p, d)

            _next_transfer_goes_through(p, d, pc, dc, addr(p), proxy)
