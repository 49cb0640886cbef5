"""KV layout descriptor: hashing, compatibility checks with clear messages, granule copy mapping."""

from __future__ import annotations

import msgspec
import pytest

from pd_connector.block_mapping import BlockMapping
from pd_connector.layout import KVLayout, LayoutMismatch, check_compatible
from pd_connector.transport.base import BlockCopy

VLLM_CPU = KVLayout(
    num_layers=4,
    block_tokens=32,
    num_kv_heads=2,
    head_dim=64,
    dtype="bfloat16",
    kv_split=False,
    token_major=False,
)
SGL = KVLayout(
    num_layers=4,
    block_tokens=1,
    num_kv_heads=2,
    head_dim=64,
    dtype="bfloat16",
    kv_split=True,
    token_major=True,
)


def test_sizes_and_hash() -> None:
    assert VLLM_CPU.token_bytes == 2 * 64 * 2 * 2
    assert VLLM_CPU.block_bytes == 32 * 512
    assert VLLM_CPU.granule_tokens == 32  # heads-major: pushed ranges widen to whole blocks
    assert VLLM_CPU.granule_bytes == 64 * 2  # one head vector
    assert VLLM_CPU.vector_strides == (2 * 32 * 2, 2, 32 * 2, 1)  # [heads, tokens, K|V]
    assert SGL.token_bytes == 2 * 64 * 2 and SGL.buffers_per_layer == 2 and SGL.granule_tokens == 1
    same = msgspec.msgpack.decode(msgspec.msgpack.encode(VLLM_CPU), type=KVLayout)
    assert same.compat_hash() == VLLM_CPU.compat_hash()
    assert msgspec.structs.replace(VLLM_CPU, head_dim=128).compat_hash() != VLLM_CPU.compat_hash()


def test_invalid_layouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        msgspec.structs.replace(VLLM_CPU, dtype="float64")
    with pytest.raises(ValueError, match="block_tokens"):
        msgspec.structs.replace(VLLM_CPU, block_tokens=0)
    with pytest.raises(ValueError, match="whole number"):
        VLLM_CPU.regions([(4096, 100)] * 4)
    with pytest.raises(ValueError, match="overlap"):
        msgspec.structs.replace(VLLM_CPU, strides=(128, 2, 2, 1))
    with pytest.raises(ValueError, match="contradict token_major"):
        msgspec.structs.replace(VLLM_CPU, strides=(128, 4, 2, 1))
    with pytest.raises(ValueError, match="4 layers x 1 buffers = 4, got 3"):
        VLLM_CPU.regions([(4096, VLLM_CPU.block_bytes)] * 3)


def test_regions_are_addressed_in_granules() -> None:
    tm = msgspec.structs.replace(VLLM_CPU, token_major=True)
    regions = tm.regions([(1000 + i, 10 * tm.block_bytes) for i in range(4)])
    assert [r.region_id for r in regions] == [0, 1, 2, 3]
    assert regions[0].block_bytes == tm.granule_bytes and regions[0].num_blocks == 320 * 2 * 2


def test_mismatch_names_every_differing_field() -> None:
    other = msgspec.structs.replace(VLLM_CPU, dtype="float16", head_dim=128, num_layers=8)
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(VLLM_CPU, other)
    msg = str(err.value)
    assert set(err.value.fields) == {"dtype", "head_dim", "num_layers"}
    assert "dtype: prefill 'bfloat16' vs decode 'float16'" in msg
    assert "head_dim: prefill 64 vs decode 128" in msg and "num_layers: prefill 4 vs decode 8" in msg


def test_packed_versus_split_is_refused() -> None:
    with pytest.raises(LayoutMismatch, match="kv_split: prefill False vs decode True"):
        check_compatible(VLLM_CPU, msgspec.structs.replace(VLLM_CPU, kv_split=True))


def test_heads_major_block_sizes_and_orders_are_mapped() -> None:
    """What a vector is must match; block sizes and in-block orders are mapped (tests/.../test_kv_tensors)."""
    check_compatible(VLLM_CPU, msgspec.structs.replace(VLLM_CPU, block_tokens=16))
    check_compatible(VLLM_CPU, msgspec.structs.replace(VLLM_CPU, token_major=True))
    # P [heads, tokens, K|V] blocks of 2 tokens -> D token-major blocks of 4: a run per (token, head).
    p = msgspec.structs.replace(VLLM_CPU, block_tokens=2, num_kv_heads=1)
    d = msgspec.structs.replace(p, block_tokens=4, token_major=True)
    assert BlockMapping(p, d).runs([3], [1], 0, 2) == [(12, 8, 4)]  # 1 head: both orders agree


def test_token_major_block_sizes_are_mapped() -> None:
    p = msgspec.structs.replace(SGL, block_tokens=16)
    d = msgspec.structs.replace(SGL, block_tokens=32)
    check_compatible(p, d)
    check_compatible(d, p)
    # P blocks [7, 3] (tokens 0-15, 16-31) land in the two halves of D block 5 (runs in source order),
    # in vectors: 2 heads per token.
    copies = BlockMapping(p, d).copies(
        layer=1, src_blocks=[7, 3], dst_blocks=[5], start_token=0, end_token=32
    )
    assert copies == [
        BlockCopy(2, 3 * 32, 5 * 64 + 32, 32),
        BlockCopy(2, 7 * 32, 5 * 64, 32),
        BlockCopy(3, 3 * 32, 5 * 64 + 32, 32),
        BlockCopy(3, 7 * 32, 5 * 64, 32),
    ]


def test_heads_major_range_widens_to_whole_blocks() -> None:
    m = BlockMapping(VLLM_CPU, VLLM_CPU)
    # A block is 2 heads x 32 tokens x K|V = 128 vectors: block 4 is vectors 512-639, whole.
    assert m.copies(0, [9, 4], [1, 2], start_token=40, end_token=50) == [BlockCopy(0, 512, 256, 128)]
    with pytest.raises(ValueError, match="exceed the block tables"):
        m.copies(0, [9], [1, 2], start_token=0, end_token=40)


def test_runs_coalesce_when_both_sides_continue() -> None:
    m = BlockMapping(SGL, SGL)  # 1-token blocks: every token is its own block
    assert m.runs([4, 5, 6, 9], [10, 11, 12, 13], 0, 4) == [(8, 20, 6), (18, 26, 2)]  # 2 heads a token
    with pytest.raises(ValueError, match="written twice"):  # D's table names block 5 twice
        m.runs([1, 2], [5, 5], 0, 2)
    assert m.layer_copies(2, [(4, 10, 3)]) == [BlockCopy(4, 4, 10, 3), BlockCopy(5, 4, 10, 3)]
