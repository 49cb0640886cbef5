"""Tensor parallelism across P and D: every D rank's heads land exactly, whatever the TP sizes on each side.

A model's KV cache (``HEADS`` heads, heads-major blocks as vLLM's CPU cache) is split over P's ranks as vLLM
splits it; each P rank is a transfer engine with its own side channel (rank 0's port + rank), each D rank one
with its own cache. A D rank names only P's rank 0, learns P's split from its handshake and takes each head
from the first P rank holding it. Proven for random TP pairs, block tables and prefix hits (hypothesis), plus
the plan itself, the fan-out, the operations per layer, and a failure on one rank failing the transfer.
"""

from __future__ import annotations

from contextlib import ExitStack

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_connector.block_mapping import BlockMapping
from pd_connector.layout import (
    HeadSlice,
    KVLayout,
    LayoutMismatch,
    check_compatible,
    fanout,
    head_plan,
    rank_heads,
    sends_heads,
)
from pd_connector.transfer import TransferConfig, TransferEngine, TransferState
from pd_connector.transport.loopback import LoopbackFabric, LoopbackTransport
from pd_disagg.servers import free_ports
from tests.pd_connector.engines import assert_no_state, wait_results

FAST = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0, "abort_grace_s": 0.5}


def model_layout(heads: int, tp: int = 1, rank: int = 0) -> KVLayout:
    share = len(rank_heads(tp, rank, heads))
    return KVLayout(
        num_layers=2,
        block_tokens=4,
        num_kv_heads=share,
        head_dim=2,
        dtype="float16",
        kv_split=False,
        token_major=False,
        tp_size=tp,
        tp_rank=rank,
        total_kv_heads=heads,
    )


