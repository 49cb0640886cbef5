"""Coalescing of block copies into runs (pure planning, no transport)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.transport import regions
from pd_connector.transport.base import BlockCopy
from pd_connector.transport.coalesce import SMALL_COPIES, coalesce_runs, coalesce_small, coalesce_vectorised
from pd_connector.transport.regions import RegionIndex, RegionInfo, Spans, plan


def coalesce(copies: list[BlockCopy]) -> list[BlockCopy]:
    """``coalesce_runs``' table as ``BlockCopy`` rows, to compare with the input's type."""
    return [BlockCopy(*(int(x) for x in row)) for row in coalesce_runs(copies)]


def test_contiguous_blocks_become_one_run() -> None:
    copies = [BlockCopy(0, s, 100 + s) for s in range(256)]
    assert coalesce(copies) == [BlockCopy(0, 0, 100, 256)]


def test_runs_break_where_either_side_jumps_and_per_region() -> None:
    copies = [
        BlockCopy(1, 5, 9),
        BlockCopy(0, 0, 0),
        BlockCopy(0, 1, 1),
        BlockCopy(0, 2, 7),  # destination jumps
        BlockCopy(0, 4, 8),  # source jumps
        BlockCopy(1, 6, 10),
    ]
    assert coalesce(copies) == [
        BlockCopy(0, 0, 0, 2),
        BlockCopy(0, 2, 7, 1),
        BlockCopy(0, 4, 8, 1),
        BlockCopy(1, 5, 9, 2),
    ]


def test_unsorted_input_and_existing_runs_merge() -> None:
    copies = [BlockCopy(0, 4, 14, 4), BlockCopy(0, 0, 10, 2), BlockCopy(0, 2, 12, 2)]
    assert coalesce(copies) == [BlockCopy(0, 0, 10, 8)]


def test_empty_and_invalid_input() -> None:
    assert coalesce([]) == []
    with pytest.raises(ValueError, match="num_blocks"):
        coalesce([BlockCopy(0, 0, 0, 0)])
    with pytest.raises(ValueError, match="written twice"):
        coalesce([BlockCopy(0, 0, 5, 2), BlockCopy(0, 9, 6)])


def _index(*regions: tuple[int, int, int]) -> RegionIndex:
    """(region id, blocks, block bytes) per region, at made-up base addresses."""
    return RegionIndex(RegionInfo(r, n * b, b, 1000 * (r + 1)) for r, n, b in regions)


def test_bounds_are_checked_on_both_sides() -> None:
    copies = [BlockCopy(0, 0, 6, 2)]
    assert plan(copies, _index((0, 2, 4)), _index((0, 8, 4))).nbytes == 8
    with pytest.raises(ValueError, match="reaches block 7 but local has 2 and remote has 7"):
        plan(copies, _index((0, 2, 4)), _index((0, 7, 4)))
    with pytest.raises(ValueError, match="reaches block 7 but local has 1 and remote has 8"):
        plan(copies, _index((0, 1, 4)), _index((0, 8, 4)))
    with pytest.raises(ValueError, match="region 0 is not registered on the remote side"):
        plan(copies, _index((0, 2, 4)), _index((1, 8, 4)))
    with pytest.raises(ValueError, match="region 0 is not registered on the local side"):
        plan(copies, _index(), _index((0, 8, 4)))
    with pytest.raises(ValueError, match="region 0: local blocks are 4 bytes, remote 8"):
        plan(copies, _index((0, 2, 4)), _index((0, 8, 8)))


def test_plan_gives_byte_spans_and_absolute_addresses() -> None:
    """Runs become byte offsets per region and absolute starts on both sides (what cma and UCX post)."""
    copies = [BlockCopy(3, 1, 0), BlockCopy(3, 2, 1), BlockCopy(1, 0, 5)]
    local, remote = _index((1, 4, 16), (3, 4, 8)), _index((1, 8, 16), (3, 2, 8), (7, 1, 1))
    spans = plan(copies, local, remote)
    assert spans.table.tolist() == [[1, 0, 80, 16], [3, 8, 0, 16]]
    assert spans.nbytes == 32
    assert spans.local_address.tolist() == [2000, 4008]
    assert spans.remote_address.tolist() == [2080, 4000]
    assert plan([], local, remote).nbytes == 0


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_coalesced_runs_cover_exactly_the_input(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 200))
    src = data.draw(st.permutations(range(n)))
    dst = data.draw(st.permutations(range(n)))
    region = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    copies = [BlockCopy(r, s, d) for r, s, d in zip(region, src, dst, strict=True)]
    runs = coalesce(copies)
    expanded = {(c.region_id, c.src_block + i, c.dst_block + i) for c in runs for i in range(c.num_blocks)}
    assert expanded == {(c.region_id, c.src_block, c.dst_block) for c in copies}
    # maximal: no two runs could be merged further
    table = np.array([(c.region_id, c.src_block, c.dst_block, c.num_blocks) for c in runs])
    follows = (
        (table[1:, 0] == table[:-1, 0])
        & (table[1:, 1] == table[:-1, 1] + table[:-1, 3])
        & (table[1:, 2] == table[:-1, 2] + table[:-1, 3])
    )
    assert not follows.any()


# -- the plain-Python path for small writes agrees with the numpy path ------------------------------------------
_copy = st.builds(BlockCopy, st.integers(0, 2), st.integers(-1, 12), st.integers(-1, 12), st.integers(0, 4))


def _outcome(fn: Callable[[], object]) -> object:
    """The value ``fn`` returns (arrays as lists), or the message of the ``ValueError`` it raises."""
    try:
        value = fn()
    except ValueError as exc:
        return ("error", str(exc))
    if isinstance(value, Spans):
        return [
            value.table.tolist(),
            value.nbytes,
            value.local_address.tolist(),
            value.remote_address.tolist(),
        ]
    return np.asarray(value).tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(_copy, max_size=SMALL_COPIES))
def test_small_and_vectorised_coalescing_agree(copies: list[BlockCopy]) -> None:
    """Same runs in the same order, or the same error, including invalid and overlapping copies."""
    assert _outcome(lambda: coalesce_small(copies)) == _outcome(lambda: coalesce_vectorised(copies))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_copy, max_size=SMALL_COPIES),
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 16), st.sampled_from([4, 8])), max_size=3),
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 16), st.sampled_from([4, 8])), max_size=3),
)
def test_small_and_vectorised_plans_agree(
    copies: list[BlockCopy], local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]]
) -> None:
    """Same spans and addresses, or the same error (unknown region, block size, bounds) found first."""
    mine = _index(*{r: (r, n, b) for r, n, b in local}.values())
    theirs = _index(*{r: (r, n, b) for r, n, b in remote}.values())
    small = _outcome(lambda: regions._plan_small(coalesce_small(copies), mine, theirs))
    vectorised = _outcome(lambda: regions._plan_vectorised(coalesce_vectorised(copies), mine, theirs))
    assert small == vectorised
