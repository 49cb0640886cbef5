"""Stage a device KV cache through a bounded pool of host slots for transports that reach host memory only.

Who uses it: the engine adapter's worker side (``pd_connector.vllm.worker_side``) when its KV cache lives in
memory the configured transport cannot reach (``plan``: a CUDA cache with the tcp or cma transport), or when
``kv_staging = always``. The transport then registers a pool of host *slots* instead of the cache: each slot
holds one block of every layer, laid out as the cache lays out a block. A transfer borrows slots for its
blocks and returns them when it ends, so the host memory is bounded by the pool (``kv_staging_pool_mib``),
not by the cache:

- P: once D's destinations for a request arrived, ``reserve`` gives each block of its table a slot; the slot
  ids, not the cache's block ids, are the table the transfer engine sends from. Each pushed layer's blocks
  are copied device -> slot (``to_slots``) before the push; the transport reads the slots.
- D: before a load is expected, ``reserve`` gives each of its blocks a slot; the slot ids are the destination
  table D sends P (``Destinations``), so P's transport writes the slots. When the load ended well, its blocks
  are copied slot -> device (``from_slots``) before vLLM reads them.
- Both: ``release`` returns a transfer's slots once it ended (done, failed, aborted, expired: the transfer
  engine reports an end only once no write can touch the memory any more).

``SlotTable`` is the block -> slot remap and the allocation (no torch, no engine: unit-tested alone);
``StagingPool`` adds the host buffers and the copies. When the pool has too few free slots the caller waits
(``reserve`` returns None) within its own bound, and a transfer that needs more slots than the whole pool
is refused at once (``PoolTooSmall``).

The copies are plain ``torch`` copies of byte ranges, on a dedicated CUDA stream (ordered after the compute
stream that wrote the KV, and waited for before the transport reads or vLLM computes); on a CPU cache the
very same code runs without a stream, which is what lets the CPU tests exercise the staging path. Slots are
pinned host memory when the cache is on a GPU.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterator, Sequence
from typing import Literal

import msgspec
import numpy as np
import torch

from pd_connector.block_mapping import kernel_block_ids, merged_runs
from pd_connector.layout import KVLayout
from pd_connector.transport.base import MemoryType

#: How a worker's KV cache reaches the transport: registered as it is, or through host slots.
Path = Literal["direct", "staged"]

MIB = 1 << 20


def plan(cache_memory: MemoryType, reachable: frozenset[MemoryType]) -> Path:
    """``direct`` when the transport reaches the cache's memory itself (host caches; CUDA caches with UCX),
    ``staged`` when it reaches host memory only (a CUDA cache with tcp or cma)."""
    if cache_memory in reachable:
        return "direct"
    if "host" in reachable:
        return "staged"
    raise ValueError(f"the transport reaches neither {cache_memory} nor host memory")


def byte_views(tensors: Sequence[torch.Tensor], buffers: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Flat ``uint8`` views of ``buffers`` (``(address, bytes)``, as ``kv_tensors.describe`` lists them), each
    inside the storage of one of ``tensors`` (a buffer may span padding or other layers' pages)."""
    views = []
    for address, length in buffers:
        for t in tensors:
            storage = t.untyped_storage()
            offset = address - storage.data_ptr()
            if offset >= 0 and offset + length <= storage.nbytes():
                view = torch.empty(0, dtype=torch.uint8, device=t.device)
                views.append(view.set_(storage, offset, (length,), (1,)))
                break
        else:
            raise ValueError(f"buffer at {address:#x} ({length} bytes) is in none of the cache tensors")
    return views


def slot_layout(layout: KVLayout) -> KVLayout:
    """The layout of the host slots: the cache's in-block order, blocks packed without the cache's padding
    between blocks (what the handshake sends when the worker stages)."""
    sb, st, sh, sk = layout.vector_strides
    if sb == layout.block_extent:
        return layout
    return msgspec.structs.replace(layout, strides=(layout.block_extent, st, sh, sk))


def slot_bytes(layout: KVLayout) -> int:
    """Host bytes one slot takes: one block of every buffer of every layer."""
    return layout.num_layers * layout.buffers_per_layer * layout.block_extent * layout.granule_bytes


def pool_slots(layout: KVLayout, num_blocks: int, pool_mib: int) -> int:
    """Slots a pool of ``pool_mib`` MiB holds (0: one per cache block, the whole cache), at most one per cache
    block; ``ValueError`` naming both sizes when not even one slot fits."""
    if pool_mib == 0:
        return num_blocks
    fits = pool_mib * MIB // slot_bytes(layout)
    if fits < 1:
        raise ValueError(
            f"kv_staging_pool_mib = {pool_mib} MiB holds no staging slot: one slot (a block of every layer) "
            f"takes {slot_bytes(layout) / MIB:.2f} MiB"
        )
    return min(fits, num_blocks)


