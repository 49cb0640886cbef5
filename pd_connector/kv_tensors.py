"""Read a KV cache layout off the tensors themselves: shape, strides, dtype and device, whatever the engine.

Who calls it: an engine adapter's compat module at start-up (``pd_connector.vllm.compat.kv_layout``), which
knows what each axis of its engine's cache tensors *means* and says so with an axes string; this module
finds where every vector *is* from the strides, so one function covers vLLM's CPU cache, FlashAttention's
``[2, blocks, tokens, heads, dim]``, FlashInfer's ``[blocks, 2, tokens, heads, dim]``, their HND
permutations (vLLM allocates the permuted order and hands out a permuted view: same shape, other strides),
blocks padded or interleaved with other layers' pages, and MLA's latent ``[blocks, tokens, latent]``.

Axes letters: ``b`` blocks, ``t`` tokens in a block, ``h`` KV heads, ``k`` K/V (size 2), ``d`` the vector
(head dim, or the latent width). ``d`` must be contiguous. ``k`` outermost (its stride past all blocks)
makes two buffers per layer (split); anywhere else K and V share the buffer (packed). No ``k`` and no ``h``
is MLA's latent cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pd_connector.layout import KVLayout
from pd_connector.transport.base import CUDA, HOST, MemoryType

if TYPE_CHECKING:
    import torch

_AXES = "bthkd"


@dataclass(frozen=True)
class KVTensors:
    """What ``describe`` found: the layout, each buffer as ``(address, bytes)`` in region order, and where
    the buffers live."""

    layout: KVLayout
    buffers: list[tuple[int, int]]
    memory: MemoryType


def memory_type(device: torch.device) -> MemoryType:
    """Map a torch device to a region memory type (``ValueError`` for devices no transport can reach)."""
    if device.type == "cpu":
        return HOST
    if device.type == "cuda":
        return CUDA
    raise ValueError(f"KV cache on {device}: PDConnector moves host (cpu) and cuda memory only")


def describe(
    tensors: Sequence[torch.Tensor], axes: str, tp_size: int = 1, tp_rank: int = 0, total_kv_heads: int = 0
) -> KVTensors:
    """Describe equal per-layer KV cache tensors whose axes mean ``axes`` (one letter per dimension), held
    by TP rank ``tp_rank`` of ``tp_size`` of a model with ``total_kv_heads`` (0: no tensor parallelism).

    Raises ``ValueError`` naming the problem when the layers differ, an axis is missing or repeated, the
    vector is not contiguous, vectors overlap, or a dtype or device is not one a transport moves.
    """
    if not tensors:
        raise ValueError("PDConnector needs at least one KV cache layer")
    first = tensors[0]
    if len(axes) != first.dim() or len(set(axes)) != len(axes) or set(axes) - set(_AXES):
        raise ValueError(f"axes {axes!r} must name each of the {first.dim()} dimensions once, from {_AXES!r}")
    if not {"b", "t", "d"} <= set(axes) or ("k" in axes) != ("h" in axes):
        raise ValueError(f"axes {axes!r}: need b, t and d, and k with h (or neither: MLA's latent)")
    for t in tensors[1:]:
        if (t.shape, t.stride(), t.dtype, t.device) != (
            first.shape,
            first.stride(),
            first.dtype,
            first.device,
        ):
            raise ValueError(
                f"PDConnector needs equal layers: {tuple(t.shape)}/{t.stride()} {t.dtype} on {t.device} vs "
                f"{tuple(first.shape)}/{first.stride()} {first.dtype} on {first.device}"
            )
    size = dict(zip(axes, first.shape, strict=True))
    stride = dict(zip(axes, first.stride(), strict=True))
    size.setdefault("h", 1)
    size.setdefault("k", 1)
    if stride["d"] != 1 and size["d"] > 1:
        raise ValueError(
            f"KV cache {tuple(first.shape)} strides {first.stride()}: the {axes!r} d axis is not contiguous"
        )
    if size["k"] not in (1, 2) or ("k" in axes and size["k"] != 2):
        raise ValueError(f"KV cache {tuple(first.shape)}: the K/V axis has {size['k']} entries, not 2")
    vec = size["d"]
    vectors = {a: stride.get(a, 0) // vec for a in "bthk"}
    if any(stride.get(a, 0) % vec for a in "bthk"):
        raise ValueError(f"KV cache strides {first.stride()} do not keep {vec}-element vectors whole")
    blocks = size["b"]
    # K/V outermost: all of K's blocks come before V's first vector, so each is a buffer of its own (a tie
    # of strides, one block, goes by the order of the axes).
    outer = "k" in axes and (stride["k"], -axes.index("k")) > (stride["b"], -axes.index("b"))
    split = outer and vectors["k"] >= (blocks - 1) * vectors["b"] + _extent(size, vectors, "th")
    dtype = str(first.dtype).removeprefix("torch.")
    layout = KVLayout(
        num_layers=len(tensors),
        block_tokens=size["t"],
        num_kv_heads=size["h"],
        head_dim=vec,
        dtype=dtype,
        kv_split=split,
        # By the strides, also for one head (a TP rank's share of vLLM's [blocks, heads, tokens, K|V] stays
        # heads-major, so its blocks move whole as on every other TP size); MLA's latent has no heads.
        token_major="k" not in axes or size["t"] == 1 or vectors["t"] > vectors["h"],
        tp_size=tp_size,
        tp_rank=tp_rank,
        total_kv_heads=total_kv_heads,
        mla="k" not in axes,
        strides=(vectors["b"], vectors["t"], vectors["h"], 0 if split else vectors["k"]),
    )
    in_buffer = "th" if split else "thk"
    length = ((blocks - 1) * vectors["b"] + _extent(size, vectors, in_buffer)) * vec * first.element_size()
    buffers: list[tuple[int, int]] = []
    for t in tensors:
        base = t.data_ptr()
        buffers.append((base, length))
        if split:
            buffers.append((base + vectors["k"] * vec * first.element_size(), length))
    return KVTensors(layout, buffers, memory_type(first.device))


def _extent(size: dict[str, int], vectors: dict[str, int], axes: str) -> int:
    """Vectors from a block's first to its last vector (inclusive) over ``axes``."""
    return 1 + sum((size[a] - 1) * vectors[a] for a in axes)
