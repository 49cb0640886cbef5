"""The transfer engine across processes over every real data plane (TCP fallback, cma, UCX sm, UCX tcp).

One engine runs in this process, its peer in another (``engine_peer``), so bytes really cross process
boundaries; the decode side reports a sha256 of the tokens it received, compared with the prefill cache.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_connector.layout import KVLayout
from pd_connector.transfer import TransferConfig, TransferEngine, TransferState
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.ucx import UcxConfig
from tests.pd_connector.engine_peer import FAST, token_digest
from tests.pd_connector.engines import SLACK_S, SMALL, KVCache, addr, assert_no_state, wait_results
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
TRANSPORTS = {
    "tcp": ("tcp", ""),
    "cma": ("cma", ""),
    "ucx_sm": ("ucx", "sm,self"),
    "ucx_tcp": ("ucx", "tcp,self"),
}
LAYOUT = msgspec.structs.replace(SMALL, block_tokens=4, token_major=True, kv_split=True)


class Peer:
    """An ``engine_peer`` process: send commands, read its READY line and RESULT lines."""

    def __init__(self, role: str, kind: str, tls: str, layout: KVLayout) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.pd_connector.engine_peer", "--role", role, "--kind", kind,
             "--tls", tls, "--layout", msgspec.json.encode(layout).decode()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT), UCX_WARN_UNUSED_ENV_VARS="n"),
        )  # fmt: skip
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self.wait_line("READY", 60)[0]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # UCX may print its own lines: only tagged ones matter
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()

    def wait_line(self, tag: str, timeout_s: float = 20) -> list[str]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                for i, line in enumerate(self.lines):
                    if line.startswith(tag + " "):
                        del self.lines[i]
                        return line.split(" ", 1)[1:]
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, f"peer never printed {tag}: {self.lines}"
                self.cond.wait(left)

    def result(self, timeout_s: float = 20) -> dict[str, object]:
        return msgspec.json.decode(self.wait_line("RESULT", timeout_s)[0])

    def send(self, cmd: str, **args: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode({"cmd": cmd, **args}).decode() + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(15)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        self.kill()


def local_engine(role: str, kind: str, tls: str, cache: KVCache) -> TransferEngine:
    transport = create_transport(TransportConfig(kind=kind, ucx=UcxConfig(tls=tls)))  # type: ignore[arg-type]
    config = TransferConfig(
        engine_id=f"local-{role}",
        listen_port=0 if role == "prefill" else None,
        **FAST,  # type: ignore[arg-type]
    )
    return TransferEngine(config, cache.layout, cache.buffers(), transport)


@pytest.fixture(scope="module", params=list(TRANSPORTS), ids=list(TRANSPORTS))
def transport_kind(request: pytest.FixtureRequest) -> tuple[str, str]:
    kind, tls = TRANSPORTS[request.param]
    return kind, tls  # without the ucx extra, ucx fails in the transport factory, naming the extra


@pytest.fixture(scope="module")
def decode_peer(transport_kind: tuple[str, str]) -> Iterator[Peer]:
    peer = Peer("decode", *transport_kind, LAYOUT)
    yield peer
    peer.stop()


@pytest.fixture(scope="module")
def local_prefill(transport_kind: tuple[str, str]) -> Iterator[tuple[TransferEngine, KVCache]]:
    cache = KVCache(LAYOUT, 64, seed=1)
    engine = local_engine("prefill", *transport_kind, cache)
    yield engine, cache
    engine.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bytes_arrive_exactly_across_processes(
    decode_peer: Peer, local_prefill: tuple[TransferEngine, KVCache], data: st.DataObject
) -> None:
    p, cache = local_prefill
    num_tokens = data.draw(st.integers(1, 120), "num_tokens")
    start_token = data.draw(st.integers(0, num_tokens - 1), "start_token")
    n = -(-num_tokens // LAYOUT.block_tokens)
    src = data.draw(st.permutations(range(64)), "src")[:n]
    dst = data.draw(st.permutations(range(64)), "dst")[:n]
    tid = hashlib.sha1(repr((src, dst, num_tokens, start_token)).encode()).hexdigest()[:12]
    decode_peer.send(
        "expect", transfer_id=tid, prefill_addr=addr(p), dst_blocks=dst, num_tokens=num_tokens,
        start_token=start_token,
    )  # fmt: skip
    p.offer(tid, src)
    for layer in range(LAYOUT.num_layers):
        p.push_layer(tid, layer)
    p.finish(tid, first_token=5)
    d = decode_peer.result()
    assert (d["transfer_id"], d["state"], d["first_token"]) == (tid, "done", 5), d
    assert d["digest"] == token_digest(cache, src, num_tokens, start_token)
    assert wait_results(p, {tid})[tid].state is TransferState.DONE
    assert_no_state(p)


def test_decode_killed_mid_transfer_releases_prefill(transport_kind: tuple[str, str]) -> None:
    peer = Peer("decode", *transport_kind, LAYOUT)
    cache = KVCache(LAYOUT, 64, seed=1)
    p = local_engine("prefill", *transport_kind, cache)
    try:
        peer.send("expect", transfer_id="k", prefill_addr=addr(p), dst_blocks=[1, 2, 3], num_tokens=12)
        p.offer("k", [4, 5, 6])
        p.push_layer("k", 0)
        # Layer 0 landed in the peer's memory: mid-transfer.
        wait_until(lambda: p.counters().layer_writes >= 1, 20, "layer 0 landing")
        peer.kill()
        t0 = time.monotonic()
        r = wait_results(p, {"k"}, timeout_s=15)["k"]
        assert r.state is TransferState.FAILED, r
        assert time.monotonic() - t0 < FAST["heartbeat_timeout_s"] + SLACK_S
        p.push_layer("k", 1)  # the adapter's late call is harmless
        assert p.table_sizes()["peers"] == 0  # the endpoint into the dead peer's memory was detached
        assert_no_state(p)
    finally:
        peer.kill()
        p.close()


def test_prefill_killed_mid_transfer_fails_decode(transport_kind: tuple[str, str]) -> None:
    peer = Peer("prefill", *transport_kind, LAYOUT)
    cache = KVCache(LAYOUT, 64, seed=None)
    d = local_engine("decode", *transport_kind, cache)
    try:
        d.expect("k", peer.address, [1, 2, 3], 12, timeout_s=60)
        peer.send("offer", transfer_id="k", src_blocks=[4, 5, 6])
        peer.send("push_layer", transfer_id="k", layer=0)
        wait_until(lambda: d.state("k") is TransferState.TRANSFERRING, 20, "layer 0 arriving")
        peer.kill()
        t0 = time.monotonic()
        r = wait_results(d, {"k"}, timeout_s=15)["k"]
        assert r.state is TransferState.FAILED and "lost" in r.reason, r
        assert time.monotonic() - t0 < FAST["heartbeat_timeout_s"] + SLACK_S
        assert_no_state(d)
    finally:
        peer.kill()
        d.close()
