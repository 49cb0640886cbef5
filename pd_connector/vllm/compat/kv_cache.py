"""The KV cache as vLLM hands it to PDConnector: which caches it can move, this worker's TP rank, the layout.

Part of ``pd_connector.vllm.compat``. ``PDConnector.__init__`` (EngineCore and every worker) calls
``check_kv_cache`` and ``tp_rank`` at start; ``WorkerSide.register_kv_caches`` calls ``kv_layout`` with vLLM's
per-layer views. vLLM does not promise its KV cache specs, process-group state or cache view shapes: they are
read here only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pd_connector.kv_tensors import KVTensors, describe

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class TPRank:
    """This worker's place in tensor parallelism: its rank, the engine's TP size, the model's KV heads."""

    rank: int = 0
    size: int = 1
    total_kv_heads: int = 0  # 0: the heads this worker holds (no tensor parallelism)
    mla: bool = False  # the cache is MLA's latent: one "head" every rank holds whole


def kv_cache_problem(kv_cache_config: KVCacheConfig) -> str | None:
    """Why PDConnector cannot move this model's KV cache, or None.

    It moves one full-attention cache whose block table covers every token (what the scheduler side plans
    with ``get_block_ids()[0]``): K/V heads, or MLA's latent (DeepSeek-V2/V3: one vector per token). A hybrid
    model has several KV cache groups (full attention next to sliding window or Mamba/SSM state), and
    sliding-window, state and DeepSeek-V4's sparse or fp8 MLA caches lay out or drop tokens differently:
    moving only the first group would leave the others empty and decode from them. MLA on vLLM's CPU platform
    is refused too: its CPU MLA backend gives one prompt other greedy tokens when other requests share its
    prefill batch (measured without any transfer), and a P->D run answered differently from P (docs/architecture.md
    ``## GPU KV caches and attention layouts``).
    """
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    kinds = [type(group.kv_cache_spec).__name__ for group in groups]
    if len(groups) != 1:
        return (
            f"a hybrid model ({len(groups)} KV cache groups: {', '.join(kinds)}); PDConnector moves one "
            "full-attention cache and supports no hybrid, sliding-window or Mamba/SSM state caches"
        )
    spec = groups[0].kv_cache_spec
    plain_mla = (
        type(spec) is MLAAttentionSpec
        and spec.model_version is None
        and spec.alignment is None
        and spec.cache_dtype_str in (None, "auto")
    )
    if type(spec) is not FullAttentionSpec and not plain_mla:
        return (
            f"a {kinds[0]} KV cache; PDConnector moves full-attention and plain MLA caches only (no sparse or "
            "fp8 MLA, sliding-window, chunked-local or Mamba/SSM state caches)"
        )
    if plain_mla and current_platform.is_cpu():
        return (
            "an MLA model on vLLM's CPU platform, whose MLA backend answers a prompt differently when other "
            "requests share its prefill batch, so a P->D answer cannot be checked against P's (not supported; "
            "docs/architecture.md)"
        )
    return None


def check_kv_cache(kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, at start and naming it, a model whose KV cache PDConnector cannot move (``ValueError``)."""
    problem = None if kv_cache_config is None else kv_cache_problem(kv_cache_config)
    if problem is not None:
        raise ValueError(f"PDConnector cannot serve this model: {problem}")


def tp_rank(vllm_config: VllmConfig) -> TPRank:
    """The calling worker's TP rank (vLLM's process-group state), the engine's TP size and the model's KV
    heads; refuses what PDConnector does not support (pipeline parallelism) at start, naming it."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"PDConnector does not support pipeline parallelism (pipeline_parallel_size "
            f"{parallel.pipeline_parallel_size}); use tensor parallelism"
        )
    size = parallel.tensor_parallel_size
    rank = get_tensor_model_parallel_rank() if size > 1 else 0
    model = vllm_config.model_config
    return TPRank(rank, size, model.get_total_num_kv_heads(), bool(model.use_mla))


def kv_layout(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int, tp: TPRank | None = None, block_size: int = 0
) -> KVTensors:
    """Describe this worker's KV cache from vLLM's per-layer views and list its buffers (``kv_tensors``).

    vLLM 0.32 hands every layer's cache, on every device and attention backend, as a ``[blocks, heads,
    tokens, C]`` view whose strides follow its ``KVCacheLayout`` (NHD or HND, layers outermost or inside each
    block): ``C`` is K then V of one head and token, or MLA's latent (one "head"). An attention backend whose
    kernels take blocks smaller than the KV manager's (``block_size`` tokens, 0: not checked) gets the cache
    as ``num_blocks * r`` kernel blocks of ``block_size / r`` tokens; the layout then describes a kernel block
    (``block_mapping.kernel_block_ids`` maps the manager's block tables onto them). Other shapes (kernel blocks of a
    packed cache, with other layers' pages between them; an odd ``C``) are refused with a clear error.
    """
    tp = tp or TPRank()
    tensors = list(kv_caches.values())
    for name, tensor in kv_caches.items():
        blocks = num_blocks * _kernel_blocks_per_block(name, tensor, num_blocks, block_size)
        if tensor.dim() != 4 or tensor.shape[0] != blocks or (not tp.mla and tensor.shape[3] % 2):
            raise ValueError(
                f"{name}: KV cache {tuple(tensor.shape)} on {tensor.device} is not vLLM's "
                f"[{num_blocks} blocks, heads, block_size, {'latent' if tp.mla else 'head_k + head_v'}] "
                "PDConnector supports"
            )
    if tp.mla:
        views, axes = [t[:, 0] for t in tensors], "btd"
    else:
        views, axes = [t.unflatten(-1, (2, t.shape[-1] // 2)) for t in tensors], "bhtkd"
    return describe(views, axes, tp.size, tp.rank, 1 if tp.mla else tp.total_kv_heads)


def _kernel_blocks_per_block(name: str, tensor: torch.Tensor, num_blocks: int, block_size: int) -> int:
    """How many kernel blocks make one KV manager block in ``tensor`` (1: the cache is in manager blocks).

    vLLM splits manager block ``b`` into kernel blocks ``b * r .. b * r + r - 1`` of an unpacked cache; a
    packed cache's kernel blocks sit ``kernel_block_stride`` apart with other layers' pages between them, which
    this refuses, naming both block sizes."""
    if tensor.dim() != 4 or not 0 < tensor.shape[2] < block_size:
        return 1
    kernel = tensor.shape[2]
    per_block = block_size // kernel
    if block_size % kernel or tensor.shape[0] != num_blocks * per_block:
        raise ValueError(
            f"{name}: KV cache {tuple(tensor.shape)} holds kernel blocks of {kernel} tokens, KV manager blocks "
            f"hold {block_size}, but not as {block_size / kernel:g} consecutive kernel blocks per manager block "
            f"({num_blocks} manager blocks); PDConnector maps only that split (run vLLM with --block-size "
            f"{kernel})"
        )
    return per_block
