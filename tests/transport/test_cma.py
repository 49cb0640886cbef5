"""The same-host cma transport: what it refuses at attach, how it cuts writes into syscalls, that partial
writes are continued, and that a peer killed mid-write fails the write while this (sending) process lives on.
The generic properties (exact bytes, bad requests, idle cost) are in ``test_transports``."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import wait
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pd_connector.transport import cma, cma_syscalls
from pd_connector.transport.base import BlockCopy
from pd_connector.transport.cma import CmaConfig, CmaDescriptor, CmaError, CmaTransport
from pd_connector.transport.regions import RegionInfo, Spans

from .conftest import ROOT, PeerProcess, local_regions


@pytest.fixture
def sender() -> Iterator[CmaTransport]:
    transport = CmaTransport()
    yield transport
    transport.close()


def _descriptor(peer: PeerProcess, **changes: object) -> bytes:
    desc = msgspec.msgpack.decode(peer.descriptor, type=CmaDescriptor)
    return msgspec.msgpack.encode(msgspec.structs.replace(desc, **changes))


# -- attach refuses what it cannot write into -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"version": 99}, "v99"),
        ({"token": b"short"}, "token"),
        ({"pid": 0}, "bad pid"),
        ({"regions": [RegionInfo(0, 4096, 0, 1 << 20)]}, "malformed"),
        ({"regions": [RegionInfo(0, 6000, 4096, 1 << 20)]}, "malformed"),
        ({"regions": [RegionInfo(0, 4096, 4096, 1 << 20)] * 2}, "repeated"),
    ],
)
def test_malformed_descriptors_are_refused(
    sender: CmaTransport, peer_factory: type[PeerProcess], change: dict[str, object], match: str
) -> None:
    peer = peer_factory("cma", "", 1, 4, 4096)
    with pytest.raises(ValueError, match=match):
        sender.attach("p", _descriptor(peer, **change)).result(10)
    with pytest.raises(ValueError, match="not a cma transport descriptor"):
        sender.attach("p", b"\x93garbage").result(10)
    assert sender.attached_peers() == []


def test_a_peer_on_another_host_or_pid_namespace_is_refused(
    sender: CmaTransport, peer_factory: type[PeerProcess]
) -> None:
    peer = peer_factory("cma", "", 1, 4, 4096)
    with pytest.raises(CmaError, match=r"peer p runs on another host .*use the tcp or ucx transport"):
        sender.attach("p", _descriptor(peer, boot_id="another-boot")).result(10)
    with pytest.raises(CmaError, match="another pid namespace"):
        sender.attach("p", _descriptor(peer, pid_namespace=1)).result(10)
    assert sender.attached_peers() == []
    sender.attach("p", peer.descriptor).result(10)  # the true descriptor still attaches
    assert sender.attached_peers() == ["p"]


def test_a_pid_that_is_not_the_registering_process_is_refused(
    sender: CmaTransport, peer_factory: type[PeerProcess]
) -> None:
    """A descriptor naming another live process (as after pid reuse) fails the probe and writes nothing."""
    peer = peer_factory("cma", "", 1, 4, 4096)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(CmaError, match=f"pid {other.pid}"):
            sender.attach("p", _descriptor(peer, pid=other.pid)).result(10)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(10)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait(10)
    with pytest.raises(CmaError, match="not running"):
        sender.attach("p", _descriptor(peer, pid=exited.pid)).result(10)
    assert sender.attached_peers() == []


_UNPRIVILEGED_ATTACH = """
import os, sys
from pd_connector.transport.cma import CmaError, CmaTransport
os.setgid(65534); os.setuid(65534)  # nobody: no CAP_SYS_PTRACE, another user than the peer
t = CmaTransport()
try:
    t.attach("p", bytes.fromhex(sys.argv[1])).result(10)
except CmaError as exc:
    print("REFUSED", exc)
finally:
    t.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a sender as another user")
