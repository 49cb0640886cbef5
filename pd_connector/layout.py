"""KV cache layout descriptor, its compatibility hash, and the tensor-parallel head plan.

Who uses it: each engine adapter describes its own KV cache once at start-up (``KVLayout``); the transfer
engine sends it in the handshake, and the prefill side (P) checks the decode side's (D) layout with
``check_compatible`` before any byte moves. A mismatch is refused with a message naming every differing
field, because a silently wrong mapping produces plausible-looking garbage tokens.

Addressing model. Each layer's KV lives in one buffer ("packed": K and V of a token and head side by side, as
vLLM's cache ``[blocks, heads, tokens, K|V]``, or FlashInfer's ``[blocks, 2, tokens, heads, dim]``) or two
("split": a K buffer and a V buffer, as SGLang's ``k_buffer``/``v_buffer`` or FlashAttention's
``[2, blocks, tokens, heads, dim]``); MLA's latent cache ``[blocks, tokens, latent]`` is one buffer with no K/V
and no heads (``mla``). The unit every layout shares is one *vector*: the ``head_dim`` elements of one K or V
(or latent) of one token and head, always contiguous. Where a vector sits in its buffer is given by four
strides in vectors (``vector_strides``: block, token in block, head, K/V), read off the tensor by
``kv_tensors.describe`` (any in-block order: NHD, HND, K/V outermost or innermost, padded or interleaved
blocks). The strides travel in the handshake, so P computes D's addresses from them.

Transports address memory in *granules* (``MemoryRegion.block_bytes``): one vector. Two compatible layouts
always have the same vector size, so a copy list in granules is valid on both sides whatever their block
sizes, in-block orders and TP shares; ``block_mapping.BlockMapping`` turns a request's two block tables into
the contiguous runs (a whole block when both sides agree, a token or head slice when they do not).

Tensor parallelism. Each TP rank holds a contiguous share of the model's KV heads (``rank_heads``, vLLM's
split: replicated when there are more ranks than heads; MLA's single latent "head" is on every rank). A
decode rank takes each of its heads from the first prefill rank holding it (``head_plan``), so a replicated
head (and the latent) is sent once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from pd_connector.transport.base import HOST, MemoryRegion, MemoryType

#: Bytes per element for the dtypes KV caches use (names as ``str(torch.dtype)`` without ``torch.``).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class LayoutMismatch(ValueError):
    """P and D caches cannot be mapped onto each other; ``fields`` names what differs."""

    def __init__(self, message: str, fields: Sequence[str]) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


def rank_heads(tp_size: int, tp_rank: int, total_kv_heads: int) -> range:
    """The model's KV heads TP rank ``tp_rank`` of ``tp_size`` holds (vLLM's split).

    ``tp_size <= total_kv_heads``: equal contiguous shares. More ranks than heads: each head is replicated on
    ``tp_size // total_kv_heads`` consecutive ranks. Other splits are not vLLM's and raise ``ValueError``.
    """
    if not 0 <= tp_rank < tp_size or total_kv_heads <= 0:
        raise ValueError(f"TP rank {tp_rank} of {tp_size} with {total_kv_heads} KV heads")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split evenly over TP {tp_size}")
        per = total_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_kv_heads:
        raise ValueError(f"TP {tp_size} does not replicate {total_kv_heads} KV heads evenly")
    head = tp_rank // (tp_size // total_kv_heads)
    return range(head, head + 1)


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one engine worker's KV cache is laid out in memory (sent in the handshake).

    ``num_kv_heads``: the heads this worker holds. ``kv_split``: False when K and V share one buffer per layer
    (packed), True for separate K and V buffers. ``token_major``: True when tokens are the outer axis of the
    two inside a block (``[tokens, heads, dim]``, NHD), False for heads-major (HND).
    ``tp_size``/``tp_rank``/``total_kv_heads``: the worker's tensor-parallel rank and the model's KV heads
    (``total_kv_heads`` 0: no tensor parallelism). ``mla``: one latent vector per token (``head_dim`` its
    width), no K/V and one "head" every TP rank holds whole. ``strides``: where a vector sits, in vectors, as
    ``(block, token, head, kv)`` (``kv`` 0 when K/V select the buffer or there is none); empty means the
    dense default of the flags: split ``[tokens, heads]``/``[heads, tokens]``, packed with K|V innermost
    (``[tokens, heads, K|V]``/``[heads, tokens, K|V]``, vLLM's CPU cache), MLA ``[tokens]``.
    """

    num_layers: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_split: bool
    token_major: bool
    tp_size: int = 1
    tp_rank: int = 0
    total_kv_heads: int = 0
    mla: bool = False
    strides: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_tokens", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.mla and (self.kv_split or self.model_kv_heads != 1):
            raise ValueError(
                "KVLayout: an MLA cache is one latent buffer per layer with one head on every rank"
            )
        held = rank_heads(self.tp_size, self.tp_rank, self.model_kv_heads)
        if len(held) != self.num_kv_heads:
            raise ValueError(
                f"KVLayout: TP rank {self.tp_rank} of {self.tp_size} holds {len(held)} of the model's "
                f"{self.model_kv_heads} KV heads, not {self.num_kv_heads}"
            )
        if self.strides:
            self._check_strides()

    def _check_strides(self) -> None:
        """Explicit strides must address every vector of a block once and agree with ``token_major``."""
        if len(self.strides) != 4 or min(self.strides) < 0:
            raise ValueError(
                f"KVLayout.strides {self.strides} must be 4 non-negative (block, token, head, kv)"
            )
        sb = self.strides[0]
        extent = 1
        for stride, size in self._in_block_axes():
            if stride < extent:
                raise ValueError(f"KVLayout.strides {self.strides} make vectors of one block overlap")
            extent = stride * size
        if sb < extent:
            raise ValueError(f"KVLayout.strides {self.strides}: blocks of {extent} vectors overlap")
        _, st, sh, _ = self.strides
        if self.num_kv_heads > 1 and self.block_tokens > 1 and (st > sh) != self.token_major:
            raise ValueError(f"KVLayout.strides {self.strides} contradict token_major={self.token_major}")

    def _in_block_axes(self) -> list[tuple[int, int]]:
        """``(stride, size)`` of the token, head and K/V axes that have more than one entry, by stride."""
        _, st, sh, sk = self.vector_strides
        axes = [(st, self.block_tokens), (sh, self.num_kv_heads), (sk, self.kv_in_buffer)]
        return sorted((a for a in axes if a[1] > 1), key=lambda a: a[0])

    @property
    def block_extent(self) -> int:
        """Vectors one block occupies from its first vector, holes inside included, padding between blocks
        excluded: the block stride of a dense copy of the cache (``staging``'s host slots)."""
        return max([1, *(stride * size for stride, size in self._in_block_axes())])

    @property
    def block_span(self) -> int:
        """Vectors from a block's first vector to its last, inclusive: what a copy of one block must cover."""
        return 1 + sum(stride * (size - 1) for stride, size in self._in_block_axes())

    @property
    def model_kv_heads(self) -> int:
        """The model's KV heads (over all TP ranks)."""
        return self.total_kv_heads or self.num_kv_heads * self.tp_size

    @property
    def heads(self) -> range:
        """The model's KV heads this worker holds, in the order of its cache."""
        return rank_heads(self.tp_size, self.tp_rank, self.model_kv_heads)

    def at_rank(self, tp_rank: int) -> KVLayout:
        """The layout of another TP rank of the same engine (same shape per head, its own heads)."""
        heads = rank_heads(self.tp_size, tp_rank, self.model_kv_heads)
        strides = self.strides if len(heads) == self.num_kv_heads else ()
        return msgspec.structs.replace(self, tp_rank=tp_rank, num_kv_heads=len(heads), strides=strides)

    @property
    def buffers_per_layer(self) -> int:
        """1 for packed K/V (or MLA), 2 for split (K buffer, then V buffer)."""
        return 2 if self.kv_split else 1

    @property
    def kv_in_buffer(self) -> int:
        """Vectors per token and head in one buffer: 2 when K and V share it, 1 when split or MLA."""
        return 1 if self.kv_split or self.mla else 2

    @property
    def vector_strides(self) -> tuple[int, int, int, int]:
        """``(block, token, head, kv)`` strides in vectors (the explicit ``strides`` or the flags' default)."""
        if self.strides:
            sb, st, sh, sk = self.strides
            return sb, st, sh, sk
        heads, tokens, kv = self.num_kv_heads, self.block_tokens, self.kv_in_buffer
        block = heads * tokens * kv
        sk = 1 if kv == 2 else 0
        if self.token_major:
            return block, heads * kv, kv, sk
        return block, kv, tokens * kv, sk

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's data in one buffer of one layer."""
        return self.num_kv_heads * self.kv_in_buffer * self.granule_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's data in one buffer (its stride too, unless ``strides`` pad blocks)."""
        return self.token_bytes * self.block_tokens

    @property
    def granule_tokens(self) -> int:
        """Tokens a pushed range is widened to: 1 for token-major layouts, a block for heads-major ones
        (whose blocks then move whole, one run each, not a run per head)."""
        return 1 if self.token_major else self.block_tokens

    @property
    def granule_bytes(self) -> int:
        """Bytes of one granule (the transports' addressing unit): one vector of ``head_dim`` elements."""
        return self.head_dim * DTYPE_BYTES[self.dtype]

    def compat_hash(self) -> str:
        """Hex SHA-256 of the canonical encoding: equal hashes mean identical layouts (fast path)."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()

    def regions(self, buffers: Sequence[tuple[int, int]], memory: MemoryType = HOST) -> list[MemoryRegion]:
        """Turn the adapter's buffers into transport regions addressed in granules (vectors).

        ``buffers`` lists ``(address, length_bytes)`` in order layer 0 (K or packed), layer 0 V (split only),
        layer 1, ...; region ids are the list indices (``region_id(layer, kv)``). ``memory``: where the
        buffers live (``transport.base.HOST`` or ``CUDA``).
        """
        expected = self.num_layers * self.buffers_per_layer
        if len(buffers) != expected:
            raise ValueError(
                f"layout has {self.num_layers} layers x {self.buffers_per_layer} buffers = {expected}, "
                f"got {len(buffers)} buffers"
            )
        regions = []
        for i, (address, length) in enumerate(buffers):
            if length % self.granule_bytes or length < self.block_bytes:
                raise ValueError(
                    f"buffer {i} is {length} bytes, not a whole number of {self.granule_bytes}-byte vectors "
                    f"holding at least one {self.block_bytes}-byte block"
                )
            regions.append(MemoryRegion(i, address, length, self.granule_bytes, memory))
        return regions

    def region_id(self, layer: int, kv: int = 0) -> int:
        """Region id of ``layer``'s buffer ``kv`` (0: K or packed, 1: V when split)."""
        return layer * self.buffers_per_layer + kv


