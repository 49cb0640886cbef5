"""Transfer engine flows over the in-process loopback transport: push and standard flows, chunked and
prefix-cached prefills, per-layer tables, prompt digests, exact bytes for random block maps, idle engines.

Failures (leases, timeouts, aborts, holes, restarts) are in ``test_transfer_failures.py``; the trust checks
(layouts, HMAC, protected mode, peer policy) in ``test_transfer_trust.py``; ``Pair`` in ``engines.py``."""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_connector.protocol import prompt_digest
from pd_connector.transfer import TransferState
from tests.pd_connector.engines import (
    SMALL,
    Pair,
    addr,
    assert_no_state,
    wait_results,
)
from tests.polling import wait_until


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
    wait_until(lambda: pair.p.state("t2") is TransferState.WAITING, 5, "P's intent waiting for D")
    pair.d.expect("t2", addr(pair.p), [30, 31], 8)
    assert wait_results(pair.d, {"t2"})["t2"].first_token == 7
    assert wait_results(pair.p, {"t2"})["t2"].state is TransferState.DONE
    pair.assert_copied([1, 2], [30, 31], 8)
    assert_no_state(pair.p, pair.d)


def test_destinations_before_offer_are_kept_until_offer(pair: Pair) -> None:
    pair.d.expect("t3", addr(pair.p), [9], 4)
    # Destinations reach P before its scheduler saw the request: P keeps them.
    wait_until(lambda: pair.p.table_sizes()["orphan_destinations"] == 1, 5, "D's destinations kept at P")
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