def test_rank_heads_follow_vllm() -> None:
    assert [list(rank_heads(2, r, 4)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(rank_heads(4, r, 2)) for r in range(4)] == [[0], [0], [1], [1]]  # replicated
    with pytest.raises(ValueError, match="evenly"):
        rank_heads(3, 0, 4)


def test_head_plans_for_both_directions() -> None:
    # P TP 2 -> D TP 1: D's two heads come from two P ranks.
    assert head_plan(2, model_layout(2)) == [HeadSlice(0, 0, 0, 1), HeadSlice(1, 0, 1, 1)]
    # P TP 1 -> D TP 2: each D rank takes its head out of P's two.
    assert head_plan(1, model_layout(2, 2, 1)) == [HeadSlice(0, 1, 0, 1)]
    # P TP 4 over 2 heads (replicated): heads come from ranks 0 and 2 only, once each.
    assert head_plan(4, model_layout(2)) == [HeadSlice(0, 0, 0, 1), HeadSlice(2, 0, 1, 1)]
    assert [sends_heads(model_layout(2, 4, r)) for r in range(4)] == [True, False, True, False]
    # Fan-out: how many D ranks a P rank serves.
    assert fanout(model_layout(2), decode_tp=2) == 2
    assert fanout(model_layout(4, 2, 1), decode_tp=4) == 2
    assert fanout(model_layout(2, 4, 1), decode_tp=1) == 0


def test_a_head_slice_costs_one_operation_per_block() -> None:
    """Operations per layer are bounded by blocks (the slice's heads of a block are contiguous), not by
    tokens x heads: a 4096-token prompt in 1024 fragmented blocks is 1024 runs of one head, and full heads
    of consecutive blocks coalesce into one run."""
    p, d = model_layout(2, 2, 1), model_layout(2)
    blocks = list(range(0, 2048, 2))  # every other block: nothing coalesces across blocks
    runs = BlockMapping(p, d).runs(blocks, blocks, 0, 4096, HeadSlice(1, 0, 1, 1))
    assert len(runs) == 1024 and all(n == 4 * 2 for _, _, n in runs)  # one head: 4 tokens x K|V vectors
    whole = BlockMapping(d, d).runs(list(range(1024)), list(range(1024)), 0, 4096)
    assert whole == [(0, 0, 1024 * 4 * 2 * 2)]


class Cluster:
    """P with ``p_tp`` ranks and D with ``d_tp`` ranks over one loopback fabric, ``heads`` KV heads."""

    def __init__(self, stack: ExitStack, heads: int, p_tp: int, d_tp: int, blocks: int = 16) -> None:
        self.heads, self.blocks = heads, blocks
        model = model_layout(heads)
        rng = np.random.default_rng(heads * 100 + p_tp * 10 + d_tp)
        hb = model.block_bytes // heads  # one head's part of a block
        # The model's cache per layer: [blocks, heads, head block bytes].
        self.model = [rng.integers(0, 256, (blocks, heads, hb), np.uint8) for _ in range(model.num_layers)]
        fabric = LoopbackFabric()
        base = free_ports(p_tp)
        self.addr = f"127.0.0.1:{base}"
        self.p: list[TransferEngine] = []
        self.p_layouts = [model_layout(heads, p_tp, r) for r in range(p_tp)]
        self._keep: list[np.ndarray] = []  # engines hold raw addresses: the arrays must outlive them
        for r, lay in enumerate(self.p_layouts):
            arrays = [np.ascontiguousarray(m[:, lay.heads.start : lay.heads.stop]) for m in self.model]
            self._keep += arrays
            cfg = TransferConfig(engine_id=f"P{r}", listen_port=base + r, **FAST)  # type: ignore[arg-type]
            engine = TransferEngine(
                cfg, lay, [(a.ctypes.data, a.nbytes) for a in arrays], LoopbackTransport(fabric)
            )
            stack.callback(engine.close)
            self.p.append(engine)
        self.d: list[TransferEngine] = []
        self.d_arrays: list[list[np.ndarray]] = []
        self.d_layouts = [model_layout(heads, d_tp, r) for r in range(d_tp)]
        for r, lay in enumerate(self.d_layouts):
            arrays = [np.zeros((blocks, lay.num_kv_heads, hb), np.uint8) for _ in self.model]
            self._keep += arrays
            cfg = TransferConfig(engine_id=f"D{r}", **FAST)  # type: ignore[arg-type]
            engine = TransferEngine(
                cfg, lay, [(a.ctypes.data, a.nbytes) for a in arrays], LoopbackTransport(fabric)
            )
            stack.callback(engine.close)
            self.d.append(engine)
            self.d_arrays.append(arrays)

    def run(self, tid: str, src: list[int], dst: list[int], tokens: int, start: int = 0) -> None:
        for d in self.d:
            d.expect(tid, self.addr, dst, tokens, start_token=start)
        senders = [p for p, lay in zip(self.p, self.p_layouts, strict=True) if sends_heads(lay)]
        for p in senders:
            p.offer(tid, src)
            for layer in range(len(self.model)):
                p.push_layer(tid, layer)
            p.finish(tid)
        for d in self.d:
            r = wait_results(d, {tid})[tid]
            assert r.state is TransferState.DONE, r
        for p in senders:
            assert wait_results(p, {tid})[tid].state is TransferState.DONE

    def assert_landed(self, src: list[int], dst: list[int], tokens: int, start: int = 0) -> None:
        bt = self.p_layouts[0].block_tokens
        first, end = start // bt, -(-tokens // bt)
        for arrays, lay in zip(self.d_arrays, self.d_layouts, strict=True):
            for layer, got in enumerate(arrays):
                want = self.model[layer][src[first:end]][:, lay.heads.start : lay.heads.stop]
                assert np.array_equal(got[dst[first:end]], want), (lay.tp_rank, layer)
                untouched = [b for b in range(self.blocks) if b not in dst[first:end]]
                assert not got[untouched].any(), "blocks outside the destinations stay untouched"


TP_CASES = [(heads, p, d) for heads in (1, 2, 4) for p in (1, 2, 4) for d in (1, 2, 4)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(TP_CASES),
    data=st.data(),
)
def test_every_decode_rank_gets_exactly_its_heads(case: tuple[int, int, int], data: st.DataObject) -> None:
    heads, p_tp, d_tp = case
    tokens = data.draw(st.integers(1, 24), "tokens")
    nblocks = -(-tokens // 4)
    src = data.draw(st.permutations(range(16)), "src")[:nblocks]
    dst = data.draw(st.permutations(range(16)), "dst")[:nblocks]
    start = data.draw(st.integers(0, (tokens - 1) // 4), "cached blocks") * 4
    with ExitStack() as stack:
        cluster = Cluster(stack, heads, p_tp, d_tp)
        cluster.run("t", src, dst, tokens, start)
        cluster.assert_landed(src, dst, tokens, start)
        assert_no_state(*cluster.p, *cluster.d)


def test_a_failure_on_one_rank_fails_the_transfer_on_every_rank() -> None:
    """P TP 2 -> D TP 1: rank 1 aborts its part; D fails the whole load and no P rank holds the transfer."""
    with ExitStack() as stack:
        cluster = Cluster(stack, 2, 2, 1)
        (d,) = cluster.d
        d.expect("f", cluster.addr, [1, 2], 8)
        for p in cluster.p:
            p.offer("f", [3, 4])
        cluster.p[0].push_layer("f", 0)
        cluster.p[1].abort("f", "rank 1 lost its request")
        r = wait_results(d, {"f"})["f"]
        assert r.state is TransferState.ABORTED and "rank 1 lost" in r.reason
        assert wait_results(cluster.p[1], {"f"})["f"].state is TransferState.ABORTED
        assert wait_results(cluster.p[0], {"f"})["f"].state is TransferState.ABORTED, "rank 0 stopped as well"
        assert_no_state(*cluster.p, d)


def test_token_major_caches_of_different_tp_move_a_run_per_token() -> None:
    """Different TP sizes with token-major blocks: a head slice of a token is contiguous, a token's heads
    of one P rank are not next to the other rank's in D, so each token is a run of its own (mapped, not
    refused; exact bytes for every layout pair are proven in test_kv_tensors)."""
    p = msgspec.structs.replace(model_layout(2, 2, 1), token_major=True)
    d = msgspec.structs.replace(model_layout(2), token_major=True)
    check_compatible(p, d)
    (plan,) = [sl for sl in head_plan(2, d) if sl.prefill_rank == 1]
    runs = BlockMapping(p, d).runs([0], [0], 0, 4, plan)
    # P rank 1's block: 4 tokens x (1 head x K|V) = 8 vectors; D's: 4 tokens x 2 heads x K|V, head 1 second.
    assert runs == [(2 * t, 4 * t + 2, 2) for t in range(4)]
    with pytest.raises(LayoutMismatch, match="model_kv_heads: prefill 2 vs decode 4"):
        check_compatible(p, model_layout(4))


@pytest.mark.parametrize("decode_tp", [1, 2, 4])
def test_a_rank_read_off_vllm_tensors_plans_for_every_decode_tp(decode_tp: int) -> None:
    """P TP 2 of a 2-head model, each rank's cache read off vLLM's real ``[blocks, heads, tokens, K|V]`` view
    (explicit strides, one head): still heads-major (its blocks move whole, as at TP 1), and D ranks of any TP
    size plan against it. D's layout derived from it once kept the one-head strides for two heads, and every
    P TP 2 -> D TP 1 load failed with "blocks of 128 vectors overlap"."""
    import torch

    from pd_connector.kv_tensors import describe

    for rank in range(2):
        views = [torch.zeros((8, 1, 32, 2, 64)) for _ in range(4)]
        layout = describe(views, "bhtkd", tp_size=2, tp_rank=rank, total_kv_heads=2).layout
        assert not layout.token_major and layout.granule_tokens == 32
        assert fanout(layout, decode_tp) >= 1
        assert fanout(layout.at_rank(1 - rank), decode_tp) >= 1
