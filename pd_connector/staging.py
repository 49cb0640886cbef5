"""Stage a device KV cache through pinned host memory for transports that reach host memory only.

Who uses it: the engine adapter's worker side (``pd_connector.vllm.worker_side``) when its KV cache lives in
memory the configured transport cannot reach (``plan``: a CUDA cache with the tcp or cma transport). The
transport then registers host mirrors of the cache's buffers instead of the cache: P copies each layer's
pushed blocks device -> mirror before the push (``to_host``), D copies a finished load's blocks mirror ->
device before vLLM reads them (``to_device``). No transport ever dereferences a device pointer.

The copies are plain ``torch`` copies of byte ranges, on a dedicated CUDA stream (ordered after the compute
stream that wrote the KV, and waited for before the transport reads or vLLM computes); on a CPU cache the
very same code runs without a stream, which is what lets the CPU tests exercise the staging path. The
mirrors are as large as the cache (pinned when it is on a GPU): memory for simplicity, bounded by the cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Literal

import torch

from pd_connector.layout import KVLayout
from pd_connector.transport.base import MemoryType

#: How a worker's KV cache reaches the transport: registered as it is, or through host mirrors.
Path = Literal["direct", "staged"]


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


class HostStaging:
    """Host mirrors of one worker's KV cache buffers and the copies between them, whole blocks at a time."""

    def __init__(self, layout: KVLayout, device_buffers: Sequence[torch.Tensor]) -> None:
        """``device_buffers``: flat ``uint8`` views of the cache's buffers in region order (``byte_views``)."""
        if len(device_buffers) != layout.num_layers * layout.buffers_per_layer:
            raise ValueError(f"{len(device_buffers)} buffers for a layout of {layout.num_layers} layers")
        self._layout = layout
        self._device = list(device_buffers)
        cuda = any(b.is_cuda for b in self._device)
        self._host = [torch.empty(b.numel(), dtype=torch.uint8, pin_memory=cuda) for b in self._device]
        self._stream = torch.cuda.Stream(self._device[0].device) if cuda else None
        sb, st, sh, sk = layout.vector_strides
        span = (
            1
            + (layout.block_tokens - 1) * st
            + (layout.num_kv_heads - 1) * sh
            + (layout.kv_in_buffer - 1) * sk
        )
        self._block_stride = sb * layout.granule_bytes
        self._block_span = span * layout.granule_bytes

    def host_buffers(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the mirrors, in region order: what the transport registers."""
        return [(h.data_ptr(), h.numel()) for h in self._host]

    def to_host(self, layer: int, blocks: Sequence[int]) -> None:
        """P, before pushing ``layer``'s ``blocks``: copy them device -> mirror (returns once they are there)."""
        with self._on_stream(after_compute=True):
            for kv in range(self._layout.buffers_per_layer):
                region = self._layout.region_id(layer, kv)
                for lo, hi in self._spans(blocks):
                    self._host[region][lo:hi].copy_(self._device[region][lo:hi], non_blocking=True)

    def to_device(self, blocks: Sequence[int]) -> None:
        """D, when a load into ``blocks`` ended: copy them mirror -> device in every layer (returns once the
        device holds them, before vLLM computes with them)."""
        with self._on_stream(after_compute=False):
            for region in range(len(self._device)):
                for lo, hi in self._spans(blocks):
                    self._device[region][lo:hi].copy_(self._host[region][lo:hi], non_blocking=True)

    def _spans(self, blocks: Sequence[int]) -> Iterator[tuple[int, int]]:
        """Byte ranges of ``blocks`` in one buffer, consecutive blocks merged."""
        ordered = sorted(set(blocks))
        i = 0
        while i < len(ordered):
            j = i
            while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
                j += 1
            yield ordered[i] * self._block_stride, ordered[j] * self._block_stride + self._block_span
            i = j + 1

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