_MUST_MATCH = ("num_layers", "model_kv_heads", "head_dim", "dtype", "kv_split", "mla")
_WHY = {
    "kv_split": "K and V in one buffer per layer on one side and in two on the other (copies name one region)",
    "mla": "an MLA latent cache on one side and a K/V cache on the other",
}


def check_compatible(prefill: KVLayout, decode: KVLayout) -> None:
    """Raise ``LayoutMismatch`` unless P's vectors can be copied into D's.

    What must be equal is what a vector *is* (layers, the model's KV heads, head size, dtype, K/V packed or
    split, MLA or not). Everything else is mapped: block sizes, in-block order (NHD/HND, where K/V sit),
    padded blocks and TP sizes; a pair that agrees on little moves in small runs (a vector each at worst)
    but moves exactly.
    """
    fields = [name for name in _MUST_MATCH if getattr(prefill, name) != getattr(decode, name)]
    diffs = [
        f"{name}: prefill {getattr(prefill, name)!r} vs decode {getattr(decode, name)!r}"
        + (f" ({_WHY[name]})" if name in _WHY else "")
        for name in fields
    ]
    if diffs:
        raise LayoutMismatch("KV layout mismatch: " + "; ".join(diffs), fields)


class HeadSlice(msgspec.Struct, frozen=True):
    """Heads ``[dst_head, dst_head + num_heads)`` of a D rank come from heads ``[src_head, ...)`` of P rank
    ``prefill_rank`` (head indices local to each rank's cache)."""

    prefill_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def _first_holder(prefill_tp: int, total: int, head: int) -> int:
    """The first P rank holding ``head``: the one that sends it (a replicated head is sent once)."""
    return next(r for r in range(prefill_tp) if head in rank_heads(prefill_tp, r, total))


