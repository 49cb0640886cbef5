"""Transfer engine failures over the in-process loopback transport: leases, timeouts, aborts from either side,
holes in a layer, a prefill restart, random failures under concurrency, and construction failures; every one
ends exactly once on both sides and leaves no state behind."""

from __future__ import annotations

import random
import socket
import time

import pytest

from pd_connector.transfer import TransferConfig, TransferEngine, TransferState
from pd_connector.transport.loopback import LoopbackFabric, LoopbackTransport
from tests.pd_connector.engines import (
    FAST,
    SLACK_S,
    SMALL,
    KVCache,
    Pair,
    addr,
    assert_no_state,
    closing,
    leaks,
    make_engine,
    wait_results,
)
from tests.polling import wait_until


def test_lease_expires_when_decode_never_comes() -> None:
    pr = Pair(lease_s=0.3)
    with closing(pr.p, pr.d):
        t0 = time.monotonic()
        pr.push_all("lonely", [1, 2])
        r = wait_results(pr.p, {"lonely"}, timeout_s=3)["lonely"]
        assert r.state is TransferState.FAILED and r.lease_expired and "lease expired" in r.reason
        assert 0.25 < time.monotonic() - t0 < 0.3 + SLACK_S
        assert pr.p.counters().expired_leases == 1
        assert_no_state(pr.p, pr.d)


def test_decode_times_out_when_prefill_never_offers() -> None:
    pr = Pair(lease_s=0.5)
    with closing(pr.p, pr.d):
        t0 = time.monotonic()
        pr.d.expect("late", addr(pr.p), [1], 4, timeout_s=0.3)
        r = wait_results(pr.d, {"late"}, timeout_s=3)["late"]
        assert r.state is TransferState.FAILED and "within 0.3 s" in r.reason
        assert time.monotonic() - t0 < 0.3 + 0.5 + SLACK_S  # timeout + abort grace
        assert pr.d.counters().timeouts == 1
        # P was told (its orphan destinations are gone) before D reported.
        assert_no_state(pr.p, pr.d)
        pr.push_all("late", [3])  # P's scheduler shows up after D gave up: its lease ends it, nothing written
        r = wait_results(pr.p, {"late"}, timeout_s=3)["late"]
        assert r.state is TransferState.FAILED and r.lease_expired and r.bytes == 0
        assert not pr.dc.arrays[0].any()


def test_decode_gives_up_mid_transfer_and_prefill_stops() -> None:
    pr = Pair(lease_s=0.5)
    with closing(pr.p, pr.d):
        pr.d.expect("slow", addr(pr.p), [1, 2], 8, timeout_s=0.3)
        pr.p.offer("slow", [5, 6])
        pr.p.push_layer("slow", 0)  # P stalls before layer 1 (a very slow prefill)
        d = wait_results(pr.d, {"slow"}, timeout_s=3)["slow"]
        p = wait_results(pr.p, {"slow"}, timeout_s=3)["slow"]
        assert d.state is TransferState.FAILED and "no KV from prefill" in d.reason
        # P stops at D's deadline (its lease is capped by it) or on D's Abort, whichever it sees first.
        assert (p.state, p.reason) in {
            (TransferState.FAILED, "decode gave up: no KV from prefill within 0.3 s"),
            (TransferState.FAILED, "lease expired"),
        }
        pr.p.push_layer("slow", 1)  # the late layer is ignored: the transfer is gone
        assert pr.p.poll() == []
        assert_no_state(pr.p, pr.d)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_from_either_side_reaches_the_other(pair: Pair, side: str) -> None:
    pair.d.expect("ab", addr(pair.p), [1, 2], 8)
    pair.p.offer("ab", [3, 4])
    pair.p.push_layer("ab", 0)
    wait_until(lambda: pair.d.state("ab") is TransferState.TRANSFERRING, 5, "layer 0 landed on D")
    (pair.p if side == "prefill" else pair.d).abort("ab", "client disconnected")
    d = wait_results(pair.d, {"ab"})["ab"]
    p = wait_results(pair.p, {"ab"})["ab"]
    assert d.state is TransferState.ABORTED and p.state is TransferState.ABORTED
    assert "client disconnected" in d.reason and "client disconnected" in p.reason
    pair.p.abort("ab")  # idempotent
    pair.d.abort("ab")
    assert pair.p.poll() == [] and pair.d.poll() == []
    assert_no_state(pair.p, pair.d)