class PoolTooSmall(ValueError):
    """A transfer needs more slots than the whole pool has: it can never be staged, however long it waits."""


class SlotTable:
    """Which host slot holds which block of which transfer, and which slots are free (one worker's pool).

    Owners are transfer ids. A block gets one slot per owner (two transfers staging the same cache block,
    a shared prefix, get two). Free slots are handed out lowest first, so a transfer's consecutive blocks tend
    to get consecutive slots (fewer, larger copies). Not thread-safe: one worker thread calls it.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a staging pool needs at least one slot, got {num_slots}")
        self.capacity = num_slots
        self._free = list(range(num_slots))  # a heap
        self._held: dict[str, dict[int, int]] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    def owners(self) -> list[str]:
        return list(self._held)

    def slots(self, owner: str) -> dict[int, int]:
        """``owner``'s blocks and their slots (empty when it holds none)."""
        return dict(self._held.get(owner, {}))

    def reserve(self, owner: str, blocks: Sequence[int]) -> list[int] | None:
        """The slot of each of ``blocks`` for ``owner``, in order, giving a slot to each block it has none for
        yet (a longer table of the same transfer keeps the slots it had).

        None (and nothing taken) when too few slots are free now: the caller waits for a release. Raises
        ``PoolTooSmall`` when the owner would hold more slots than the pool has, ``ValueError`` when
        ``blocks`` names a block twice.
        """
        new = self.check_fits(owner, blocks)
        mine = self._held.get(owner, {})
        if len(new) > len(self._free):
            return None
        mine = self._held.setdefault(owner, mine)
        for block in new:
            mine[block] = heapq.heappop(self._free)
        return [mine[b] for b in blocks]

    def check_fits(self, owner: str, blocks: Sequence[int]) -> list[int]:
        """The blocks of ``blocks`` ``owner`` holds no slot for; raises ``PoolTooSmall`` when it could never
        hold them all (more than the pool), ``ValueError`` when ``blocks`` names a block twice."""
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"transfer {owner}: its block table names a block twice")
        mine = self._held.get(owner, {})
        new = [b for b in blocks if b not in mine]
        if len(mine) + len(new) > self.capacity:
            raise PoolTooSmall(
                f"transfer {owner} needs {len(mine) + len(new)} staging slots, the pool has {self.capacity} "
                "(raise kv_staging_pool_mib)"
            )
        return new

    def release(self, owner: str) -> int:
        """Return ``owner``'s slots to the pool (idempotent); how many it held."""
        mine = self._held.pop(owner, {})
        for slot in mine.values():
            heapq.heappush(self._free, slot)
        return len(mine)


