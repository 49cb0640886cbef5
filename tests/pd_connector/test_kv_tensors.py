"""KV layouts read off real (CPU) tensors of every attention layout, and the P->D copy mapping between them.

The copies are applied to the tensors' bytes exactly as a transport would (granule runs between the
registered buffers), and the result is checked through torch's own logical indexing, which knows nothing of
strides or granules: a wrong stride, run or block lands a wrong value and fails.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_connector.block_mapping import BlockMapping
from pd_connector.kv_tensors import KVTensors, describe
from pd_connector.layout import HeadSlice, LayoutMismatch, check_compatible, head_plan
from pd_connector.transport.base import BlockCopy
from pd_connector.transport.regions import host_view

pytestmark = pytest.mark.unit

HEAD_DIM = 4


def _alloc(physical: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """Allocate ``physical`` (memory order) and view it in logical order (``order[i]``: the physical axis of
    logical axis i), as vLLM does for stride-ordered caches."""
    return torch.zeros(physical, dtype=torch.float32).permute(*order)


# Each kind: (axes, builder(layers, blocks, tokens, heads) -> per-layer tensors in the axes' logical order).
Builder = Callable[[int, int, int, int], list[torch.Tensor]]
D = HEAD_DIM
KINDS: dict[str, tuple[str, Builder]] = {
    # vLLM CPU / 0.32 LBHNC: [blocks, heads, tokens, K|V] (C unflattened into K/V and the head dim)
    "vllm_hnd": ("bhtkd", lambda L, B, N, H: [_alloc((B, H, N, 2, D), (0, 1, 2, 3, 4)) for _ in range(L)]),
    # vLLM 0.32 LBNHC: the same logical view, tokens before heads in memory
    "vllm_nhd": ("bhtkd", lambda L, B, N, H: [_alloc((B, N, H, 2, D), (0, 2, 1, 3, 4)) for _ in range(L)]),
    # vLLM 0.32 BLHNC: blocks outermost, every layer's page inside each block (strided blocks)
    "vllm_blhnc": (
        "bhtkd",
        lambda L, B, N, H: list(torch.zeros((B, L, H, N, 2, D)).unbind(1)),
    ),
    # FlashAttention / Triton NHD [2, blocks, tokens, heads, dim] and its HND permutation
    "fa_nhd": ("kbthd", lambda L, B, N, H: [_alloc((2, B, N, H, D), (0, 1, 2, 3, 4)) for _ in range(L)]),
    "fa_hnd": ("kbthd", lambda L, B, N, H: [_alloc((2, B, H, N, D), (0, 1, 3, 2, 4)) for _ in range(L)]),
    # FlashInfer NHD [blocks, 2, tokens, heads, dim] and HND
    "fi_nhd": ("bkthd", lambda L, B, N, H: [_alloc((B, 2, N, H, D), (0, 1, 2, 3, 4)) for _ in range(L)]),
    "fi_hnd": ("bkthd", lambda L, B, N, H: [_alloc((B, 2, H, N, D), (0, 1, 3, 2, 4)) for _ in range(L)]),
    # MLA's latent [blocks, tokens, latent]: no K/V, no heads
    "mla": ("btd", lambda L, B, N, H: [torch.zeros((B, N, D)) for _ in range(L)]),
}
SPLIT = ("fa_nhd", "fa_hnd")
PACKED = ("vllm_hnd", "vllm_nhd", "vllm_blhnc", "fi_nhd", "fi_hnd")


def _index(axes: str, block: int, token: int, head: int, kv: int) -> tuple[int, ...]:
    """The logical index of one vector (all of ``d``) in a tensor with these axes."""
    at = {"b": block, "t": token, "h": head, "k": kv}
    return tuple(at[a] for a in axes if a != "d")


def _apply(p: KVTensors, d: KVTensors, copies: list[BlockCopy]) -> int:
    """Move the copies' granules from P's buffers into D's, as a transport does; returns bytes moved."""
    g = p.layout.granule_bytes
    assert g == d.layout.granule_bytes
    moved = 0
    for region, src, dst, n in copies:
        s_addr, s_len = p.buffers[region]
        d_addr, d_len = d.buffers[region]
        assert (src + n) * g <= s_len and (dst + n) * g <= d_len, "copy outside a registered buffer"
        s_view = np.frombuffer(host_view(s_addr, s_len), np.uint8)
        d_view = np.frombuffer(host_view(d_addr, d_len), np.uint8)
        d_view[dst * g : (dst + n) * g] = s_view[src * g : (src + n) * g]
        moved += n * g
    return moved


