"""Shared helpers for transport tests: a receiving peer in a second process and transport builders."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pd_connector.transport.base import MemoryRegion, Transport
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.tcp import TcpConfig
from pd_connector.transport.ucx import UcxConfig

ROOT = Path(__file__).resolve().parents[2]

#: (transport kind, UCX_TLS): every data path we ship. UCX ones need the ``ucx`` extra.
TRANSPORTS = [("tcp", ""), ("cma", ""), ("ucx", "sm,self"), ("ucx", "tcp,self")]
TRANSPORT_IDS = ["tcp", "cma", "ucx_sm", "ucx_tcp"]


def build(kind: str, tls: str, write_timeout_s: float = 30.0) -> Transport:
    """A sender of ``kind``; ``ucx`` without the ``ucx`` extra fails the test (CI installs it), never skips."""
    return create_transport(
        TransportConfig(kind=kind, tcp=TcpConfig(), ucx=UcxConfig(tls=tls, write_timeout_s=write_timeout_s))  # type: ignore[arg-type]
    )


class PeerProcess:
    """A receiver in another process (``tests.transport.peer_process``) and a local mirror of its memory."""

    def __init__(self, kind: str, tls: str, regions: int, blocks: int, block_bytes: int) -> None:
        self.shape = (regions, blocks, block_bytes)
        self.mirror = np.zeros((regions, blocks, block_bytes), dtype=np.uint8)
        env = dict(os.environ, PYTHONPATH=str(ROOT), UCX_WARN_UNUSED_ENV_VARS="n")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.transport.peer_process", "--kind", kind, "--tls", tls,
             "--regions", str(regions), "--blocks", str(blocks), "--block-bytes", str(block_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        self.descriptor = bytes.fromhex(self._line("DESCRIPTOR")[0])

    def _line(self, tag: str) -> list[str]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # UCX may print its own lines to stdout: skip them
            if line.startswith(tag + " "):
                return line.split()[1:]
        raise RuntimeError(f"peer process exited (rc={self.proc.wait(5)}) before printing {tag}")

    def digests(self) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("digest\n")
        self.proc.stdin.flush()
        return self._line("DIGEST")

    def expected_digests(self) -> list[str]:
        return [hashlib.sha256(region.tobytes()).hexdigest() for region in self.mirror]

    def cpu_seconds(self) -> float:
        """User + system CPU time the peer process has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()


def local_regions(
    count: int, blocks: int, block_bytes: int, seed: int
) -> tuple[np.ndarray, list[MemoryRegion]]:
    """Random source memory ``[count, blocks, block_bytes]`` and its regions (one per first-axis slice)."""
    data = np.random.default_rng(seed).integers(0, 256, (count, blocks, block_bytes), dtype=np.uint8)
    regions = [MemoryRegion(i, data[i].ctypes.data, data[i].nbytes, block_bytes) for i in range(count)]
    return data, regions


@pytest.fixture
def peer_factory() -> Iterator[type[PeerProcess]]:
    """Start receivers that are stopped (or killed) at teardown, whatever the test did."""
    started: list[PeerProcess] = []

    class Tracked(PeerProcess):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            started.append(self)

    yield Tracked
    for peer in started:
        peer.stop()
