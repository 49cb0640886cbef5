"""Transfer engine trust checks: a layout mismatch refused naming the fields, a wrong HMAC rejected and logged,
the advertised address of a wildcard listener, protected mode, the decode side's peer policy, and D revealing
its memory only to a prefill that proves the secret."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from contextlib import suppress

import msgspec
import pytest

from pd_connector.protocol import HEADER, FrameCodec, Hello, HelloAck
from pd_connector.transfer import TransferState
from pd_connector.transport.loopback import LoopbackFabric, LoopbackTransport
from pd_connector.trust import InsecureConfig
from tests.pd_connector.engines import (
    FAST,
    SMALL,
    KVCache,
    Pair,
    addr,
    assert_no_state,
    closing,
    make_engine,
    wait_results,
)
from tests.pd_connector.raw_peer import RawPeer


def test_layout_mismatch_is_refused_with_the_differing_fields() -> None:
    other = msgspec.structs.replace(SMALL, dtype="bfloat16", head_dim=8)
    pr = Pair(d_layout=other)
    with closing(pr.p, pr.d):
        pr.d.expect("lm", addr(pr.p), [1], 4)
        r = wait_results(pr.d, {"lm"})["lm"]
        assert r.state is TransferState.FAILED and "refused the handshake" in r.reason
        assert "dtype: prefill 'float16' vs decode 'bfloat16'" in r.reason
        assert "head_dim: prefill 4 vs decode 8" in r.reason
        assert pr.p.counters().rejected_connections == 1
        assert_no_state(pr.p, pr.d)


def test_wrong_hmac_is_rejected_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    fabric = LoopbackFabric()
    pc, dc = KVCache(SMALL, 8, 1), KVCache(SMALL, 8, None)
    p = make_engine(pc, LoopbackTransport(fabric), True, "P", secret=b"right", **FAST)
    d_bad = make_engine(dc, LoopbackTransport(fabric), False, "Dbad", secret=b"wrong", **FAST)
    d_none = make_engine(dc, LoopbackTransport(fabric), False, "Dnone", **FAST)
    d_good = make_engine(dc, LoopbackTransport(fabric), False, "Dgood", secret=b"right", **FAST)
    with closing(p, d_bad, d_none, d_good):
        for d in (d_bad, d_none):
            d.expect("h", addr(p), [1], 4, timeout_s=3)
            r = wait_results(d, {"h"})["h"]
            assert r.state is TransferState.FAILED and "handshake" in r.reason
        assert "HMAC mismatch" in caplog.text
        assert p.counters().rejected_connections == 2
        d_good.expect("h", addr(p), [1], 4)
        p.offer("h", [2])
        p.push_layer("h", 0)
        p.push_layer("h", 1)
        p.push_layer("h", 2)
        p.finish("h")
        assert wait_results(d_good, {"h"})["h"].state is TransferState.DONE


def test_wildcard_listener_advertises_a_reachable_host() -> None:
    """A wildcard bind is no address a peer can dial: the configured advertise host, else this host's own."""
    fabric = LoopbackFabric()
    cache = KVCache(SMALL, 4, seed=None)
    listed = make_engine(
        cache, LoopbackTransport(fabric), True, listen_host="0.0.0.0", advertise_host="10.1.2.3", secret=b"s"
    )
    auto = make_engine(cache, LoopbackTransport(fabric), True, listen_host="0.0.0.0", secret=b"s")
    with closing(listed, auto):
        assert addr(listed).startswith("10.1.2.3:")
        assert not addr(auto).startswith("0.0.0.0:")


def test_protected_mode_refuses_an_open_side_channel_without_a_secret() -> None:
    fabric = LoopbackFabric()
    cache = KVCache(SMALL, 4, seed=None)
    with pytest.raises(InsecureConfig, match="no shared secret is set"):
        make_engine(cache, LoopbackTransport(fabric), True, listen_host="0.0.0.0")
    assert len(fabric) == 0, "the refused engine released its transport"
    opted_in = make_engine(cache, LoopbackTransport(fabric), True, listen_host="0.0.0.0", allow_insecure=True)
    opted_in.close()


def test_decode_dials_only_what_its_peer_policy_allows(pair: Pair) -> None:
    with pytest.raises(ValueError, match="dials loopback only"):
        pair.d.expect("far", "10.0.0.9:7600", [1], 4)
    listed = Pair(allowed_prefill_addrs=("127.0.0.2",))
    with closing(listed.p, listed.d), pytest.raises(ValueError, match="not in allowed_prefill_addrs"):
        listed.d.expect("x", addr(listed.p), [1], 4)
    assert_no_state(pair.d)


class _FakePrefill:
    """A listener that answers D's Hello with a given codec and ack, then records every frame D sends."""

    def __init__(self, codec: FrameCodec, ack: Callable[[Hello], HelloAck]) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.frames_after_hello = 0
        self._codec, self._ack = codec, ack
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock, _ = self.server.accept()
        peer = RawPeer(sock, secret=b"right")  # reads D's Hello (what it can read is not under test)
        first = peer.recv()
        assert isinstance(first, Hello)
        peer.codec = self._codec
        peer.send(self._ack(first))
        with suppress(OSError):  # count raw frames: D must send none
            while (header := peer.read_exactly(HEADER.size)) is not None:
                peer.read_exactly(HEADER.unpack(header)[1])
                self.frames_after_hello += 1
        peer.close()

    def close(self) -> None:
        self._thread.join(10)
        self.server.close()


@pytest.mark.parametrize(
    ("codec", "ack", "why"),
    [
        (
            FrameCodec(b"guess"),
            lambda h: HelloAck("P", SMALL.compat_hash(), b"p" * 16, h.nonce, SMALL),
            "HMAC mismatch",
        ),
        (
            FrameCodec(),
            lambda h: HelloAck("P", SMALL.compat_hash(), b"p" * 16, h.nonce, SMALL),
            "HMAC mismatch",
        ),
        # A HelloAck recorded from another connection: right MAC, someone else's nonce.
        (
            FrameCodec(b"right"),
            lambda h: HelloAck("P", SMALL.compat_hash(), b"p" * 16, b"n" * 16, SMALL),
            "echoing",
        ),
    ],
)
def test_decode_reveals_its_memory_only_to_a_prefill_that_proves_the_secret(
    codec: FrameCodec, ack: Callable[[Hello], HelloAck], why: str
) -> None:
    """D's memory descriptor lets its holder write into D's KV cache: a listener that cannot prove the shared
    secret on D's fresh nonce never gets it, and the load fails at once, saying why."""
    fake = _FakePrefill(codec, ack)
    dc = KVCache(SMALL, 8, None)
    d = make_engine(dc, LoopbackTransport(LoopbackFabric()), False, "D", secret=b"right", **FAST)
    with closing(d):
        d.expect("m", fake.addr, [1], 4, timeout_s=5)
        r = wait_results(d, {"m"})["m"]
        assert r.state is TransferState.FAILED and why in r.reason, r.reason
        assert_no_state(d)
    fake.close()
    assert fake.frames_after_hello == 0, "nothing after Hello: no Memory, no Destinations"
