"""Byte views of vLLM's per-layer KV cache tensors, one row per block, for zero-copy socket I/O.

Called once by the worker-side connector in ``register_kv_caches`` (worker process). vLLM's CPU attention
backend stores each layer as ``[num_blocks, num_kv_heads, block_size, head_size_k + head_size_v]`` (layout
LBHNC), so one block of one layer is one contiguous run of bytes; layouts that put K and V (or anything
else) in front of the block dimension are refused with a clear error rather than transferred wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


class KVLayers:
    """The KV cache of every attention layer as ``uint8[num_blocks, block_bytes]`` numpy views."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("PDConnector needs at least one KV cache layer")
        self.names: list[str] = list(kv_caches)
        self.index: dict[str, int] = {name: i for i, name in enumerate(self.names)}
        self.blocks: list[np.ndarray] = []
        dtypes = set()
        for name, tensor in kv_caches.items():
            if tensor.device.type != "cpu":
                raise ValueError(f"{name}: PDConnector reads KV from host memory, got device {tensor.device}")
            if tensor.shape[0] != num_blocks or not tensor.is_contiguous():
                raise ValueError(
                    f"{name}: KV cache shape {tuple(tensor.shape)} is not block-major contiguous with "
                    f"{num_blocks} blocks in dim 0 (PDConnector supports the CPU LBHNC layout)"
                )
            self.blocks.append(tensor.view(torch.uint8).reshape(num_blocks, -1).numpy())
            dtypes.add(str(tensor.dtype).removeprefix("torch."))
        sizes = {arr.shape[1] for arr in self.blocks}
        if len(sizes) != 1 or len(dtypes) != 1:
            raise ValueError(f"layers differ in block bytes {sizes} or dtype {dtypes}")
        self.block_bytes: int = sizes.pop()
        self.dtype: str = dtypes.pop()
        self.num_blocks = num_blocks

    @property
    def num_layers(self) -> int:
        return len(self.blocks)


def contiguous_runs(indices: list[int], block_ids: list[int]) -> list[tuple[int, int]]:
    """Group ``block_ids[i] for i in indices`` into ``(first_block, count)`` runs of consecutive blocks.

    Both sides walk the same request-relative indices in order, so each side coalesces its own blocks
    independently and the byte stream stays aligned: few large socket calls instead of one per block.
    """
    runs: list[tuple[int, int]] = []
    for i in indices:
        block = block_ids[i]
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs
