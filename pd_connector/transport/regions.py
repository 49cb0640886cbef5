"""Bookkeeping of registered memory regions shared by the transports (local side and attached peers).

Each transport keeps one ``RegionTable`` for what ``register`` was given and learns the peer's block counts
and sizes from its descriptor; ``plan`` turns a ``write`` request into byte spans with every bound checked
before anything is posted.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import numpy as np

from .base import BlockCopy, MemoryRegion
from .coalesce import COUNT, DST, REGION, SRC, RunTable, check_bounds, coalesce_runs


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


class RegionTable:
    """Registered local regions by id (thread-safe: ``register`` may race with the I/O thread's reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, MemoryRegion] = {}

    def add(self, regions: Iterable[MemoryRegion]) -> None:
        """Add regions; a repeated id is refused (``ValueError``) and nothing is added."""
        new = list(regions)
        with self._lock:
            ids = [r.region_id for r in new]
            dup = {i for i in ids if i in self._regions or ids.count(i) > 1}
            if dup:
                raise ValueError(f"regions already registered: {sorted(dup)}")
            self._regions.update((r.region_id, r) for r in new)

    def remove(self, region_ids: Iterable[int]) -> None:
        with self._lock:
            for region_id in region_ids:
                self._regions.pop(region_id, None)

    def get(self, region_id: int) -> MemoryRegion | None:
        with self._lock:
            return self._regions.get(region_id)

    def all(self) -> list[MemoryRegion]:
        with self._lock:
            return sorted(self._regions.values(), key=lambda r: r.region_id)

    def clear(self) -> list[MemoryRegion]:
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
            return regions

    def infos(self) -> list[RegionInfo]:
        return [RegionInfo(r.region_id, r.length, r.block_bytes, r.address) for r in self.all()]


def plan(
    copies: Sequence[BlockCopy], local: RegionTable, remote: Mapping[int, RegionInfo]
) -> tuple[RunTable, int]:
    """Coalesce ``copies``, check them against both sides and return byte spans and their total size.

    The span table has one row per merged run: ``(region_id, src_offset, dst_offset, nbytes)``, offsets
    from each side's region base. Refuses (``ValueError``) unknown regions, out-of-range blocks and regions
    whose block size differs between the two sides (layout mapping is the transfer engine's job).
    """
    runs = coalesce_runs(copies)
    if len(runs) == 0:
        return runs, 0
    regions, row_region = np.unique(runs[:, REGION], return_inverse=True)
    local_blocks: dict[int, int] = {}
    block_bytes = np.zeros(len(regions), dtype=np.int64)
    for i, region in enumerate(regions.tolist()):
        mine, theirs = local.get(region), remote.get(region)
        if mine is not None and theirs is not None and mine.block_bytes != theirs.block_bytes:
            raise ValueError(
                f"region {region}: local blocks are {mine.block_bytes} bytes, remote {theirs.block_bytes}"
            )
        if mine is not None:
            local_blocks[region] = mine.num_blocks
        if theirs is not None:
            block_bytes[i] = theirs.block_bytes
    check_bounds(runs, local_blocks, {i: r.length // r.block_bytes for i, r in remote.items()})
    stride = block_bytes[row_region.reshape(-1)]
    out = np.empty_like(runs)
    out[:, REGION] = runs[:, REGION]
    out[:, SRC] = runs[:, SRC] * stride
    out[:, DST] = runs[:, DST] * stride
    out[:, COUNT] = runs[:, COUNT] * stride
    return out, int(out[:, COUNT].sum())