class StagingPool:
    """Host slots standing in for one worker's KV cache in the transport, and the copies in and out of them."""

    def __init__(self, layout: KVLayout, device_buffers: Sequence[torch.Tensor], num_slots: int) -> None:
        """``device_buffers``: flat ``uint8`` views of the cache's buffers in region order (``byte_views``)."""
        if len(device_buffers) != layout.num_layers * layout.buffers_per_layer:
            raise ValueError(f"{len(device_buffers)} buffers for a layout of {layout.num_layers} layers")
        self.layout = slot_layout(layout)
        self.table = SlotTable(num_slots)
        self._device = list(device_buffers)
        g = layout.granule_bytes
        self._device_stride = layout.vector_strides[0] * g
        self._slot_stride = layout.block_extent * g
        self._span = layout.block_span * g
        cuda = any(b.is_cuda for b in self._device)
        self._host = [
            torch.empty(num_slots * self._slot_stride, dtype=torch.uint8, pin_memory=cuda)
            for _ in self._device
        ]
        self._stream = torch.cuda.Stream(self._device[0].device) if cuda else None

    def host_buffers(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the slot buffers, in region order: what the transport registers."""
        return [(h.data_ptr(), h.numel()) for h in self._host]

    def reserve(self, transfer_id: str, blocks: Sequence[int]) -> list[int] | None:
        """Slot ids standing for ``blocks`` in the transfer engine (``SlotTable.reserve``)."""
        return self.table.reserve(transfer_id, blocks)

    def release(self, transfer_id: str) -> int:
        return self.table.release(transfer_id)

    def to_slots(self, transfer_id: str, layer: int, blocks: Sequence[int]) -> None:
        """P, before pushing ``layer``'s ``blocks`` (reserved by ``transfer_id``): copy them device -> slots
        (returns once they are there)."""
        runs = self._runs(transfer_id, blocks)
        with self._on_stream(after_compute=True):
            for kv in range(self.layout.buffers_per_layer):
                region = self.layout.region_id(layer, kv)
                for (dlo, dhi), (hlo, hhi) in runs:
                    self._host[region][hlo:hhi].copy_(self._device[region][dlo:dhi], non_blocking=True)

    def from_slots(self, transfer_id: str, blocks: Sequence[int]) -> None:
        """D, when ``transfer_id``'s load into ``blocks`` ended well: copy them slots -> device in every layer
        (returns once the device holds them, before vLLM computes with them)."""
        runs = self._runs(transfer_id, blocks)
        with self._on_stream(after_compute=False):
            for region in range(len(self._device)):
                for (dlo, dhi), (hlo, hhi) in runs:
                    self._device[region][dlo:dhi].copy_(self._host[region][hlo:hhi], non_blocking=True)

    def _runs(self, transfer_id: str, blocks: Sequence[int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Byte ranges ``(device, slots)`` of ``blocks`` in one buffer, neighbours on both sides merged (when
        the cache has no padding between blocks, as the slots have none)."""
        held = self.table.slots(transfer_id)
        missing = [b for b in blocks if b not in held]
        if missing:
            raise ValueError(f"transfer {transfer_id} holds no staging slot for blocks {missing}")
        src = np.asarray(list(blocks), np.int64)
        dst = np.asarray([held[b] for b in blocks], np.int64)
        if self._device_stride == self._slot_stride:
            runs = merged_runs(src, dst)
        else:
            runs = [(b, s, 1) for b, s in zip(src.tolist(), dst.tolist(), strict=True)]
        ds, hs, span = self._device_stride, self._slot_stride, self._span
        return [((b * ds, (b + n - 1) * ds + span), (s * hs, (s + n - 1) * hs + span)) for b, s, n in runs]

    @contextlib.contextmanager
    def _on_stream(self, after_compute: bool) -> Iterator[None]:
        """Run the copies on the staging stream (after the compute stream's queued work when they read what
        it wrote) and wait for them; on a CPU cache the copies are synchronous and no stream exists."""
        if self._stream is None:
            yield
            return
        if after_compute:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()


def transfer_owner(role: str, transfer_id: str) -> str:
    """Who holds a transfer's slots: one side (``send``/``recv``) of it, as a kv_both worker may run both."""
    return f"{role}:{transfer_id}"


class BlockTables:
    """What a worker's transfer engine is given for KV-manager blocks: the cache's kernel blocks (direct), or
    the staging slots that stand for them (staged), per transfer ``owner``. Both halves of the vLLM worker
    side (``pd_connector.vllm.worker_side`` for D, ``worker_pushes`` for P) go through it, so neither
    branches on staging."""

    def __init__(self, per_block: int, pool: StagingPool | None) -> None:
        #: Kernel blocks per KV-manager block (1 unless the attention backend uses smaller kernel blocks).
        self.per_block = per_block
        self.pool = pool

    def kernel(self, blocks: Sequence[int]) -> list[int]:
        """The cache's blocks of KV-manager ``blocks`` (the same ids unless the backend uses kernel blocks)."""
        return kernel_block_ids(blocks, self.per_block)

    def reserve(self, owner: str, blocks: Sequence[int]) -> list[int] | None:
        """The table for manager ``blocks``: the cache's blocks, or slots standing for them; None when too few
        slots are free now (raises ``PoolTooSmall`` when there never will be enough)."""
        table = self.kernel(blocks)
        return table if self.pool is None else self.pool.reserve(owner, table)

    def holds_slots(self, owner: str) -> bool:
        """Whether ``owner`` holds staging slots (direct: always, the cache's blocks stand for themselves)."""
        return self.pool is None or bool(self.pool.table.slots(owner))

    def check_fits(self, owner: str, blocks: Sequence[int]) -> None:
        """Raise ``PoolTooSmall`` when manager ``blocks`` could never get slots (direct: they always fit)."""
        if self.pool is not None:
            self.pool.table.check_fits(owner, self.kernel(blocks))

    def to_slots(self, owner: str, layer: int, blocks: Sequence[int]) -> None:
        """P, staged: copy ``layer`` of manager ``blocks`` into ``owner``'s slots before the push reads them."""
        if self.pool is not None:
            self.pool.to_slots(owner, layer, self.kernel(blocks))

    def from_slots(self, owner: str, blocks: Sequence[int]) -> None:
        """D, staged: copy a load that ended well out of ``owner``'s slots into manager ``blocks``."""
        if self.pool is not None:
            self.pool.from_slots(owner, self.kernel(blocks))

    def release(self, owner: str) -> None:
        """Return ``owner``'s slots, if any (its transfer ended)."""
        if self.pool is not None:
            self.pool.release(owner)