def test_attach_without_ptrace_permission_says_what_to_configure(peer_factory: type[PeerProcess]) -> None:
    peer = peer_factory("cma", "", 1, 4, 4096)
    out = subprocess.run(
        [sys.executable, "-c", _UNPRIVILEGED_ATTACH, peer.descriptor.hex()],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert "REFUSED" in out.stdout, out.stderr
    assert "may not be written by this process" in out.stdout and "ptrace" in out.stdout


def test_yama_scope_2_is_refused_at_register(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scope = tmp_path / "ptrace_scope"
    scope.write_text("2\n")
    monkeypatch.setattr(cma_syscalls, "_YAMA_SCOPE", str(scope))
    transport = CmaTransport()
    try:
        _, regions = local_regions(1, 4, 4096, seed=0)
        with pytest.raises(CmaError, match="ptrace_scope is 2"):
            transport.register(regions)
        # no Yama: nothing to allow
        monkeypatch.setattr(cma_syscalls, "_YAMA_SCOPE", str(tmp_path / "absent"))
        assert transport.register(regions)
    finally:
        transport.close()


# -- how writes become syscalls ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, 4095, (1 << 30) + 1])
def test_segment_size_is_validated(bad: int) -> None:
    with pytest.raises(ValueError, match=r"cma\.segment_bytes"):
        CmaConfig(segment_bytes=bad)


def test_runs_are_cut_into_segments_and_calls_respect_iov_max() -> None:
    seg = 4 << 20
    # region 0: one 10 MiB run; region 1: 3000 separate 4 KiB runs
    table = np.array([[0, 0, 4096, 10 << 20]] + [[1, i * 8192, i * 4096, 4096] for i in range(3000)])
    local_base, remote_base = np.array([1 << 40, 2 << 40]), np.array([3 << 40, 4 << 40])
    spans = Spans(
        table,
        int(table[:, 3].sum()),
        local_base[table[:, 0]] + table[:, 1],
        remote_base[table[:, 0]] + table[:, 2],
    )
    iov = cma_syscalls.build_iovecs(spans, seg)
    assert iov.local[:3].tolist() == [[1 << 40, seg], [(1 << 40) + seg, seg], [(1 << 40) + 2 * seg, 2 << 20]]
    assert iov.remote[:3, 0].tolist() == [(3 << 40) + 4096 + k * seg for k in range(3)]
    assert iov.remote[3:5].tolist() == [[4 << 40, 4096], [(4 << 40) + 4096, 4096]]
    assert iov.local[4, 0] == (2 << 40) + 8192
    bounds = cma_syscalls.call_bounds(iov.local[:, 1], seg)
    assert bounds[0] == (0, 1, seg) and bounds[-1][1] == len(iov) == 3 + 3000
    assert all(b[0] == a[1] for a, b in itertools.pairwise(bounds))  # contiguous, no gaps
    for start, stop, nbytes in bounds:
        assert stop - start <= cma_syscalls.IOV_MAX
        assert nbytes == int(iov.local[start:stop, 1].sum())
        assert stop - start == 1 or nbytes <= seg


def test_partial_writes_are_continued(
    sender: CmaTransport, peer_factory: type[PeerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel may move fewer bytes than asked: here every real syscall moves only half of its first
    piece, so a write takes hundreds of calls, and still every byte lands in the right place."""
    real = cma_syscalls.vm_call
    calls = 0

    def half_of_first_piece(write: bool, pid: int, iovecs: cma_syscalls.Iovecs, start: int, stop: int) -> int:
        nonlocal calls
        calls += 1
        first = iovecs.local[start : start + 1].copy(), iovecs.remote[start : start + 1].copy()
        for iov in first:
            iov[0, 1] = max(int(iov[0, 1]) // 2, 1)
        return real(write, pid, cma_syscalls.Iovecs(*first), 0, 1)

    blocks, block_bytes = 16, 4096
    peer = peer_factory("cma", "", 2, blocks, block_bytes)
    src, regions = local_regions(2, blocks, block_bytes, seed=4)
    sender.register(regions)
    sender.attach("p", peer.descriptor).result(10)
    monkeypatch.setattr(cma, "vm_call", half_of_first_piece)
    copies = [BlockCopy(0, 0, 0, blocks)] + [BlockCopy(1, s, blocks - 1 - s) for s in range(blocks)]
    assert sender.write("p", copies).result(30) == 2 * blocks * block_bytes
    assert calls > 2 * blocks
    peer.mirror[0] = src[0]
    peer.mirror[1] = src[1][::-1]
    assert peer.digests() == peer.expected_digests()


@pytest.mark.parametrize("segment", [64 << 10, CmaConfig().segment_bytes], ids=["64KiB", "default"])
def test_runs_longer_than_a_segment_and_more_pieces_than_iov_max_arrive_exactly(
    peer_factory: type[PeerProcess], segment: int
) -> None:
    blocks, block_bytes = 2560, 4096  # 10 MiB per region: more than one default segment
    peer = peer_factory("cma", "", 2, blocks, block_bytes)
    sender = CmaTransport(CmaConfig(segment_bytes=segment))
    try:
        src, regions = local_regions(2, blocks, block_bytes, seed=3)
        sender.register(regions)
        sender.attach("p", peer.descriptor).result(10)
        # region 0 whole (one run), region 1 reversed block by block: 2560 pieces, > IOV_MAX
        copies = [BlockCopy(0, 0, 0, blocks)] + [BlockCopy(1, s, blocks - 1 - s) for s in range(blocks)]
        assert sender.write("p", copies).result(30) == 2 * blocks * block_bytes
        peer.mirror[0] = src[0]
        peer.mirror[1] = src[1][::-1]
        assert peer.digests() == peer.expected_digests()
    finally:
        sender.close()


# -- a peer that dies mid-write ------------------------------------------------------------------------------------
def test_peer_killed_while_a_large_write_is_in_flight_fails_it_and_the_sender_lives_on(
    peer_factory: type[PeerProcess],
) -> None:
    """What UCX shared memory cannot do (it aborts the sender): the decode side dies while prefill is copying
    into it; the write in flight fails with ``CmaError`` naming the peer, nothing hangs, and the same sender
    then serves a new peer exactly."""
    blocks, block_bytes = 64, 1 << 20  # 2 x 64 MiB regions
    sender = CmaTransport(CmaConfig(segment_bytes=1 << 20))
    peer = peer_factory("cma", "", 2, blocks, block_bytes)
    try:
        src, regions = local_regions(2, blocks, block_bytes, seed=6)
        sender.register(regions)
        sender.attach("decode-0", peer.descriptor).result(10)
        whole = [BlockCopy(r, 0, 0, blocks) for r in range(2)]
        futures = [sender.write("decode-0", whole) for _ in range(32)]  # 4 GiB queued
        futures[0].result(30)  # the I/O thread is copying now
        assert not futures[-1].done(), "the writes finished before the peer could be killed"
        peer.kill()
        started = time.monotonic()
        _, not_done = wait(futures, timeout=10)
        assert not not_done, "writes hung after the peer died"
        assert time.monotonic() - started < 10
        failures = [f.exception() for f in futures if f.exception() is not None]
        assert failures and all(isinstance(e, CmaError) and "decode-0" in str(e) for e in failures)
        with pytest.raises(CmaError, match="decode-0"):
            sender.write("decode-0", whole).result(10)
        sender.detach("decode-0")
        assert sender.attached_peers() == []

        fresh = peer_factory("cma", "", 2, blocks, block_bytes)
        sender.attach("decode-1", fresh.descriptor).result(10)
        assert sender.write("decode-1", whole).result(30) == 2 * blocks * block_bytes
        fresh.mirror[:] = src
        assert fresh.digests() == fresh.expected_digests()
    finally:
        sender.close()
    assert sender.attached_peers() == [] and sender.registered_regions() == []


def test_close_with_writes_queued_fails_them_fast_and_releases_everything(
    peer_factory: type[PeerProcess],
) -> None:
    blocks, block_bytes = 64, 1 << 20
    sender = CmaTransport(CmaConfig(segment_bytes=1 << 20))
    peer = peer_factory("cma", "", 2, blocks, block_bytes)
    _, regions = local_regions(2, blocks, block_bytes, seed=8)
    sender.register(regions)
    sender.attach("p", peer.descriptor).result(10)
    whole = [BlockCopy(r, 0, 0, blocks) for r in range(2)]
    futures = [sender.write("p", whole) for _ in range(32)]  # 4 GiB queued
    futures[0].result(30)
    started = time.monotonic()
    sender.close()
    assert time.monotonic() - started < 5
    _, not_done = wait(futures, timeout=5)
    assert not not_done
    closed = [f.exception() for f in futures if f.exception() is not None]
    assert closed and all(isinstance(e, CmaError) and "closed" in str(e) for e in closed)
    assert sender.attached_peers() == [] and sender.registered_regions() == []
    with pytest.raises(RuntimeError, match="closed"):
        sender.write("p", whole).result(5)
    sender.close()  # idempotent