def test_abort_before_anything_happened(pair: Pair) -> None:
    pair.d.expect("early", addr(pair.p), [1], 4)
    pair.d.abort("early")
    assert wait_results(pair.d, {"early"})["early"].state is TransferState.ABORTED
    pair.p.offer("never", [1])
    pair.p.abort("never")
    assert wait_results(pair.p, {"never"})["never"].state is TransferState.ABORTED
    wait_until(lambda: not leaks(pair.p) and not leaks(pair.d), 5, "both engines without per-request state")


@pytest.mark.parametrize(
    ("pushes", "hole"),
    [
        (
            [(layer, 0, 1) for layer in range(3)],
            "layer 0 is missing tokens [4, 8)",
        ),  # the tail of every layer
        # P's prefix-cache hit (block 0) never pushed, the highest token covered: the hole that once passed.
        ([(layer, 1, 2) for layer in range(3)], "layer 0 is missing tokens [0, 4)"),
        ([(0, 0, 2), (1, 0, 2), (2, 0, 1)], "layer 2 is missing tokens [4, 8)"),  # one layer short
    ],
)
def test_a_hole_in_any_layer_fails_both_sides(
    pair: Pair, pushes: list[tuple[int, int, int]], hole: str
) -> None:
    """Done only when every layer holds every token D asked for; otherwise both sides fail, naming the hole."""
    pair.d.expect("short", addr(pair.p), [1, 2], 8)
    pair.p.offer("short", [3, 4])
    for layer, first, end in pushes:
        pair.p.push_layer("short", layer, first, end)
    pair.p.finish("short")
    d = wait_results(pair.d, {"short"})["short"]
    p = wait_results(pair.p, {"short"})["short"]
    assert d.state is TransferState.FAILED and hole in d.reason, d.reason
    assert p.state is TransferState.FAILED
    assert_no_state(pair.p, pair.d)


def test_decode_reconnects_after_prefill_restart() -> None:
    fabric = LoopbackFabric()
    pc, dc = KVCache(SMALL, 8, 1), KVCache(SMALL, 8, None)
    d = make_engine(dc, LoopbackTransport(fabric), False, "D", **FAST)
    p1 = make_engine(pc, LoopbackTransport(fabric), True, "P1", **FAST)
    with closing(d, p1):
        port = addr(p1).rsplit(":", 1)[1]
        d.expect("a", addr(p1), [1], 4)
        wait_until(lambda: p1.table_sizes()["orphan_destinations"] == 1, 5, "D's destinations at P1")
        p1.close()  # P dies with D's transfer pending
        r = wait_results(d, {"a"}, timeout_s=3)["a"]
        assert r.state is TransferState.FAILED and "lost" in r.reason
        p2 = make_engine(pc, LoopbackTransport(fabric), True, "P2", listen_port=int(port), **FAST)
        with closing(p2):
            assert addr(p2).endswith(port)
            d.expect("b", addr(p2), [1], 4)
            p2.offer("b", [0])
            for layer in range(3):
                p2.push_layer("b", layer)
            p2.finish("b")
            assert wait_results(d, {"b"})["b"].state is TransferState.DONE
            assert wait_results(p2, {"b"})["b"].state is TransferState.DONE
            assert_no_state(d, p2)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_many_concurrent_transfers_with_random_failures_end_exactly_once(seed: int) -> None:
    """30 transfers at once, each with a random fate; every side reports each exactly once, nothing leaks,
    and every transfer that both sides call DONE carried exact bytes."""
    rng = random.Random(seed)
    pr = Pair(lease_s=1.0)
    fates = ["ok", "ok", "ok", "p_abort", "d_abort", "d_timeout", "p_never", "d_never", "finish_first"]
    plan = {}
    free_src, free_dst = list(range(32)), list(range(32))
    rng.shuffle(free_src)
    rng.shuffle(free_dst)
    try:
        for i in range(30):
            tid, fate = f"t{i}", rng.choice(fates)
            src = [free_src[(i + k) % 32] for k in range(2)]
            dst = [free_dst[(i * 2 + k) % 32] for k in range(2)] if fate in ("ok",) else [free_dst[i % 32]]
            plan[tid] = (fate, src, dst)
        # Destination blocks of "ok" transfers must not be shared with any other writer.
        ok_dst = [b for f, _, d in plan.values() if f == "ok" for b in d]
        for tid, (fate, src, dst) in plan.items():
            if fate == "ok" and len(set(ok_dst)) != len(ok_dst):
                plan[tid] = ("d_abort", src, dst)
                ok_dst = [b for f, _, d in plan.values() if f == "ok" for b in d]
        for tid, (fate, src, dst) in plan.items():
            tokens = 4 * len(dst)
            if fate != "d_never":
                pr.d.expect(tid, addr(pr.p), dst, tokens, timeout_s=0.3 if fate == "d_timeout" else 5.0)
            if fate == "p_never":
                continue
            pr.p.offer(tid, src[: len(dst)])
            if fate == "finish_first":
                pr.p.finish(tid)  # nothing pushed: the transfer fails, both sides told
                continue
            for layer in range(SMALL.num_layers):
                pr.p.push_layer(tid, layer)
                if fate == "p_abort" and layer == 1:
                    pr.p.abort(tid, "chaos")
                if fate == "d_abort" and layer == 1:
                    pr.d.abort(tid, "chaos")
            if fate != "d_timeout":
                pr.p.finish(tid, first_token=int(tid[1:]))
        d_ids = {t for t, (f, _, _) in plan.items() if f != "d_never"}
        p_ids = {t for t, (f, _, _) in plan.items() if f != "p_never"}
        d_res = wait_results(pr.d, d_ids, timeout_s=15)
        p_res = wait_results(pr.p, p_ids, timeout_s=15)
        for tid, (fate, src, dst) in plan.items():
            d, p = d_res.get(tid), p_res.get(tid)
            if fate == "ok":
                assert d is not None and p is not None
                assert d.state is p.state is TransferState.DONE, (tid, d, p)
                assert d.first_token == int(tid[1:])
                pr.assert_copied(src, dst, 4 * len(dst))
            elif fate in ("p_never", "d_never", "finish_first", "d_timeout"):
                assert all(r is None or r.state is TransferState.FAILED for r in (d, p)), (tid, fate, d, p)
            else:  # an abort races the pushes: it may also lose against a transfer that already finished
                assert {r.state for r in (d, p) if r is not None} <= {
                    TransferState.ABORTED,
                    TransferState.DONE,
                }
        wait_until(lambda: not leaks(pr.p) and not leaks(pr.d), 5, "both engines without per-request state")
        assert pr.d.poll() == [] and pr.p.poll() == [], "a transfer reported twice"
    finally:
        pr.close()


