"""Turn a list of block copies into few large runs: the one coalescer of the connector.

Who calls it: every transport's ``write`` (through ``regions.plan``, on the thread that plans the write).
``block_mapping.BlockMapping.runs`` merges its vectors into runs itself (it knows both sides' strides).

Engines hand over one entry per block (vLLM block ids); a 4096-token prompt is 256 entries per layer. Sorting
by (region, source, destination) and merging runs that are contiguous on *both* sides makes that a handful
of spans per layer, which is what keeps per-message overhead (Python, syscalls, UCX requests) off the
critical path. Vectorised with numpy, a long prompt's layer costs tens of microseconds, not milliseconds; up
to ``SMALL_COPIES`` copies plain Python is cheaper still (``coalesce_small``, same result, property-tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, pairwise

import numpy as np
import numpy.typing as npt

from .base import BlockCopy

#: Column order of a run table: one row per merged run.
REGION, SRC, DST, COUNT = range(4)

RunTable = npt.NDArray[np.int64]
Run = tuple[int, int, int, int]

#: Up to this many copies a write is planned in plain Python (``coalesce_small``, ``regions.plan``): each numpy
#: call costs ~1 us warm but ~40 us when a large copy has just evicted the caches, and a plan is ~20 of them,
#: while a short prompt's layer is a handful of copies. Above it numpy's vector work wins.
SMALL_COPIES = 32


def coalesce_runs(copies: Sequence[BlockCopy]) -> RunTable:
    """Return an ``(n, 4)`` int64 table of merged runs ``(region_id, src_block, dst_block, num_blocks)``.

    Rows are sorted by (region, src, dst). Raises ``ValueError`` for a non-positive or negative count/index
    and for destination ranges that overlap inside a region (two sources racing for one block is a caller
    bug that would silently corrupt the cache).
    """
    if len(copies) <= SMALL_COPIES:
        return np.array(coalesce_small(copies), dtype=np.int64).reshape(-1, 4)
    return coalesce_vectorised(copies)


def coalesce_vectorised(copies: Sequence[BlockCopy]) -> RunTable:
    """``coalesce_runs`` with numpy, for many copies (a layer of a long prompt: hundreds)."""
    if not copies:
        return np.empty((0, 4), dtype=np.int64)
    table = np.fromiter(chain.from_iterable(copies), dtype=np.int64, count=4 * len(copies)).reshape(-1, 4)
    if (table[:, COUNT] <= 0).any() or (table[:, SRC : DST + 1] < 0).any():
        raise ValueError("block copies need src_block, dst_block >= 0 and num_blocks >= 1")
    _check_no_overlapping_destinations(table)
    table = table[np.lexsort((table[:, DST], table[:, SRC], table[:, REGION]))]
    prev = table[:-1]
    nxt = table[1:]
    starts_run = np.ones(len(table), dtype=bool)
    starts_run[1:] = (
        (nxt[:, REGION] != prev[:, REGION])
        | (nxt[:, SRC] != prev[:, SRC] + prev[:, COUNT])
        | (nxt[:, DST] != prev[:, DST] + prev[:, COUNT])
    )
    starts = np.flatnonzero(starts_run)
    merged = table[starts]  # fancy indexing copies
    merged[:, COUNT] = np.add.reduceat(table[:, COUNT], starts)
    return merged


def coalesce_small(copies: Sequence[BlockCopy]) -> list[Run]:
    """``coalesce_runs`` for a few copies, in plain Python: the same runs in the same order, the same errors."""
    rows = sorted(copies)  # (region, src, dst, count): what the numpy path's lexsort orders by
    if any(c.num_blocks <= 0 or c.src_block < 0 or c.dst_block < 0 for c in rows):
        raise ValueError("block copies need src_block, dst_block >= 0 and num_blocks >= 1")
    by_dst = sorted(rows, key=lambda c: (c.region_id, c.dst_block))
    for a, b in pairwise(by_dst):
        if a.region_id == b.region_id and b.dst_block < a.dst_block + a.num_blocks:
            raise ValueError(f"region {a.region_id}: destination blocks {b.dst_block} are written twice")
    runs: list[Run] = []
    for region, src, dst, count in rows:
        if runs:
            r, s, d, n = runs[-1]
            if r == region and s + n == src and d + n == dst:
                runs[-1] = (r, s, d, n + count)
                continue
        runs.append((region, src, dst, count))
    return runs


def _check_no_overlapping_destinations(table: RunTable) -> None:
    by_dst = table[np.lexsort((table[:, DST], table[:, REGION]))]
    same_region = by_dst[1:, REGION] == by_dst[:-1, REGION]
    overlaps = same_region & (by_dst[1:, DST] < by_dst[:-1, DST] + by_dst[:-1, COUNT])
    if overlaps.any():
        i = int(np.flatnonzero(overlaps)[0])
        raise ValueError(
            f"region {int(by_dst[i, REGION])}: destination blocks {int(by_dst[i + 1, DST])} are written twice"
        )
