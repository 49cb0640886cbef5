"""Transfer engine state machine over the in-process loopback transport: flows, leases, timeouts, aborts."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_connector.layout import KVLayout
from pd_connector.protocol import HEADER, FrameCodec, Hello, HelloAck, prompt_digest
from pd_connector.transfer import TransferConfig, TransferEngine, TransferState
from pd_connector.transport.loopback import LoopbackFabric, LoopbackTransport
from pd_connector.trust import InsecureConfig
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
from tests.pd_connector.raw_peer import RawPeer

FAST = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0, "abort_grace_s": 0.5}


class Pair:
    """A prefill engine (listening) and a decode engine on one loopback fabric."""

    def __init__(self, p_layout: KVLayout = SMALL, d_layout: KVLayout = SMALL, **config: object) -> None:
        self.fabric = LoopbackFabric()
        self.pc, self.dc = KVCache(p_layout, 32, seed=1), KVCache(d_layout, 32, seed=None)
        cfg = {**FAST, **config}
        self.p = make_engine(self.pc, LoopbackTransport(self.fabric), True, "P", **cfg)
        self.d = make_engine(self.dc, LoopbackTransport(self.fabric), False, "D", **cfg)

    def push_all(self, tid: str, src: list[int], first_token: int | None = None) -> None:
        self.p.offer(tid, src)
        for layer in range(self.pc.layout.num_layers):
            self.p.push_layer(tid, layer)
        self.p.finish(tid, first_token)

    def assert_copied(self, src: list[int], dst: list[int], num_tokens: int, start_token: int = 0) -> None:
        """Tokens ``[start_token, num_tokens)`` equal on both sides; D's earlier tokens untouched (zero)."""
        cut = start_token * self.dc.layout.token_bytes
        for region in range(len(self.pc.arrays)):
            want, got = self.pc.tokens(region, src, num_tokens), self.dc.tokens(region, dst, num_tokens)
            assert want[cut:] == got[cut:], region
            assert not any(got[:cut]), region

    def close(self) -> None:
        self.p.close()
        self.d.close()
        assert len(self.fabric) == 0  # every registration released


@pytest.fixture
def pair() -> Iterator[Pair]:
    pr = Pair()
    yield pr
    pr.close()


def test_push_flow_copies_bytes_and_reports_once(pair: Pair) -> None:
    src, dst = [3, 5, 7], [10, 2, 4]
    pair.d.expect("t1", addr(pair.p), dst, 10)
    pair.push_all("t1", src, first_token=42)
    d = wait_results(pair.d, {"t1"})["t1"]
    p = wait_results(pair.p, {"t1"})["t1"]
    assert (d.state, d.first_token, d.num_tokens) == (TransferState.DONE, 42, 10)
    assert p.state is TransferState.DONE and p.bytes == d.bytes == 3 * 3 * SMALL.block_bytes
    pair.assert_copied(src, dst, 10)
    pc, dc = pair.p.counters(), pair.d.counters()
    assert (pc.transfers_sent, pc.layer_writes, pc.bytes_sent) == (1, 3, p.bytes)
    assert (dc.transfers_received, dc.bytes_received) == (1, d.bytes)
    assert set(pc.per_layer_seconds) == {0, 1, 2} and pc.exposed_seconds >= 0
    assert pair.p.poll() == [] and pair.d.poll() == [] and pair.d.state("t1") is None
    assert_no_state(pair.p, pair.d)


def test_prefill_first_then_decode_standard_flow(pair: Pair) -> None:
    """vLLM's standard flow: P computes and finishes before D exists; the intents wait for D."""
    pair.push_all("t2", [1, 2], first_token=7)
    time.sleep(0.05)
    assert pair.p.state("t2") is TransferState.WAITING
    pair.d.expect("t2", addr(pair.p), [30, 31], 8)
    assert wait_results(pair.d, {"t2"})["t2"].first_token == 7
    assert wait_results(pair.p, {"t2"})["t2"].state is TransferState.DONE
    pair.assert_copied([1, 2], [30, 31], 8)
    assert_no_state(pair.p, pair.d)


def test_destinations_before_offer_are_kept_until_offer(pair: Pair) -> None:
    pair.d.expect("t3", addr(pair.p), [9], 4)
    time.sleep(0.1)  # Destinations reached P before its scheduler saw the request
    assert pair.p.table_sizes()["orphan_destinations"] == 1
    pair.push_all("t3", [0])
    assert wait_results(pair.d, {"t3"})["t3"].state is TransferState.DONE
    wait_results(pair.p, {"t3"})
    pair.assert_copied([0], [9], 4)
    assert_no_state(pair.p, pair.d)


