"""The staging pool on its own (no engine, no transport): the block -> slot remap and its allocation
(``SlotTable``), the pool's sizing, and the copies in and out of slots on caches with padded blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.kv_tensors import describe
from pd_connector.layout import KVLayout
from pd_connector.staging import (
    MIB,
    PoolTooSmall,
    SlotTable,
    StagingPool,
    byte_views,
    pool_slots,
    slot_bytes,
    slot_layout,
)

pytestmark = pytest.mark.unit

OWNERS = ["a", "b", "c"]


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 12),
    ops=st.lists(
        st.tuples(
            st.sampled_from(OWNERS), st.booleans(), st.lists(st.integers(0, 20), unique=True, max_size=10)
        ),
        max_size=30,
    ),
)
def test_slot_table_never_lends_a_slot_twice_and_gets_every_slot_back(
    capacity: int, ops: list[tuple[str, bool, list[int]]]
) -> None:
    """Random reserves (growing tables) and releases: an owner's slots are distinct from every other owner's,
    a block keeps its slot while its owner holds it, a reserve takes all it asks or nothing (None exactly when
    too few are free, PoolTooSmall exactly when the owner would hold more than the pool), and once every owner
    released, every slot is free again."""
    table = SlotTable(capacity)
    model: dict[str, dict[int, int]] = {}
    for owner, release, blocks in ops:
        if release:
            assert table.release(owner) == len(model.pop(owner, {}))
            continue
        mine = model.get(owner, {})
        new = [b for b in blocks if b not in mine]
        if len(mine) + len(new) > capacity:
            with pytest.raises(PoolTooSmall, match=f"pool has {capacity}"):
                table.reserve(owner, blocks)
        elif len(new) > capacity - sum(len(m) for m in model.values()):
            assert table.reserve(owner, blocks) is None
        else:
            slots = table.reserve(owner, blocks)
            assert slots is not None and len(slots) == len(blocks)
            assert all(mine[b] == s for b, s in zip(blocks, slots, strict=True) if b in mine), "slots kept"
            model[owner] = {**mine, **dict(zip(blocks, slots, strict=True))}
        for name in OWNERS:
            assert table.slots(name) == model.get(name, {})
        held = [s for m in model.values() for s in m.values()]
        assert len(held) == len(set(held)) and all(0 <= s < capacity for s in held)
        assert table.free == capacity - len(held)
    for owner in table.owners():
        table.release(owner)
    assert table.free == capacity and table.owners() == []


def test_slot_table_refuses_a_table_naming_a_block_twice() -> None:
    table = SlotTable(4)
    with pytest.raises(ValueError, match="names a block twice"):
        table.reserve("a", [1, 2, 1])
    assert table.free == 4
    with pytest.raises(ValueError, match="at least one slot"):
        SlotTable(0)


def layout(**kw: object) -> KVLayout:
    base: dict[str, object] = dict(
        num_layers=2,
        block_tokens=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        kv_split=False,
        token_major=False,
    )
    return KVLayout(**{**base, **kw})  # type: ignore[arg-type]


def test_pool_size_is_bounded_by_the_setting_and_by_the_cache() -> None:
    lay = layout()  # a slot: 2 layers x 4 tokens x 2 heads x K|V x 8 floats = 1 KiB
    assert slot_bytes(lay) == 1024
    assert pool_slots(lay, num_blocks=100_000, pool_mib=1) == MIB // 1024
    assert pool_slots(lay, num_blocks=10, pool_mib=1) == 10, "never more slots than cache blocks"
    assert pool_slots(lay, num_blocks=10, pool_mib=0) == 10, "0: the whole cache"
    huge = layout(num_layers=600, head_dim=256, block_tokens=16)
    with pytest.raises(ValueError, match=r"kv_staging_pool_mib = 1 MiB holds no staging slot: .* 37\.50 MiB"):
        pool_slots(huge, num_blocks=10, pool_mib=1)


def test_padded_cache_blocks_are_packed_in_the_slots_and_copied_back_exactly() -> None:
    """A cache whose blocks are padded (every other block-sized page unused, as interleaved caches are): the
    slots drop the padding (their layout says so), and device -> slot -> device moves exactly each block."""
    gen = torch.Generator().manual_seed(3)
    backing = [torch.rand((16, 2, 2, 4, 2, 8), generator=gen) for _ in range(2)]  # [pages, pad|data, ...]
    tensors = [b[:, 1] for b in backing]  # [blocks, heads, tokens, K|V, dim], block stride = 2 blocks
    kv = describe(tensors, "bhtkd")
    assert kv.layout.vector_strides[0] == 2 * kv.layout.block_extent
    pool = StagingPool(kv.layout, byte_views(tensors, kv.buffers), num_slots=5)
    assert pool.layout.vector_strides[0] == kv.layout.block_extent
    assert pool.layout.vector_strides[1:] == kv.layout.vector_strides[1:]
    assert all(n == 5 * pool.layout.block_bytes for _, n in pool.host_buffers())
    blocks, back = [7, 2, 3, 11], [0, 1, 5, 6]
    assert pool.reserve("p", blocks) is not None
    for layer in range(2):
        pool.to_slots("p", layer, blocks)
    moved = pool.table.slots("p")
    assert pool.release("p") == 4
    expected = [t.clone() for t in backing]
    for t, b in zip(expected, backing, strict=True):
        t[back, 1] = b[blocks, 1]
    pool.table.reserve("d", back)
    assert pool.table.slots("d") == {d: moved[s] for s, d in zip(blocks, back, strict=True)}, "same slots"
    pool.from_slots("d", back)
    for t, b in zip(expected, backing, strict=True):
        assert torch.equal(t, b), "each block landed whole, padding and other blocks untouched"
    with pytest.raises(ValueError, match="holds no staging slot for blocks"):
        pool.to_slots("d", 0, [9])


def test_slot_layout_keeps_a_dense_cache_as_it_is() -> None:
    assert slot_layout(layout()) == layout()