def head_plan(prefill_tp: int, decode: KVLayout) -> list[HeadSlice]:
    """Where each of D rank's heads comes from, as few slices as possible (one per P rank involved)."""
    total = decode.model_kv_heads
    mine = decode.heads
    plan: list[HeadSlice] = []
    for local, head in enumerate(mine):
        rank = _first_holder(prefill_tp, total, head)
        src = head - rank_heads(prefill_tp, rank, total).start
        last = plan[-1] if plan else None
        if last is not None and last.prefill_rank == rank and last.src_head + last.num_heads == src:
            plan[-1] = HeadSlice(rank, last.src_head, last.dst_head, last.num_heads + 1)
        else:
            plan.append(HeadSlice(rank, src, local, 1))
    return plan


def fanout(prefill: KVLayout, decode_tp: int) -> int:
    """How many D ranks (of a decode engine with TP ``decode_tp``) take heads from this P rank; 0: none
    (every head it holds is replicated and sent by a lower rank), so it never holds blocks for a decode."""
    return sum(
        any(
            s.prefill_rank == prefill.tp_rank
            for s in head_plan(prefill.tp_size, _rank_of(prefill, decode_tp, r))
        )
        for r in range(decode_tp)
    )


def sends_heads(prefill: KVLayout) -> bool:
    """Whether this P rank is the first holder of any of its heads (else every D rank takes them elsewhere)."""
    total = prefill.model_kv_heads
    return any(_first_holder(prefill.tp_size, total, h) == prefill.tp_rank for h in prefill.heads)


def _rank_of(model: KVLayout, tp_size: int, tp_rank: int) -> KVLayout:
    """A layout of rank ``tp_rank`` of an engine with TP ``tp_size`` serving ``model``'s KV heads."""
    total = model.model_kv_heads
    heads = rank_heads(tp_size, tp_rank, total)
    # Explicit strides describe ``model``'s own head count; another count gets the flags' default strides.
    strides = model.strides if len(heads) == model.num_kv_heads else ()
    return msgspec.structs.replace(
        model,
        tp_size=tp_size,
        tp_rank=tp_rank,
        num_kv_heads=len(heads),
        total_kv_heads=total,
        strides=strides,
    )
