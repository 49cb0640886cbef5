"""Every transport moves bytes exactly into another process, refuses bad requests, and fails (never hangs)
when the peer dies. The receiver runs in a second process (``peer_process``), the sender in this one."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, wait
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.transport.base import BlockCopy, Transport
from test_support.spinner import python_spinner
from tests.polling import wait_until

from .conftest import TRANSPORT_IDS, TRANSPORTS, PeerProcess, build, local_regions

REGIONS, BLOCKS, BLOCK_BYTES = 3, 64, 4096


@pytest.fixture(scope="module", params=TRANSPORTS, ids=TRANSPORT_IDS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Transport, PeerProcess, np.ndarray]]:
    kind, tls = request.param
    sender = build(kind, tls)
    peer = PeerProcess(kind, tls, REGIONS, BLOCKS, BLOCK_BYTES)
    try:
        src, regions = local_regions(REGIONS, BLOCKS, BLOCK_BYTES, seed=0)
        sender.register(regions)
        sender.attach("peer", peer.descriptor).result(10)
        yield sender, peer, src
    finally:
        sender.close()
        peer.stop()


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_random_block_maps_arrive_exactly(
    pair: tuple[Transport, PeerProcess, np.ndarray], data: st.DataObject
) -> None:
    sender, peer, src = pair
    copies: list[BlockCopy] = []
    for region in range(REGIONS):
        count = data.draw(st.integers(0, BLOCKS))
        sources = data.draw(st.permutations(range(BLOCKS)))[:count]
        targets = data.draw(st.permutations(range(BLOCKS)))[:count]
        copies += [BlockCopy(region, s, d) for s, d in zip(sources, targets, strict=True)]
    # fresh source bytes every example, so data left by an earlier example cannot pass for this one
    src[:] = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).integers(
        0, 256, src.shape, dtype=np.uint8
    )
    assert sender.write("peer", copies).result(30) == len(copies) * BLOCK_BYTES
    for c in copies:
        peer.mirror[c.region_id, c.dst_block] = src[c.region_id, c.src_block]
    assert peer.digests() == peer.expected_digests()


def test_long_and_short_runs_in_one_write_arrive_exactly(
    pair: tuple[Transport, PeerProcess, np.ndarray],
) -> None:
    """Whole regions (256 KiB runs: read straight into place over TCP) next to single scattered blocks."""
    sender, peer, src = pair
    src[:] = np.random.default_rng(7).integers(0, 256, src.shape, dtype=np.uint8)
    copies = [BlockCopy(0, 0, 0, BLOCKS), BlockCopy(1, 0, 0, BLOCKS)]
    copies += [BlockCopy(2, s, BLOCKS - 1 - s) for s in range(0, BLOCKS, 3)]
    assert sender.write("peer", copies).result(30) == (2 * BLOCKS + len(range(0, BLOCKS, 3))) * BLOCK_BYTES
    peer.mirror[0], peer.mirror[1] = src[0], src[1]
    for s in range(0, BLOCKS, 3):
        peer.mirror[2, BLOCKS - 1 - s] = src[2, s]
    assert peer.digests() == peer.expected_digests()


@contextlib.contextmanager
def _one_region(
    kind: str, tls: str, peer_factory: type[PeerProcess], blocks: int, block_bytes: int, seed: int
) -> Iterator[tuple[Transport, PeerProcess, np.ndarray, list[BlockCopy]]]:
    """A sender attached to a peer of one region, with every other block copied to the mirrored position
    (single-block runs: nothing merges); the sender is closed on the way out."""
    sender = build(kind, tls)
    peer = peer_factory(kind, tls, 1, blocks, block_bytes)
    try:
        src, regions = local_regions(1, blocks, block_bytes, seed=seed)
        sender.register(regions)
        sender.attach("p", peer.descriptor).result(10)
        yield sender, peer, src, [BlockCopy(0, s, blocks - 1 - s) for s in range(0, blocks, 2)]
    finally:
        sender.close()


def _assert_landed(peer: PeerProcess, src: np.ndarray, copies: list[BlockCopy]) -> None:
    for c in copies:
        peer.mirror[c.region_id, c.dst_block] = src[c.region_id, c.src_block]
    assert peer.digests() == peer.expected_digests()


@pytest.mark.parametrize(("kind", "tls"), TRANSPORTS, ids=TRANSPORT_IDS)
def test_scattered_large_blocks_arrive_exactly(kind: str, tls: str, peer_factory: type[PeerProcess]) -> None:
    """64 KiB blocks in single-block runs: tcp sends them in ``PutBlocks`` frames as one buffer per block (the
    kernel gathers them), where 4 KiB blocks are gathered by numpy first."""
    block_bytes = 64 << 10
    with _one_region(kind, tls, peer_factory, 24, block_bytes, seed=3) as (sender, peer, src, copies):
        assert sender.write("p", copies).result(30) == len(copies) * block_bytes
        _assert_landed(peer, src, copies)


def test_writers_on_several_threads_never_lose_a_wake_up(
    pair: tuple[Transport, PeerProcess, np.ndarray],
) -> None:
    """Four engine threads write single blocks with random gaps, so writes arrive while the transport's I/O
    thread is busy, polling outstanding writes, or asleep (ucx wakes it only when asleep): every write lands."""
    sender, peer, src = pair
    src[:] = np.random.default_rng(21).integers(0, 256, src.shape, dtype=np.uint8)
    futures: list[Future[int]] = []
    lock = threading.Lock()

    def writer(region: int) -> None:
        rng = np.random.default_rng(region)
        for block in range(BLOCKS):
            future = sender.write("peer", [BlockCopy(region, block, BLOCKS - 1 - block)])
            with lock:
                futures.append(future)
            time.sleep(float(rng.choice([0.0, 0.0002, 0.002, 0.01])))

    threads = [threading.Thread(target=writer, args=(region % REGIONS,)) for region in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    done, not_done = wait(futures, timeout=30)
    assert not not_done, f"{len(not_done)} of {len(futures)} writes never completed"
    assert all(f.result() == BLOCK_BYTES for f in done)
    for region in range(REGIONS):
        peer.mirror[region] = src[region, ::-1]
    assert peer.digests() == peer.expected_digests()


def test_an_idle_connection_does_not_spin(pair: tuple[Transport, PeerProcess, np.ndarray]) -> None:
    """Both ends of an attached, idle pair use well under 2 % of a core (CPU time, not wall time)."""
    _, peer, _ = pair
    start_self, start_peer = time.process_time(), peer.cpu_seconds()
    time.sleep(1.0)
    used = time.process_time() - start_self + peer.cpu_seconds() - start_peer
    assert used < 0.02, f"idle pair used {100 * used:.1f} % of a core"


def test_bad_requests_fail_the_future_and_write_nothing(
    pair: tuple[Transport, PeerProcess, np.ndarray],
) -> None:
    sender, peer, _ = pair
    before = peer.digests()
    bad = {
        "unknown region": [BlockCopy(REGIONS, 0, 0)],
        "past the last block": [BlockCopy(0, 0, 0), BlockCopy(1, 0, BLOCKS - 1, 2)],
        "destination written twice": [BlockCopy(0, 0, 3), BlockCopy(0, 1, 3)],
    }
    for why, copies in bad.items():
        with pytest.raises(ValueError):
            sender.write("peer", copies).result(10)
        assert peer.digests() == before, why
    with pytest.raises(ConnectionError, match="not attached"):
        sender.write("nobody", [BlockCopy(0, 0, 0)]).result(10)
    assert sender.write("peer", []).result(10) == 0


@pytest.mark.parametrize(("kind", "tls"), TRANSPORTS, ids=TRANSPORT_IDS)
def test_peer_killed_fails_writes_in_bounded_time_and_leaks_nothing(
    kind: str, tls: str, peer_factory: type[PeerProcess]
) -> None:
    write_timeout_s = 3.0
    sender = build(kind, tls, write_timeout_s=write_timeout_s)
    blocks, block_bytes = 256, 64 << 10
    peer = peer_factory(kind, tls, 2, blocks, block_bytes)
    try:
        _, regions = local_regions(2, blocks, block_bytes, seed=1)
        sender.register(regions)
        sender.attach("p", peer.descriptor).result(10)
        whole = [BlockCopy(r, 0, 0, blocks) for r in range(2)]
        assert sender.write("p", whole).result(30) == 2 * blocks * block_bytes
        if tls.startswith("sm"):
            # UCX aborts the process when a shared-memory (cma) put hits a dead peer with error handling off
            # (see docs/configuration.md): the sm path is guaranteed for a peer that dies between writes,
            # which the pidfd watch detects before anything is posted.
            peer.kill()
            futures = [sender.write("p", whole) for _ in range(4)]
        else:
            futures = [sender.write("p", whole) for _ in range(20)]  # 640 MiB in flight
            peer.kill()
        started = time.monotonic()
        _, not_done = wait(futures, timeout=write_timeout_s + 10)
        assert not not_done, "writes hung after the peer died"
        assert time.monotonic() - started < write_timeout_s + 10
        failures = [f.exception() for f in futures if f.exception() is not None]
        assert failures and all(isinstance(e, (ConnectionError, TimeoutError)) for e in failures)
        with pytest.raises((ConnectionError, TimeoutError)):
            sender.write("p", whole).result(write_timeout_s + 10)
        sender.detach("p")
        assert sender.attached_peers() == []  # type: ignore[attr-defined]
    finally:
        sender.close()
    assert sender.registered_regions() == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(("kind", "tls"), TRANSPORTS, ids=TRANSPORT_IDS)
def test_detach_from_a_done_callback_does_not_deadlock(kind: str, tls: str) -> None:
    """Write futures resolve on the transport's I/O thread; detaching from their callback must not hang."""
    transport = build(kind, tls)
    try:
        data, regions = local_regions(1, 4, BLOCK_BYTES, seed=5)
        transport.attach("self", transport.register(regions)).result(10)  # write into our own memory
        detached = threading.Event()

        def on_done(_: Future[int]) -> None:
            transport.detach("self")
            detached.set()

        transport.write("self", [BlockCopy(0, 0, 2, 2)]).add_done_callback(on_done)
        assert detached.wait(10), "detach from the I/O thread hung"
        assert (data[0, 2:] == data[0, :2]).all()
        wait_until(lambda: transport.attached_peers() == [], 5, "the detach")  # type: ignore[attr-defined]
    finally:
        transport.close()


@pytest.mark.parametrize(("kind", "tls"), TRANSPORTS, ids=TRANSPORT_IDS)
def test_a_scattered_write_is_not_starved_by_a_thread_running_python(
    kind: str, tls: str, peer_factory: type[PeerProcess]
) -> None:
    """An engine's threads run Python while layers are in flight. A thread that wants the GIL back waits up to
    the interpreter's switch interval (5 ms) each time it let go, so a transport that lets go per span (a UCX
    transport posting and progressing 4096 puts on one Python thread took ~20 s here) is starved. This write of
    4096 unmergeable spans must land within 400 switch intervals (2 s) while another thread spins in Python;
    each transport here needs well under a hundred."""
    with _one_region(kind, tls, peer_factory, 8192, BLOCK_BYTES, seed=9) as (sender, peer, src, copies):
        assert sender.write("p", copies[:8]).result(30) == 8 * BLOCK_BYTES  # connection warmed up
        with python_spinner():
            started = time.monotonic()
            assert sender.write("p", copies).result(60) == len(copies) * BLOCK_BYTES
            elapsed = time.monotonic() - started
        assert elapsed < 400 * sys.getswitchinterval(), f"{len(copies)} spans took {elapsed:.1f} s"
        _assert_landed(peer, src, copies)


# -- planning and queueing -------------------------------------------------------------------------------------------
#: Transports with an I/O thread that runs queued work in order (``_submit``). cma plans a write on the calling
#: thread (its I/O thread only makes system calls); ucx plans on its I/O thread, which has the time while
#: UCX's progress thread copies; tcp plans on its event loop, next to the socket.
QUEUED = [t for t in TRANSPORTS if t[0] in ("cma", "ucx") and t[1] != "tcp,self"]


