"""What SGLang's layer-wise push reads of a prefill forward pass, and the two hooks it puts around it.

Part of ``pd_connector.sglang.compat`` (its docstring lists who calls what; these names are re-exported
there and checked at start through its ``SYMBOLS``). ``plugin.register`` calls ``hook_layerwise``; the hooks
in ``pd_connector.sglang.layerwise`` call ``prefill_kv_manager`` and ``written_layer``;
``PdKVManager.plan_forward`` calls ``layerwise_problem``, ``page_size`` and ``forward_requests``. Imports no
SGLang until a function runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

#: The two hook targets (``HookRegistry`` names them by dotted path).
RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
SET_KV_BUFFER = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer"


def hook_layerwise(run_batch_hook: Callable[..., Any], set_kv_buffer_hook: Callable[..., Any]) -> None:
    """Put ``run_batch_hook(original_fn, scheduler, batch, ...)`` AROUND ``Scheduler.run_batch`` and
    ``set_kv_buffer_hook(result, pool, layer, ...)`` AFTER ``MHATokenToKVPool.set_kv_buffer`` (SGLang applies
    them to the classes, so every instance and every subclass that does not override the method gets them)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RUN_BATCH, run_batch_hook, HookType.AROUND)
    HookRegistry.register(SET_KV_BUFFER, set_kv_buffer_hook, HookType.AFTER)


class ForwardRequest(NamedTuple):
    """What one request of a prefill batch is about to compute, read before the forward pass."""

    room: int  # bootstrap room
    prefix_tokens: int  # tokens whose KV is in the pool before this forward (device-resident prefix)
    end_tokens: int  # prompt tokens whose KV is in the pool after it
    input_tokens: int  # prompt length
    pages: list[int]  # the request's pages holding tokens [0, end_tokens), in token order
    #: Hash of the prompt up to its first token computed here: requests of one batch that share it may have
    #: their pages swapped for another's cached copy after the forward (SGLang's radix cache deduplicates).
    lead: int


def prefill_kv_manager(scheduler: Any) -> Any:
    """The KV manager of a prefill scheduler (None on other servers)."""
    return getattr(getattr(scheduler, "disagg_prefill_bootstrap_queue", None), "kv_manager", None)


def page_size(scheduler: Any) -> int:
    return int(scheduler.token_to_kv_pool_allocator.page_size)


def layerwise_problem(scheduler: Any) -> str | None:
    """Why P cannot push layer by layer (None when it can): the KV pool must be in host memory, where a layer is
    in the pool when ``set_kv_buffer`` returns (on a GPU the write is still queued on a stream)."""
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    device = str(getattr(pool, "device", "unknown"))
    if device != "cpu":
        return f"the KV pool is on {device}, and a layer's write is not waited for there"
    return None


def forward_requests(scheduler: Any, batch: Any, manager: Any) -> list[ForwardRequest]:
    """The requests of prefill ``batch`` whose KV ``manager`` sends and whose decode side has bootstrapped
    (an optimistic prefill still bootstrapping sends nothing yet, as in SGLang's ``_send_kv_chunk``)."""
    if not batch.forward_mode.is_extend():
        return []
    from sglang.srt.mem_cache.common import kv_to_page_indices

    size = page_size(scheduler)
    allocator = scheduler.token_to_kv_pool_allocator
    requests = []
    for req in batch.reqs:
        sender = getattr(req, "disagg_kv_sender", None)
        if getattr(sender, "kv_mgr", None) is not manager or req.pending_bootstrap or req.extend_end is None:
            continue
        input_tokens = len(req.origin_input_ids)
        end = min(int(req.extend_end), input_tokens)
        tokens = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :end]
        pages = kv_to_page_indices(allocator.translate_kv_indices_for_transfer(tokens), size)
        prefix = int(req.prefix_len) - int(req.host_hit_length)
        requests.append(
            ForwardRequest(
                room=int(req.bootstrap_room),
                prefix_tokens=prefix,
                end_tokens=end,
                input_tokens=input_tokens,
                pages=[int(p) for p in pages],
                lead=hash(tuple(req.origin_input_ids[: prefix + 1])),
            )
        )
    return requests


def written_layer(pool: Any, layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The pool layer ``set_kv_buffer(layer, loc_info, cache_k, cache_v, k_scale, v_scale, layer_id_override,
    ...)`` wrote (``args``/``kwargs``: its arguments after ``layer``), counted from the pool's first layer."""
    override = kwargs.get("layer_id_override", args[5] if len(args) > 5 else None)
    layer_id = override if override is not None else layer.layer_id
    return int(layer_id) - int(getattr(pool, "start_layer", 0) or 0)