@st.composite
def pairs(draw: st.DrawFn) -> tuple[str, str]:
    family = draw(st.sampled_from([SPLIT, PACKED, ("mla",)]))
    return draw(st.sampled_from(family)), draw(st.sampled_from(family))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=pairs(), data=st.data())
def test_bytes_land_exactly_between_any_two_layouts(kinds: tuple[str, str], data: st.DataObject) -> None:
    """Random layout pair, block sizes, block tables and token range: every vector lands where D reads it."""
    (p_kind, d_kind), layers = kinds, 2
    heads = 1 if p_kind == "mla" else data.draw(st.sampled_from([1, 2, 3]), "heads")
    ps, ds = (
        data.draw(st.sampled_from([1, 2, 4, 8]), "p_bt"),
        data.draw(st.sampled_from([1, 2, 4, 8]), "d_bt"),
    )
    num_tokens = data.draw(st.integers(1, 30), "num_tokens")
    start = data.draw(st.integers(0, num_tokens - 1), "start")
    p_axes, d_axes = KINDS[p_kind][0], KINDS[d_kind][0]
    p_t, d_t = KINDS[p_kind][1](layers, 40, ps, heads), KINDS[d_kind][1](layers, 40, ds, heads)
    for t in p_t:
        t.copy_(torch.randn(t.shape))
    p, d = describe(p_t, p_axes), describe(d_t, d_axes)
    check_compatible(p.layout, d.layout)
    src = data.draw(st.permutations(range(40)), "src")[: -(-num_tokens // ps)]
    dst = data.draw(st.permutations(range(40)), "dst")[: -(-num_tokens // ds)]
    mapping = BlockMapping(p.layout, d.layout)
    runs = mapping.runs(src, dst, start, num_tokens)
    moved = sum(_apply(p, d, mapping.layer_copies(layer, runs)) for layer in range(layers))
    kvs = (0,) if p_kind == "mla" else (0, 1)
    g = p.layout.granule_tokens
    widened = range((start // g) * g, min(-(-num_tokens // g) * g, len(src) * ps, len(dst) * ds))
    assert moved == layers * len(widened) * heads * len(kvs) * p.layout.granule_bytes
    for layer in range(layers):
        for tok in range(start, num_tokens):
            for h in range(heads):
                for kv in kvs:
                    want = p_t[layer][_index(p_axes, src[tok // ps], tok % ps, h, kv)]
                    got = d_t[layer][_index(d_axes, dst[tok // ds], tok % ds, h, kv)]
                    assert torch.equal(want, got), (layer, tok, h, kv)
    # Nothing outside the range's blocks was touched on D.
    untouched = sorted(set(range(40)) - set(dst))
    for layer in range(layers):
        assert not d_t[layer][_index(d_axes, untouched[0], 0, 0, 0)].any()


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), data=st.data())
def test_whole_blocks_of_alike_layouts_take_block_arithmetic_with_the_same_runs(
    kind: str, data: st.DataObject
) -> None:
    """P and D laid out alike, whole blocks: ``runs`` maps block by block (O(blocks), the common case of one
    model on both sides) where a block is one dense run of vectors, and gives exactly the runs of placing
    every vector; interleaved layers (blocks not dense) take the vector path."""
    heads = 1 if kind == "mla" else data.draw(st.sampled_from([1, 2, 3]), "heads")
    bt = data.draw(st.sampled_from([1, 2, 4, 8]), "bt")
    layout = describe(KINDS[kind][1](2, 40, bt, heads), KINDS[kind][0]).layout
    blocks = data.draw(st.integers(1, 20), "blocks")
    first = data.draw(st.integers(0, blocks - 1), "first")
    src = data.draw(st.permutations(range(40)), "src")[:blocks]
    dst = data.draw(st.permutations(range(40)), "dst")[:blocks]
    mapping = BlockMapping(layout, layout)
    every_head = HeadSlice(0, 0, 0, layout.num_kv_heads)
    start, end = first * bt, blocks * bt
    assert mapping.runs(src, dst, start, end) == mapping.vector_runs(src, dst, start, end, every_head)
    assert bool(mapping._whole_block_vectors(every_head, start, end)) == (kind != "vllm_blhnc")


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tensor_parallel_head_slices_land_exactly(data: st.DataObject) -> None:
    """P and D of different TP sizes and layouts: each D rank assembles its heads from the P ranks."""
    total = 4
    p_tp, d_tp = data.draw(st.sampled_from([1, 2, 4]), "p_tp"), data.draw(st.sampled_from([1, 2, 4]), "d_tp")
    p_kind, d_kind = (
        data.draw(st.sampled_from(PACKED), "p_kind"),
        data.draw(st.sampled_from(PACKED), "d_kind"),
    )
    bt = data.draw(st.sampled_from([2, 4]), "bt")
    num_tokens = data.draw(st.integers(1, 12), "num_tokens")
    blocks = -(-num_tokens // bt)
    axes = KINDS[p_kind][0]
    model = torch.randn(8, bt, total, 2, D)  # [blocks, tokens, heads, kv, dim] of the whole model
    p_ranks = []
    for r in range(p_tp):
        t = KINDS[p_kind][1](1, 8, bt, total // p_tp)
        share = model[:, :, r * (total // p_tp) : (r + 1) * (total // p_tp)]
        for b in range(8):
            for tok in range(bt):
                for h in range(total // p_tp):
                    for kv in range(2):
                        t[0][_index(axes, b, tok, h, kv)] = share[b, tok, h, kv]
        p_ranks.append((t, describe(t, axes, p_tp, r, total)))
    src = list(range(blocks))
    for r in range(d_tp):
        d_t = KINDS[d_kind][1](1, 8, bt, total // d_tp)
        d = describe(d_t, KINDS[d_kind][0], d_tp, r, total)
        dst = list(range(8 - blocks, 8))
        for sl in head_plan(p_tp, d.layout):
            _, p = p_ranks[sl.prefill_rank]
            check_compatible(p.layout, d.layout)
            mapping = BlockMapping(p.layout, d.layout)
            _apply(p, d, mapping.copies(0, src, dst, 0, num_tokens, sl))
        mine = range(r * (total // d_tp), (r + 1) * (total // d_tp))
        for tok in range(num_tokens):
            for local, head in enumerate(mine):
                for kv in range(2):
                    got = d_t[0][_index(KINDS[d_kind][0], dst[tok // bt], tok % bt, local, kv)]
                    assert torch.equal(got, model[tok // bt, tok % bt, head, kv])


def test_layouts_read_off_the_tensors() -> None:
    """What each attention layout is described as: split or packed, in-block order, strides, buffers."""
    fa = describe(KINDS["fa_hnd"][1](2, 5, 16, 2), "kbthd")
    assert fa.layout.kv_split and not fa.layout.token_major and fa.memory == "host"
    assert fa.layout.vector_strides == (32, 1, 16, 0) and len(fa.buffers) == 4
    assert fa.buffers[1][0] - fa.buffers[0][0] == 5 * 32 * D * 4  # V after all of K's blocks
    cpu = describe(KINDS["vllm_hnd"][1](1, 5, 16, 2), "bhtkd")
    assert not cpu.layout.kv_split and not cpu.layout.token_major
    assert cpu.layout.vector_strides == cpu.layout.at_rank(0).vector_strides  # the flags' default, explicit
    interleaved = describe(KINDS["vllm_blhnc"][1](3, 5, 16, 2), "bhtkd")
    assert interleaved.layout.vector_strides[0] == 3 * 64  # a block's stride spans every layer's page
    assert interleaved.buffers[0][1] == (4 * 3 * 64 + 64) * D * 4
    mla = describe(KINDS["mla"][1](2, 5, 16, 1), "btd", tp_size=4, tp_rank=3, total_kv_heads=1)
    assert mla.layout.mla and mla.layout.num_kv_heads == 1 and head_plan(4, mla.layout)[0].prefill_rank == 0


def test_what_cannot_be_described_or_mapped_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        describe([torch.zeros(4, 16, 8).transpose(1, 2)], "btd")
    with pytest.raises(ValueError, match="equal layers"):
        describe([torch.zeros(4, 16, 8), torch.zeros(4, 8, 8)], "btd")
    with pytest.raises(ValueError, match="need b, t and d"):
        describe([torch.zeros(4, 16, 2, 8)], "btkd")
    fa = describe(KINDS["fa_nhd"][1](1, 5, 16, 2), "kbthd").layout
    fi = describe(KINDS["fi_nhd"][1](1, 5, 16, 2), "bkthd").layout
    mla = describe(KINDS["mla"][1](1, 5, 16, 1), "btd").layout
    with pytest.raises(
        LayoutMismatch, match=r"kv_split: prefill True vs decode False \(K and V in one buffer"
    ):
        check_compatible(fa, fi)
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(mla, fi)
    assert {"mla", "model_kv_heads"} <= set(err.value.fields)
