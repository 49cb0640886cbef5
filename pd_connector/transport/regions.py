"""Bookkeeping of registered memory regions shared by the transports (local side and attached peers).

Each transport keeps one ``RegionTable`` for what ``register`` was given and a ``RegionIndex`` per attached
peer, built from its descriptor; ``plan`` turns a ``write`` request into byte spans with every bound checked
before anything is posted.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from .base import BlockCopy, MemoryRegion
from .coalesce import (
    COUNT,
    DST,
    REGION,
    SMALL_COPIES,
    SRC,
    Run,
    RunTable,
    coalesce_small,
    coalesce_vectorised,
)


class RegionInfo(msgspec.Struct, frozen=True, array_like=True):
    """A region as peers see it in a descriptor: id, size and block stride (bytes), plus its base address.

    ``address`` is only meaningful to transports that address remote memory directly (UCX RMA); the TCP
    fallback sends (region, offset) and ignores it.
    """

    region_id: int
    length: int
    block_bytes: int
    address: int = 0


def host_view(address: int, length: int) -> memoryview:
    """A writable byte view of ``length`` bytes at ``address`` (registered host memory; no copy)."""
    if length == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


class RegionIndex:
    """One side's regions as numpy columns sorted by id, so ``plan`` checks and maps a whole write at once.

    Built when the regions change, not per write: a transport's local index when ``register`` changes its
    ``RegionTable``, a peer's at ``attach``. ``by_id`` keeps the ``RegionInfo`` for callers that need one.
    """

    def __init__(self, infos: Iterable[RegionInfo]) -> None:
        rows = sorted(infos, key=lambda r: r.region_id)
        self.by_id: dict[int, RegionInfo] = {r.region_id: r for r in rows}
        self.ids = np.array([r.region_id for r in rows], dtype=np.int64)
        self.blocks = np.array([r.length // r.block_bytes for r in rows], dtype=np.int64)
        self.block_bytes = np.array([r.block_bytes for r in rows], dtype=np.int64)
        self.address = np.array([r.address for r in rows], dtype=np.int64)

    def positions(self, region_ids: npt.NDArray[np.int64], side: str) -> npt.NDArray[np.intp]:
        """Row of each id in the columns; ``ValueError`` naming the first id this ``side`` lacks."""
        pos = np.minimum(np.searchsorted(self.ids, region_ids), max(len(self.ids) - 1, 0))
        known = self.ids[pos] == region_ids if len(self.ids) else np.zeros(len(region_ids), dtype=bool)
        if not known.all():
            region = int(region_ids[int(np.argmin(known))])
            raise ValueError(f"region {region} is not registered on the {side} side")
        return pos


class RegionTable:
    """Registered local regions by id (thread-safe: ``register`` may race with the I/O thread's reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, MemoryRegion] = {}
        self._index: RegionIndex | None = None

    def add(self, regions: Iterable[MemoryRegion]) -> None:
        """Add regions; a repeated id is refused (``ValueError``) and nothing is added."""
        new = list(regions)
        with self._lock:
            ids = [r.region_id for r in new]
            dup = {i for i in ids if i in self._regions or ids.count(i) > 1}
            if dup:
                raise ValueError(f"regions already registered: {sorted(dup)}")
            self._regions.update((r.region_id, r) for r in new)
            self._index = None

    def remove(self, region_ids: Iterable[int]) -> None:
        with self._lock:
            for region_id in region_ids:
                self._regions.pop(region_id, None)
            self._index = None

    def get(self, region_id: int) -> MemoryRegion | None:
        with self._lock:
            return self._regions.get(region_id)

    def all(self) -> list[MemoryRegion]:
        with self._lock:
            return sorted(self._regions.values(), key=lambda r: r.region_id)

    def clear(self) -> list[MemoryRegion]:
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
            self._index = None
            return regions

    def infos(self) -> list[RegionInfo]:
        return [_info(r) for r in self.all()]

    def index(self) -> RegionIndex:
        """The current regions as a ``RegionIndex`` (rebuilt only after a change)."""
        with self._lock:
            if self._index is None:
                self._index = RegionIndex(_info(r) for r in self._regions.values())
            return self._index


def _info(region: MemoryRegion) -> RegionInfo:
    return RegionInfo(region.region_id, region.length, region.block_bytes, region.address)


class Spans(NamedTuple):
    """A checked write: one row per merged run, with each run's absolute start on both sides."""

    #: ``(region_id, src_offset, dst_offset, nbytes)`` rows, offsets from each side's region base.
    table: RunTable
    nbytes: int
    local_address: npt.NDArray[np.int64]
    remote_address: npt.NDArray[np.int64]


def plan(copies: Sequence[BlockCopy], local: RegionIndex, remote: RegionIndex) -> Spans:
    """Coalesce ``copies``, check them against both sides and return byte spans. Called per ``write``: by
    cma and ucx on the calling (engine) thread, by tcp on its event loop. A few copies are planned in plain
    Python, many with numpy (``SMALL_COPIES``); both give the same spans and the same errors.

    Refuses (``ValueError``, nothing posted) unknown regions, blocks past either side's end and regions
    whose block size differs between the two sides (layout mapping is the transfer engine's job).
    """
    if len(copies) <= SMALL_COPIES:
        return _plan_small(coalesce_small(copies), local, remote)
    return _plan_vectorised(coalesce_vectorised(copies), local, remote)


def _plan_vectorised(runs: RunTable, local: RegionIndex, remote: RegionIndex) -> Spans:
    """``plan``'s checks and arithmetic with numpy, for many runs."""
    if len(runs) == 0:
        empty = np.empty(0, dtype=np.int64)
        return Spans(runs, 0, empty, empty)
    region = runs[:, REGION]
    mine, theirs = local.positions(region, "local"), remote.positions(region, "remote")
    stride = remote.block_bytes[theirs]
    mismatch = local.block_bytes[mine] != stride
    if mismatch.any():
        i = int(np.argmax(mismatch))
        raise ValueError(
            f"region {int(region[i])}: local blocks are {int(local.block_bytes[mine[i]])} bytes, "
            f"remote {int(stride[i])}"
        )
    src_end, dst_end = runs[:, SRC] + runs[:, COUNT], runs[:, DST] + runs[:, COUNT]
    past = (src_end > local.blocks[mine]) | (dst_end > remote.blocks[theirs])
    if past.any():
        i = int(np.argmax(past))
        raise ValueError(
            f"region {int(region[i])}: copy reaches block {max(int(src_end[i]), int(dst_end[i])) - 1} but "
            f"local has {int(local.blocks[mine[i]])} and remote has {int(remote.blocks[theirs[i]])} blocks"
        )
    out = np.empty_like(runs)
    out[:, REGION] = region
    out[:, SRC] = runs[:, SRC] * stride
    out[:, DST] = runs[:, DST] * stride
    out[:, COUNT] = runs[:, COUNT] * stride
    return Spans(
        out, int(out[:, COUNT].sum()), local.address[mine] + out[:, SRC], remote.address[theirs] + out[:, DST]
    )


def _plan_small(runs: list[Run], local: RegionIndex, remote: RegionIndex) -> Spans:
    """``plan``'s checks and arithmetic for a few runs, in plain Python: the same spans, the same errors, found
    in the same order (every run's local region, then remote, then block sizes, then bounds)."""
    for side, index in (("local", local), ("remote", remote)):
        for region, *_ in runs:
            if region not in index.by_id:
                raise ValueError(f"region {region} is not registered on the {side} side")
    for region, *_ in runs:
        local_bytes, remote_bytes = local.by_id[region].block_bytes, remote.by_id[region].block_bytes
        if local_bytes != remote_bytes:
            raise ValueError(f"region {region}: local blocks are {local_bytes} bytes, remote {remote_bytes}")
    table: list[Run] = []
    local_address: list[int] = []
    remote_address: list[int] = []
    for region, src, dst, count in runs:
        mine, theirs = local.by_id[region], remote.by_id[region]
        local_blocks, remote_blocks = mine.length // mine.block_bytes, theirs.length // theirs.block_bytes
        if src + count > local_blocks or dst + count > remote_blocks:
            raise ValueError(
                f"region {region}: copy reaches block {max(src, dst) + count - 1} but local has {local_blocks} "
                f"and remote has {remote_blocks} blocks"
            )
        stride = theirs.block_bytes
        table.append((region, src * stride, dst * stride, count * stride))
        local_address.append(mine.address + src * stride)
        remote_address.append(theirs.address + dst * stride)
    return Spans(
        np.array(table, dtype=np.int64).reshape(-1, 4),
        sum(row[COUNT] for row in table),
        np.array(local_address, dtype=np.int64),
        np.array(remote_address, dtype=np.int64),
    )
