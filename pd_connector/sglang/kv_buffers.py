"""Describe an SGLang KV pool to the transfer engine.

Called by the KV manager (``conn.py``) in each SGLang scheduler process when it starts. SGLang's MHA pool
keeps one K and one V buffer per layer, token-major (``[tokens, heads, head_dim]``), and hands them to a
transfer backend as ``KVArgs.kv_data_ptrs`` = all K buffers, then all V buffers; one page of ``page_size``
tokens is ``kv_item_lens[i]`` bytes. The transfer engine wants layer 0 K, layer 0 V, layer 1 K, ... and
blocks of ``block_tokens`` tokens: a page is a block. (A request's metadata rows, SGLang-internal, are read
and written by ``compat.read_first_token`` / ``compat.write_first_token``.)
"""

from __future__ import annotations

from typing import Any

from pd_connector.layout import DTYPE_BYTES, KVLayout


class UnsupportedPool(ValueError):
    """The KV pool is not one the ``pd`` backend can move (MLA, hybrid/state pools, draft KV, ...)."""


def resolve_dtype(kv_cache_dtype: str | None, model_dtype: str | None) -> str:
    """The KV element type as a ``DTYPE_BYTES`` name, from SGLang's ``--kv-cache-dtype`` and ``--dtype``."""
    for candidate in (kv_cache_dtype, model_dtype):
        name = (candidate or "").removeprefix("torch.")
        if name == "half":
            name = "float16"
        if name in DTYPE_BYTES:
            return name
    raise UnsupportedPool(
        f"cannot tell the KV dtype (kv_cache_dtype={kv_cache_dtype!r}, dtype={model_dtype!r}): "
        "pass --dtype (or --kv-cache-dtype) explicitly on prefill and decode servers"
    )


def describe_pool(kv_args: Any, dtype: str, kv_heads: int) -> tuple[KVLayout, list[tuple[int, int]]]:
    """``(layout, buffers)`` for ``TransferEngine`` from SGLang's ``KVArgs`` of an MHA pool.

    ``kv_heads``: KV heads held by this rank (SGLang fills ``KVArgs.kv_head_num`` only on prefill).

    Raises ``UnsupportedPool`` with the reason for pools this backend does not handle.
    """
    if getattr(kv_args, "num_draft_entries", 0):
        raise UnsupportedPool("speculative decoding (draft KV) is not supported by the pd backend")
    if getattr(kv_args, "state_data_ptrs", None) and any(kv_args.state_data_ptrs):
        raise UnsupportedPool("hybrid pools with extra state (mamba, SWA, DSA) are not supported")
    ptrs, lens, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens)
    if not ptrs or len(ptrs) % 2 or len(set(items)) != 1:
        raise UnsupportedPool(
            f"expected K and V buffers of equal page size per layer, got {len(ptrs)} buffers with page "
            f"sizes {sorted(set(items))} (MLA pools are not supported)"
        )
    num_layers = len(ptrs) // 2
    page_size = int(kv_args.page_size)
    heads = int(kv_heads)
    elem = DTYPE_BYTES[dtype]
    head_dim, rest = divmod(items[0], page_size * heads * elem)
    if rest or head_dim <= 0:
        raise UnsupportedPool(
            f"page of {items[0]} bytes is not {page_size} tokens x {heads} heads x {dtype} elements"
        )
    layout = KVLayout(
        num_layers=num_layers,
        block_tokens=page_size,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        kv_split=True,
        token_major=True,
    )
    buffers = []
    for layer in range(num_layers):
        for i in (layer, num_layers + layer):
            # Only whole pages are addressable; a trailing partial page is never a transfer target.
            buffers.append((int(ptrs[i]), int(lens[i]) // layout.block_bytes * layout.block_bytes))
    return layout, buffers
