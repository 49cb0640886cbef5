"""Caches in kernel blocks smaller than the KV manager's blocks (vLLM splits manager block ``b`` of an unpacked
cache into kernel blocks ``b * r + j``), mapped onto each other and onto plain caches by ``kernel_block_ids``
plus the ordinary ``BlockMapping``: random attention layouts, kernel and manager block sizes, manager block
tables and token ranges; every vector lands where D's attention kernel reads it, and nothing else is written.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_connector.block_mapping import BlockMapping, kernel_block_ids
from pd_connector.kv_tensors import describe
from tests.pd_connector.test_kv_tensors import KINDS, _apply, _index, pairs

pytestmark = pytest.mark.unit

MANAGER_BLOCKS = 10


def where(table: list[int], per_block: int, kernel_tokens: int, token: int) -> tuple[int, int]:
    """``(kernel block, token in it)`` of a request's ``token``, read the way vLLM's kernels read it: manager
    block ``table[token // M]``, then kernel block ``j = (token % M) // kernel_tokens`` of it."""
    manager = per_block * kernel_tokens
    offset = token % manager
    return table[token // manager] * per_block + offset // kernel_tokens, offset % kernel_tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=pairs(), data=st.data())
def test_kernel_block_caches_map_token_for_token(kinds: tuple[str, str], data: st.DataObject) -> None:
    (p_kind, d_kind), layers = kinds, 2
    heads = 1 if p_kind == "mla" else data.draw(st.sampled_from([1, 2]), "heads")
    p_r, d_r = (
        data.draw(st.sampled_from([1, 2, 4]), "p_per_block"),
        data.draw(st.sampled_from([1, 2, 4]), "d_r"),
    )
    p_k, d_k = (
        data.draw(st.sampled_from([1, 2, 4]), "p_kernel"),
        data.draw(st.sampled_from([1, 2, 4]), "d_kernel"),
    )
    p_m, d_m = p_r * p_k, d_r * d_k  # manager block sizes
    num_tokens = data.draw(st.integers(1, 4 * min(p_m, d_m)), "num_tokens")
    start = data.draw(st.integers(0, num_tokens - 1), "start")
    p_axes, d_axes = KINDS[p_kind][0], KINDS[d_kind][0]
    p_t = KINDS[p_kind][1](layers, MANAGER_BLOCKS * p_r, p_k, heads)
    d_t = KINDS[d_kind][1](layers, MANAGER_BLOCKS * d_r, d_k, heads)
    for t in p_t:
        t.copy_(torch.randn(t.shape))
    p, d = describe(p_t, p_axes), describe(d_t, d_axes)
    src = data.draw(st.permutations(range(MANAGER_BLOCKS)), "src")[: -(-num_tokens // p_m)]
    dst = data.draw(st.permutations(range(MANAGER_BLOCKS)), "dst")[: -(-num_tokens // d_m)]
    mapping = BlockMapping(p.layout, d.layout)
    runs = mapping.runs(kernel_block_ids(src, p_r), kernel_block_ids(dst, d_r), start, num_tokens)
    for layer in range(layers):
        _apply(p, d, mapping.layer_copies(layer, runs))
    kvs = (0,) if p_kind == "mla" else (0, 1)
    for layer in range(layers):
        for tok in range(start, num_tokens):
            pb, pt = where(src, p_r, p_k, tok)
            db, dt = where(dst, d_r, d_k, tok)
            for h in range(heads):
                for kv in kvs:
                    want = p_t[layer][_index(p_axes, pb, pt, h, kv)]
                    assert torch.equal(want, d_t[layer][_index(d_axes, db, dt, h, kv)]), (layer, tok, h, kv)
        for block in set(range(MANAGER_BLOCKS * d_r)) - set(kernel_block_ids(dst, d_r)):
            assert not d_t[layer][_index(d_axes, block, 0, 0, 0)].any(), f"kernel block {block} was written"


def test_kernel_block_ids_split_each_manager_block_in_order() -> None:
    assert kernel_block_ids([3, 0, 7], 1) == [3, 0, 7]
    assert kernel_block_ids([3, 0], 4) == [12, 13, 14, 15, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="positive"):
        kernel_block_ids([1], 0)