def test_chunked_prefill_extends_the_table_and_pushes_every_chunk(pair: Pair) -> None:
    src, dst = [4, 8, 12, 16], [1, 3, 5, 7]
    pair.d.expect("t4", addr(pair.p), dst, 14)
    pair.p.offer("t4", src[:2])  # chunk 1: tokens 0..6, blocks 0-1 (block 1 partial)
    for layer in range(3):
        pair.p.push_layer("t4", layer, 0, 2)
    pair.p.offer("t4", src)  # chunk 2: tokens 6..14 rewrite block 1 and add blocks 2-3
    for layer in range(3):
        pair.p.push_layer("t4", layer, 1, 4)
    pair.p.finish("t4")
    assert wait_results(pair.d, {"t4"})["t4"].state is TransferState.DONE
    wait_results(pair.p, {"t4"})
    pair.assert_copied(src, dst, 14)
    assert_no_state(pair.p, pair.d)


def test_per_layer_destination_tables(pair: Pair) -> None:
    tables = [[1, 2], [3, 4], [5, 6]]
    pair.d.expect("t5", addr(pair.p), [], 8, layer_dst_blocks=tables)
    pair.push_all("t5", [20, 21])
    assert wait_results(pair.d, {"t5"})["t5"].state is TransferState.DONE
    wait_results(pair.p, {"t5"})
    for layer, dst in enumerate(tables):
        assert pair.pc.tokens(layer, [20, 21], 8) == pair.dc.tokens(layer, dst, 8)


def test_prefix_cached_tokens_are_skipped(pair: Pair) -> None:
    """D already holds block 0 (a local prefix-cache hit): P writes only what follows."""
    pair.d.expect("pc", addr(pair.p), [7, 8, 9], 12, start_token=4)
    pair.push_all("pc", [1, 2, 3])
    assert wait_results(pair.d, {"pc"})["pc"].state is TransferState.DONE
    assert wait_results(pair.p, {"pc"})["pc"].bytes == 3 * 2 * SMALL.block_bytes
    pair.assert_copied([1, 2, 3], [7, 8, 9], 12, start_token=4)


def test_bad_expect_arguments_fail_fast(pair: Pair) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        pair.d.expect("x", addr(pair.p), [1, 2], 8, start_token=2)
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        pair.d.expect("x", addr(pair.p), [1, 2], 9)
    with pytest.raises(ValueError, match="host:port"):
        pair.d.expect("x", "nohost", [1], 1)
    with pytest.raises(ValueError, match="per-layer"):
        pair.d.expect("x", addr(pair.p), [], 1, layer_dst_blocks=[[1]])
    pair.d.expect("dup", addr(pair.p), [1], 4, timeout_s=0.2)
    with pytest.raises(ValueError, match="already expected"):
        pair.d.expect("dup", addr(pair.p), [2], 4)
    with pytest.raises(ValueError, match="layer 3"):
        pair.p.push_layer("x", 3)
    assert wait_results(pair.d, {"dup"})["dup"].state is TransferState.FAILED


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
    time.sleep(0.05)
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
    time.sleep(0.1)
    assert_no_state(pair.p, pair.d)


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


@pytest.mark.parametrize("order", ["decode first", "prefill first"])
def test_a_different_prompt_under_the_same_id_fails_before_any_write(pair: Pair, order: str) -> None:
    """A P and a D that paired different prompts under one transfer id (prompt lists, a buggy proxy) must
    not decode one prompt from the other's KV: P fails the transfer and writes nothing."""
    p_hash, d_hash = prompt_digest([1, 2, 3, 4, 5, 6, 7, 8]), prompt_digest([1, 2, 3, 4, 5, 6, 7, 9])
    if order == "decode first":
        pair.d.expect("mix", addr(pair.p), [5, 6], 8, prompt_hash=d_hash)
        pair.p.offer("mix", [1, 2], prompt_hash=p_hash)
    else:
        pair.p.offer("mix", [1, 2], prompt_hash=p_hash)
        pair.d.expect("mix", addr(pair.p), [5, 6], 8, prompt_hash=d_hash)
    for layer in range(SMALL.num_layers):
        pair.p.push_layer("mix", layer)
    pair.p.finish("mix")
    d, p = wait_results(pair.d, {"mix"})["mix"], wait_results(pair.p, {"mix"})["mix"]
    assert d.state is p.state is TransferState.FAILED and "prompt differs" in d.reason
    assert p.bytes == 0 and not any(pair.dc.tokens(0, [5, 6], 8))
    assert_no_state(pair.p, pair.d)


