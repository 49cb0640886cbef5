"""The TP-pairs part of the transport benchmark plans what the connector would: every D rank gets each of its
heads once, from one P rank, for the whole prompt; operations stay within contiguous runs (never per token)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import tp_pairs
from benchmarks.kv_shapes import KV_DST, KV_SRC, POOL_BLOCKS


@pytest.mark.parametrize(("p_tp", "d_tp"), tp_pairs.PAIRS)
def test_each_d_head_of_each_prompt_block_is_written_once(p_tp: int, d_tp: int) -> None:
    granule = tp_pairs.rank_layout(1, 0).granule_bytes  # one head vector: the same on every rank
    moved = 0
    for d in range(d_tp):
        decode = tp_pairs.rank_layout(d_tp, d)
        per_block = decode.num_kv_heads * decode.block_tokens  # vectors of one block in one buffer
        written = np.zeros((2 * tp_pairs.LAYERS, POOL_BLOCKS * per_block), np.int64)
        for (_, dst_rank), layers in tp_pairs.plan_copies(p_tp, d_tp).items():
            if dst_rank != d:
                continue
            for layer in layers:
                for copy in layer:
                    written[copy.region_id, copy.dst_block : copy.dst_block + copy.num_blocks] += 1
                    moved += copy.num_blocks * granule
        expected = np.zeros(POOL_BLOCKS * per_block, np.int64)
        for block in KV_DST:
            expected[block * per_block : (block + 1) * per_block] = 1
        assert (written == expected).all()
    assert moved == tp_pairs.prompt_bytes()


@pytest.mark.parametrize(("p_tp", "d_tp"), tp_pairs.PAIRS)
def test_operations_are_bounded_by_contiguous_runs(p_tp: int, d_tp: int) -> None:
    ops = tp_pairs.operations(p_tp, d_tp)
    assert ops.ops_per_layer <= ops.ops_bound
    assert ops.ops_bound <= 2 * len(KV_SRC) * ops.parts < ops.per_token_head_ops
    if p_tp == d_tp:  # whole blocks: consecutive blocks coalesce
        assert ops.ops_per_layer == 2 * tp_pairs.block_runs() * p_tp < 2 * len(KV_SRC) * p_tp


def test_ratios_compare_with_same_tp_and_flag_a_broken_bound() -> None:
    def result(gbps: float, ops: int) -> tp_pairs.PairResult:
        return tp_pairs.PairResult(
            ops_per_layer=ops, ops_bound=100, per_token_head_ops=1000, parts=1, gbps=gbps
        )

    assert tp_pairs.ratios({"1->1": result(4.0, 10), "2->1": result(2.0, 100)}) == {
        "tp_2->1_vs_1->1": 0.5,
        "tp_ops_within_bound": True,
    }
    assert tp_pairs.ratios({"2->1": result(2.0, 101)}) == {"tp_ops_within_bound": False}


def test_pairs_parse() -> None:
    assert tp_pairs.parse_pairs("2,1;1,2") == [(2, 1), (1, 2)]
    assert tp_pairs.parse_pairs("") == []
