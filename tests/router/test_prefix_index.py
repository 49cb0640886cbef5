"""The prefix index: chained block hashes, longest cached prefix per worker, LRU bound, memory gauge."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.prefix_index import PrefixIndex, block_hashes


def test_only_full_blocks_are_hashed_and_each_names_its_whole_prefix() -> None:
    assert block_hashes(list(range(7)), 4) == block_hashes(list(range(4)), 4)
    assert len(block_hashes(list(range(8)), 4)) == 2
    assert block_hashes(list(range(3)), 4) == []
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different first: a different prefix
    assert block_hashes([1, 2, 3, 4], 4, root=1) != block_hashes([1, 2, 3, 4], 4, root=2)


@given(st.lists(st.integers(0, 50_000), max_size=80), st.lists(st.integers(0, 50_000), max_size=80))
def test_shared_hashes_are_exactly_the_shared_full_blocks(a: list[int], b: list[int]) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ha, hb = block_hashes(a, 4), block_hashes(b, 4)
    shared = 0
    while shared < min(len(ha), len(hb)) and ha[shared] == hb[shared]:
        shared += 1
    assert shared == common // 4


def test_match_is_the_longest_recorded_prefix_per_worker() -> None:
    index = PrefixIndex(block_size=4, max_blocks=100, rng=random.Random(0))
    turn1 = index.hashes(list(range(10)))  # 2 full blocks
    turn2 = index.hashes(list(range(10)) + [99] * 10)  # 5 blocks, the first 2 shared
    index.record("d0", turn1)
    assert index.match("d0", turn2) == 2
    assert index.match("d1", turn2) == 0
    index.record("d0", turn2)
    assert index.match("d0", turn2) == 5
    other = index.hashes([7] * 20)
    assert index.match("d0", other) == 0
    index.forget("d0")
    assert index.match("d0", turn2) == 0 and index.blocks() == 0


def test_lru_bound_evicts_tails_first_and_keeps_prefixes_closed() -> None:
    index = PrefixIndex(block_size=2, max_blocks=6, rng=random.Random(0))
    old = index.hashes(list(range(8)))  # 4 blocks
    new = index.hashes([50 + i for i in range(8)])  # 4 other blocks
    index.record("d", old)
    index.record("d", new)
    assert index.blocks() == 6
    # the old conversation lost its tail, not its head: its first two blocks still match
    assert index.match("d", old) == 2
    assert index.match("d", new) == 4
    index.record("d", old[:1])  # touching a prefix keeps it over another conversation's tail
    index.record("d", index.hashes([90, 91]))
    assert index.match("d", old) >= 1 and index.blocks() == 6


def test_memory_estimate_tracks_what_python_allocates() -> None:
    rng = random.Random(1)
    tracemalloc.start()
    try:
        index = PrefixIndex(block_size=16, max_blocks=1_000_000, rng=rng)
        before = tracemalloc.get_traced_memory()[0]
        for conv in range(500):
            index.record(conv % 2, index.hashes([rng.randrange(50_000) for _ in range(16 * 40)]))
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.blocks() == 20_000
    assert 0.75 * allocated <= index.memory_bytes() <= 1.25 * allocated


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(block_size=0, max_blocks=1)
    with pytest.raises(ValueError):
        PrefixIndex(block_size=16, max_blocks=0)