def test_equal_prompt_digests_transfer(pair: Pair) -> None:
    digest = prompt_digest(range(8))
    assert digest == prompt_digest(list(range(8))) and len(digest) == 16
    pair.d.expect("same", addr(pair.p), [5, 6], 8, prompt_hash=digest)
    pair.p.offer("same", [1, 2], prompt_hash=digest)
    for layer in range(SMALL.num_layers):
        pair.p.push_layer("same", layer)
    pair.p.finish("same")
    assert wait_results(pair.d, {"same"})["same"].state is TransferState.DONE
    wait_results(pair.p, {"same"})
    pair.assert_copied([1, 2], [5, 6], 8)


def test_overlapping_pushes_in_any_order_cover_the_prompt(pair: Pair) -> None:
    """Chunks arrive as recorded intents and re-pushed boundary blocks: coverage is a union of spans."""
    pair.d.expect("ov", addr(pair.p), [7, 8, 9], 12)
    pair.p.offer("ov", [1, 2, 3])
    for layer in range(SMALL.num_layers):
        pair.p.push_layer("ov", layer, 2, 3)
        pair.p.push_layer("ov", layer, 0, 2)
        pair.p.push_layer("ov", layer, 1, 3)
    pair.p.finish("ov")
    assert wait_results(pair.d, {"ov"})["ov"].state is TransferState.DONE
    assert wait_results(pair.p, {"ov"})["ov"].state is TransferState.DONE
    pair.assert_copied([1, 2, 3], [7, 8, 9], 12)


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


def test_decode_reconnects_after_prefill_restart() -> None:
    fabric = LoopbackFabric()
    pc, dc = KVCache(SMALL, 8, 1), KVCache(SMALL, 8, None)
    d = make_engine(dc, LoopbackTransport(fabric), False, "D", **FAST)
    p1 = make_engine(pc, LoopbackTransport(fabric), True, "P1", **FAST)
    with closing(d, p1):
        port = addr(p1).rsplit(":", 1)[1]
        d.expect("a", addr(p1), [1], 4)
        time.sleep(0.1)
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


def test_closed_engine_refuses_calls(pair: Pair) -> None:
    pair.p.close()
    with pytest.raises(RuntimeError, match="closed"):
        pair.p.offer("z", [1])


TOKEN_MAJOR = msgspec.structs.replace(SMALL, token_major=True, kv_split=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bytes_arrive_exactly_for_random_block_maps(data: st.DataObject) -> None:
    """Random block tables, prompt lengths and (token-major) block sizes on P and D: every token lands."""
    token_major = data.draw(st.booleans(), "token_major")
    if token_major:
        p_bt, d_bt = (
            data.draw(st.sampled_from([2, 4, 8]), "p_bt"),
            data.draw(st.sampled_from([2, 4, 8]), "d_bt"),
        )
        base = TOKEN_MAJOR
    else:
        p_bt = d_bt = data.draw(st.sampled_from([2, 4]), "bt")
        base = SMALL
    p_layout = msgspec.structs.replace(base, block_tokens=p_bt)
    d_layout = msgspec.structs.replace(base, block_tokens=d_bt)
    num_tokens = data.draw(st.integers(1, 40), "num_tokens")
    granule = 1 if token_major else p_bt
    start_token = data.draw(st.integers(0, (num_tokens - 1) // granule), "start_blocks") * granule
    p_n, d_n = -(-num_tokens // p_bt), -(-num_tokens // d_bt)
    src = data.draw(st.permutations(range(32)), "src")[:p_n]
    dst = data.draw(st.permutations(range(32)), "dst")[:d_n]
    pr = Pair(p_layout, d_layout)
    try:
        pr.d.expect("r", addr(pr.p), dst, num_tokens, start_token=start_token)
        pr.push_all("r", src)
        assert wait_results(pr.d, {"r"})["r"].state is TransferState.DONE
        assert wait_results(pr.p, {"r"})["r"].state is TransferState.DONE
        pr.assert_copied(src, dst, num_tokens, start_token)
        assert_no_state(pr.p, pr.d)
    finally:
        pr.close()


def test_idle_engines_do_not_spin(pair: Pair) -> None:
    """An open, idle connection costs (almost) no CPU: the I/O threads sleep between heartbeats."""
    pair.d.expect("warm", addr(pair.p), [1], 4)
    pair.push_all("warm", [2])
    wait_results(pair.d, {"warm"})
    wait_results(pair.p, {"warm"})
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(1.0)
    busy = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    assert busy < 0.05, f"idle engines used {busy:.1%} of a core"


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
        time.sleep(0.1)
        assert pr.d.poll() == [] and pr.p.poll() == []
        assert_no_state(pr.p, pr.d)
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
