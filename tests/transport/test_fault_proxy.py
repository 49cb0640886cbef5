"""``test_support.fault_proxy``: bytes relayed exactly when no fault is scheduled, and each fault kind (delay,
stall, reset, garbage) happens where the schedule puts it; stalls and delays of the connections open now, at
a moment the caller picks, hold bytes without losing any; seeded schedules repeat; loopback only."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from test_support.fault_proxy import Fault, FaultProxy, Schedule

pytestmark = pytest.mark.unit

PAYLOAD = bytes(range(256)) * 16 * 1024  # 4 MiB


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A TCP echo server on loopback (the proxy's target)."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    yield str(host), int(port)
    server.shutdown()
    server.server_close()


def round_trip(port: int, payload: bytes, timeout_s: float = 10.0) -> tuple[bytes, BaseException | None]:
    """Send ``payload`` through ``port`` while reading what comes back, until EOF, an error or as many bytes
    (plus any extra already there); returns what came back and the error that ended it, if any."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    except ConnectionResetError as e:  # reset before the handshake completed (the proxy's accept was quick)
        return b"", e
    got = bytearray()
    error: BaseException | None = None

    def send() -> None:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # a reset: the reader sees it too

    sender = threading.Thread(target=send)
    sender.start()
    try:
        while data := sock.recv(65536):
            got += data
    except OSError as e:
        error = e
    finally:
        sender.join(timeout_s)
        sock.close()
    return bytes(got), error


def test_relays_every_byte_exactly_without_faults(echo: tuple[str, int]) -> None:
    with FaultProxy(echo) as proxy:
        for _ in range(2):
            got, error = round_trip(proxy.port, PAYLOAD)
            assert error is None and got == PAYLOAD
    assert proxy.accepted == 2 and not proxy.injected
    assert proxy.relayed == {"to_target": 2 * len(PAYLOAD), "to_client": 2 * len(PAYLOAD)}


def test_a_delay_slows_every_chunk_and_keeps_the_bytes(echo: tuple[str, int]) -> None:
    schedule = Schedule.fixed({0: Fault("delay", after_bytes=0, direction="to_client", seconds=0.3)})
    with FaultProxy(echo, schedule) as proxy:
        start = time.monotonic()
        got, error = round_trip(proxy.port, b"ping")
        assert time.monotonic() - start >= 0.3
        assert error is None and got == b"ping"
    assert proxy.injected == {"delay": 1}


def test_a_stall_pauses_then_resumes_exactly(echo: tuple[str, int]) -> None:
    schedule = Schedule.fixed({0: Fault("stall", after_bytes=1 << 20, seconds=0.5)})
    with FaultProxy(echo, schedule) as proxy:
        start = time.monotonic()
        got, error = round_trip(proxy.port, PAYLOAD)
        assert time.monotonic() - start >= 0.5
        assert error is None and got == PAYLOAD
    assert proxy.injected == {"stall": 1}


def _echoed(sock: socket.socket, payload: bytes) -> float:
    """Send ``payload`` on an open connection and read it back; seconds it took."""
    start = time.monotonic()
    sock.sendall(payload)
    got = bytearray()
    while len(got) < len(payload):
        got += sock.recv(65536)
    assert got == payload
    return time.monotonic() - start


def test_stalling_the_open_connections_holds_their_bytes_then_relays_them_in_order(
    echo: tuple[str, int],
) -> None:
    with FaultProxy(echo) as proxy, socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        assert _echoed(sock, b"up") < 0.5  # the connection is relayed before the stall
        assert proxy.stall_connections(0.6) == 1
        assert _echoed(sock, PAYLOAD) >= 0.55
    assert proxy.injected == {"stall": 1}


def test_delaying_the_open_connections_slows_each_chunk_both_ways_and_keeps_the_bytes(
    echo: tuple[str, int],
) -> None:
    with FaultProxy(echo) as proxy, socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        _echoed(sock, b"up")
        assert proxy.delay_connections(30.0, 0.2) == 1
        assert _echoed(sock, b"ping") >= 0.4  # 0.2 s toward the target and 0.2 s back
        with pytest.raises(ValueError, match="per_chunk_s"):
            proxy.delay_connections(1.0, 0.0)
    assert proxy.injected == {"delay": 1}


def test_a_fixed_listen_port_is_used(echo: tuple[str, int]) -> None:
    with socket.socket() as s:  # a free port, told before the proxy starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with FaultProxy(echo, listen_port=port) as proxy:
        assert proxy.port == port and round_trip(port, b"hi") == (b"hi", None)


def test_a_reset_cuts_the_connection_at_its_byte(echo: tuple[str, int]) -> None:
    cut = 100_000
    schedule = Schedule.fixed({1: Fault("reset", after_bytes=cut)})  # the second connection only
    with FaultProxy(echo, schedule) as proxy:
        assert round_trip(proxy.port, PAYLOAD) == (PAYLOAD, None)
        got, error = round_trip(proxy.port, PAYLOAD)
        assert isinstance(error, ConnectionResetError) or len(got) < len(PAYLOAD)
        assert len(got) <= cut and got == PAYLOAD[: len(got)]
        assert proxy.relayed["to_target"] == len(PAYLOAD) + cut
    assert proxy.injected == {"reset": 1}


def test_garbage_is_inserted_at_its_byte(echo: tuple[str, int]) -> None:
    schedule = Schedule.fixed(
        {0: Fault("garbage", after_bytes=1000, direction="to_client", garbage_bytes=77)}
    )
    with FaultProxy(echo, schedule) as proxy:
        got, error = round_trip(proxy.port, PAYLOAD)
    assert error is None and len(got) == len(PAYLOAD) + 77
    assert got[:1000] == PAYLOAD[:1000] and got[1077:] == PAYLOAD[1000:]
    assert got[1000:1077] != PAYLOAD[1000:1077]
    assert proxy.injected == {"garbage": 1}


def test_a_seeded_schedule_repeats_and_varies_with_the_seed() -> None:
    menu = [Fault("reset", after_bytes=10_000), Fault("stall", after_bytes=10_000, seconds=1.0)]
    plans = [[Schedule.seeded(seed, menu, 0.5).fault(i) for i in range(40)] for seed in (1, 1, 2)]
    assert plans[0] == plans[1] and plans[0] != plans[2]
    faults = [f for f in plans[0] if f is not None]
    assert 5 < len(faults) < 35 and {f.kind for f in faults} == {"reset", "stall"}
    assert len({f.after_bytes for f in faults}) > 1 and all(0 <= f.after_bytes <= 10_000 for f in faults)
    assert all(f is None for f in (Schedule.seeded(3, menu, 0.0).fault(i) for i in range(20)))


def test_only_loopback_and_valid_faults_are_accepted() -> None:
    with pytest.raises(ValueError, match="not a loopback address"):
        FaultProxy(("10.1.2.3", 80))
    with pytest.raises(ValueError, match="not a loopback address"):
        FaultProxy(("127.0.0.1", 80), listen_host="0.0.0.0")
    with pytest.raises(ValueError, match="needs seconds"):
        Fault("stall")


def test_an_unreachable_target_resets_the_client_and_stop_is_idempotent() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = FaultProxy(("127.0.0.1", port))
    proxy.start()
    got, error = round_trip(proxy.port, b"hello")
    assert got == b"" and (error is None or isinstance(error, ConnectionResetError))
    proxy.stop()
    proxy.stop()
