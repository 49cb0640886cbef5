"""Integrity mode (``integrity_check``): P's checksums of the KV it wrote into D, and D's check of what landed.

Why: a torn, misdirected or lost write (a transport bug, a fault on the wire that a checksum-less protocol
misses) would otherwise become an answer with plausible but wrong tokens. With the mode on, P sends with its
``Done`` an xxh3-64 digest (``xxhash``: fast, non-cryptographic, made for this) of every KV buffer of every
layer it wrote, and D reports the load DONE only when its own memory hashes the same.

When and where: P hashes its source for each D rank once the source is final, at ``finish`` (every layer of
the prompt computed; the last writes are still in flight, so the hash overlaps them), or, for a D rank whose
destinations come later, right before its ``Done`` (``Sender._maybe_done``); on the transfer engine's I/O
thread, reading its own source blocks in host memory: the KV cache itself, or the staging slots of a device
cache (``pd_connector.staging``) — never a device pointer; the engine refuses the mode for memory registered
as device memory. D hashes the same granules of its memory when
that ``Done`` arrives (``Receiver._on_end``). Hashing at the end and not per write because a block can be
written twice (heads-major layouts move whole blocks, so a partial last block is pushed again by the next
chunk): only the final bytes have one well-defined checksum, and both sides' copies of them are quiet then.

What is hashed: for each D table (one shared by every layer, or one per layer) the runs of destination
granules the transfer covers, in destination order, sent as ``Checksums.runs`` (so D hashes exactly those
bytes, bounds-checked against its own regions: a peer names only ranges of D's registered KV memory, which D
reads and never writes here). P streams its source granules of each run in that same order, D its
destination granules: equal bytes give equal digests.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from pd_connector.layout import KVLayout
from pd_connector.protocol import Checksums
from pd_connector.transport.base import HOST, MemoryRegion

#: One run on the wire: (first destination granule, granules), little-endian int64 each.
_RUN = np.dtype("<i8")


class IntegrityError(ValueError):
    """The bytes D holds do not hash as P's did, or P's checksums are malformed; the message says where."""


class RegionBytes:
    """Read-only byte views of an engine's registered host regions, indexed by region id.

    Built once per engine (``EngineContext``) when the mode is on. ``ValueError`` for a region in device
    memory: hashing it here would dereference a device pointer (stage it through host memory instead).
    """

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        device = sorted({r.memory for r in regions if r.memory != HOST})
        if device:
            raise ValueError(
                f"integrity_check hashes KV in host memory, but this cache is registered as "
                f"{', '.join(device)} memory; stage it through host memory (kv_staging=always) or turn "
                "integrity_check off"
            )
        self._regions = {r.region_id: r for r in regions}
        self._views = {
            r.region_id: memoryview((ctypes.c_char * r.length).from_address(r.address)).cast("B")
            for r in regions
            if r.length
        }

    def digest(self, region_id: int, runs: npt.NDArray[np.int64]) -> int:
        """xxh3-64 of the granules ``runs`` (rows of first granule, count) of region ``region_id``, in order.

        Raises ``IntegrityError`` when the region is not ours or a run leaves it (checked before any read).
        """
        region = self._regions.get(region_id)
        if region is None:
            raise IntegrityError(f"no KV region {region_id}")
        g = region.block_bytes
        if runs.size and (
            runs[:, 1].min() <= 0
            or runs[:, 0].min() < 0
            or ((runs[:, 0] + runs[:, 1]) * g).max() > region.length
        ):
            raise IntegrityError(f"a checksummed run leaves KV region {region_id} ({region.length} bytes)")
        view = self._views.get(region_id, memoryview(b""))
        h = xxhash.xxh3_64()
        for first, count in runs.tolist():
            h.update(view[first * g : (first + count) * g])
        return h.intdigest()


def hashed_regions(layout: KVLayout, per_layer_tables: bool) -> list[list[int]]:
    """Which regions each D table's runs are hashed over, both sides alike: every region over the one shared
    table, or each layer's buffers over that layer's table."""
    buffers = range(layout.buffers_per_layer)
    layers = range(layout.num_layers)
    if per_layer_tables:
        return [[layout.region_id(layer, kv) for kv in buffers] for layer in layers]
    return [[layout.region_id(layer, kv) for layer in layers for kv in buffers]]


def checksums(
    memory: RegionBytes, region_ids: Sequence[Sequence[int]], runs: Sequence[Sequence[tuple[int, int, int]]]
) -> Checksums:
    """P's checksums for one D rank: ``runs[t]`` are the ``(src, dst, granules)`` runs of D's table ``t`` (one
    table shared by every layer, or one per layer), ``region_ids[t]`` the regions hashed over them.

    Each table's runs are hashed in destination order, source granules read from P's ``memory``.
    """
    tables: list[bytes] = []
    digests: list[int] = []
    for table_runs, regions in zip(runs, region_ids, strict=True):
        by_dst = sorted(table_runs, key=lambda r: r[1])
        src = np.array([(s, n) for s, _, n in by_dst], _RUN).reshape(-1, 2)
        tables.append(np.array([(d, n) for _, d, n in by_dst], _RUN).reshape(-1, 2).tobytes())
        digests.extend(memory.digest(rid, src) for rid in regions)
    return Checksums(tables, digests)


def verify(
    memory: RegionBytes, region_ids: Sequence[Sequence[int]], sums: Checksums, buffers_per_layer: int
) -> None:
    """D's check of what landed: ``IntegrityError`` naming the first layer (and buffer) whose bytes differ.

    ``region_ids[t]``: the regions D expects hashed over P's table ``t`` (one list for a shared table, one per
    layer otherwise); a checksum message of any other shape is refused, never trusted. ``buffers_per_layer``
    (``KVLayout.buffers_per_layer``) only names the layer of a region in the error.
    """
    if len(sums.runs) != len(region_ids) or len(sums.digests) != sum(len(r) for r in region_ids):
        raise IntegrityError(
            f"checksums for {len(sums.runs)} tables and {len(sums.digests)} buffers, expected "
            f"{len(region_ids)} and {sum(len(r) for r in region_ids)}"
        )
    expected = iter(sums.digests)
    for raw, regions in zip(sums.runs, region_ids, strict=True):
        if len(raw) % (2 * _RUN.itemsize):
            raise IntegrityError(f"a checksummed run table of {len(raw)} bytes is not whole runs")
        runs = np.frombuffer(raw, _RUN).reshape(-1, 2)
        for rid in regions:
            want, got = next(expected), memory.digest(rid, runs)
            if got != want:
                layer, kv = divmod(rid, buffers_per_layer)
                buffer = ("K", "V")[kv] if buffers_per_layer == 2 else "K|V"
                raise IntegrityError(
                    f"layer {layer} ({buffer} buffer, region {rid}): xxh3 {got:016x} of the {int(runs[:, 1].sum())} granules that landed "
                    f"in {len(runs)} runs, prefill hashed {want:016x}"
                )


def landed_problem(
    memory: RegionBytes | None, layout: KVLayout, sums: Checksums | None, per_layer_tables: bool, source: str
) -> str | None:
    """D's receiver, once every write of one P rank landed (its ``Done``) and before the load is reported: why
    the KV from ``source`` (that rank's address) does not match its checksums, or None (also when integrity
    mode is off: ``memory`` is None). A mismatch fails the load."""
    if memory is None:
        return None
    if sums is None:
        return f"integrity check failed: prefill {source} sent no checksums"
    try:
        verify(memory, hashed_regions(layout, per_layer_tables), sums, layout.buffers_per_layer)
    except IntegrityError as e:
        return f"integrity check failed on the KV from prefill {source}: {e}"
    return None