def test_prefill_abort_before_destinations_reaches_decode_at_once() -> None:
    pr = Pair(lease_s=30.0)
    with closing(pr.p, pr.d):
        pr.p.offer("early", [1])
        pr.p.abort("early", "client left")
        assert wait_results(pr.p, {"early"})["early"].state is TransferState.ABORTED
        t0 = time.monotonic()
        pr.d.expect("early", addr(pr.p), [2], 4)  # D learns at once, not after P's 30 s lease
        r = wait_results(pr.d, {"early"}, timeout_s=5)["early"]
        assert r.state is TransferState.ABORTED and "client left" in r.reason
        assert time.monotonic() - t0 < SLACK_S
        assert pr.p.table_sizes()["tombstones"] == 0  # consumed
        assert_no_state(pr.p, pr.d)


def test_decode_abort_before_its_destinations_left_releases_prefill_at_once() -> None:
    pr = Pair(lease_s=30.0)
    with closing(pr.p, pr.d):
        pr.p.offer("gone", [1])
        pr.p.push_layer("gone", 0)
        pr.d.expect("gone", addr(pr.p), [2], 4)
        pr.d.abort("gone", "client left")  # most likely before the handshake finished
        assert wait_results(pr.d, {"gone"})["gone"].state is TransferState.ABORTED
        r = wait_results(pr.p, {"gone"}, timeout_s=5)["gone"]  # not after the 30 s lease
        assert r.state is TransferState.ABORTED and "client left" in r.reason
        assert_no_state(pr.p, pr.d)


def test_construction_failures_release_the_transport() -> None:
    fabric = LoopbackFabric()
    cache = KVCache(SMALL, 4, seed=None)
    with pytest.raises(ValueError, match="buffers"):
        TransferEngine(TransferConfig(engine_id="x"), SMALL, cache.buffers()[:1], LoopbackTransport(fabric))
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError):
            make_engine(cache, LoopbackTransport(fabric), True, listen_port=taken.getsockname()[1])
    finally:
        taken.close()
    assert len(fabric) == 0