@pytest.fixture(params=QUEUED, ids=["cma", "ucx_sm"])
def queued_sender(request: pytest.FixtureRequest) -> Iterator[tuple[Any, str, str]]:
    kind, tls = request.param
    sender = build(kind, tls)
    yield sender, kind, tls
    sender.close()


def test_a_bad_write_fails_with_what_is_wrong(
    queued_sender: tuple[Any, str, str], peer_factory: type[PeerProcess]
) -> None:
    sender, kind, tls = queued_sender
    peer = peer_factory(kind, tls, 1, 4, 4096)
    _, regions = local_regions(1, 4, 4096, seed=1)
    sender.register(regions)
    sender.attach("p", peer.descriptor).result(10)
    future = sender.write("p", [BlockCopy(0, 0, 4)])  # block 4 of 4: past the peer's end
    if kind == "cma":
        assert future.done()  # planned on this thread: no trip through the I/O thread
    with pytest.raises(ValueError, match="reaches block 4 but local has 4 and remote has 4"):
        future.result(5)
    assert sender.attached_peers() == ["p"]  # a bad write is the caller's mistake, not the peer's


def test_a_write_queued_behind_a_re_attach_lands_in_the_new_peer(
    queued_sender: tuple[Any, str, str], peer_factory: type[PeerProcess]
) -> None:
    """A write queued behind an ``attach`` that replaces its peer goes to the new peer (its addresses differ).
    cma plans against the peer attached when ``write`` is called and plans again on the I/O thread when that
    peer was replaced; ucx plans on the I/O thread only."""
    sender, kind, tls = queued_sender
    old, new = peer_factory(kind, tls, 1, 4, 4096), peer_factory(kind, tls, 1, 4, 4096)
    src, regions = local_regions(1, 4, 4096, seed=5)
    sender.register(regions)
    sender.attach("p", old.descriptor).result(10)
    gate = threading.Event()
    sender._submit(lambda: gate.wait(10))  # hold the I/O thread so both calls below queue up behind it
    attached = sender.attach("p", new.descriptor)
    written = sender.write("p", [BlockCopy(0, 0, 3), BlockCopy(0, 1, 0)])
    gate.set()
    attached.result(10)
    assert written.result(10) == 2 * 4096
    new.mirror[0, 3], new.mirror[0, 0] = src[0, 0], src[0, 1]
    assert new.digests() == new.expected_digests()
    assert old.digests() == old.expected_digests()  # untouched: still all zeros
