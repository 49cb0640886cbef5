"""KV cache layout descriptor, its compatibility hash, and the P-block -> D-block copy mapping.

Who uses it: each engine adapter describes its own KV cache once at start-up (``KVLayout``); the transfer
engine sends it in the handshake, and the prefill side (P) checks the decode side's (D) layout with
``check_compatible`` before any byte moves. A mismatch is refused with a message naming every differing
field, because a silently wrong mapping produces plausible-looking garbage tokens.

Addressing model. Each layer's KV lives in one buffer ("packed": K and V interleaved in every block, as
vLLM's CPU cache ``[blocks, heads, tokens, K|V]``) or two ("split": a K buffer and a V buffer, as SGLang's
``k_buffer``/``v_buffer`` or flash-attention's ``[2, blocks, tokens, heads, dim]``). Buffers are arrays of
equal blocks of ``block_tokens`` tokens. Within a block the data is either token-major
(``[tokens, heads, dim]``: a block is a run of per-token slices, so any token range is contiguous) or
heads-major (``[heads, tokens, dim]``: each head's part of a block is contiguous).

Transports address memory in *granules* (``MemoryRegion.block_bytes``): one token (all its heads) for
token-major layouts, one head of one block for heads-major layouts. Two compatible layouts always have the
same granule size in bytes, so a copy list in granules is valid on both sides even when P and D use different
block sizes (token-major) or hold different KV heads (heads-major).

Tensor parallelism. Each TP rank holds a contiguous share of the model's KV heads (``rank_heads``, vLLM's
split: replicated when there are more ranks than heads). A decode rank takes each of its heads from the first
prefill rank holding it (``head_plan``), so a replicated head is sent once; a P rank and a D rank of different
TP sizes exchange a head range of every block: one run per block, whatever the number of tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from pd_connector.transport.base import BlockCopy, MemoryRegion
from pd_connector.transport.coalesce import coalesce

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
    (packed), True for separate K and V buffers. ``token_major``: True when tokens are the outermost axis
    inside a block (``[tokens, heads, dim]``). ``tp_size``/``tp_rank``/``total_kv_heads``: the worker's
    tensor-parallel rank and the model's KV heads (``total_kv_heads`` 0: no tensor parallelism).
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

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_tokens", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        held = rank_heads(self.tp_size, self.tp_rank, self.model_kv_heads)
        if len(held) != self.num_kv_heads:
            raise ValueError(
                f"KVLayout: TP rank {self.tp_rank} of {self.tp_size} holds {len(held)} of the model's "
                f"{self.model_kv_heads} KV heads, not {self.num_kv_heads}"
            )

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
        return msgspec.structs.replace(self, tp_rank=tp_rank, num_kv_heads=len(heads))

    @property
    def buffers_per_layer(self) -> int:
        """1 for packed K/V, 2 for split (K buffer, then V buffer)."""
        return 2 if self.kv_split else 1

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in one buffer of one layer."""
        kv = 1 if self.kv_split else 2
        return self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype] * kv

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one buffer (the stride between blocks)."""
        return self.token_bytes * self.block_tokens

    @property
    def granule_tokens(self) -> int:
        """Tokens per transport addressing unit: 1 for token-major layouts, a block for heads-major ones."""
        return 1 if self.token_major else self.block_tokens

    @property
    def granules_per_block(self) -> int:
        """Granules in one block: one per token (token-major), one per head (heads-major)."""
        return self.block_tokens if self.token_major else self.num_kv_heads

    @property
    def granule_bytes(self) -> int:
        """Bytes of one granule: a token with all its heads, or one head's part of a block."""
        return self.block_bytes // self.granules_per_block

    def compat_hash(self) -> str:
        """Hex SHA-256 of the canonical encoding: equal hashes mean identical layouts (fast path)."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()

    def regions(self, buffers: Sequence[tuple[int, int]]) -> list[MemoryRegion]:
        """Turn the adapter's buffers into transport regions addressed in granules.

        ``buffers`` lists ``(address, length_bytes)`` in order layer 0 (K or packed), layer 0 V (split only),
        layer 1, ...; region ids are the list indices (``region_id(layer, kv)``).
        """
        expected = self.num_layers * self.buffers_per_layer
        if len(buffers) != expected:
            raise ValueError(
                f"layout has {self.num_layers} layers x {self.buffers_per_layer} buffers = {expected}, "
                f"got {len(buffers)} buffers"
            )
        regions = []
        for i, (address, length) in enumerate(buffers):
            if length % self.block_bytes:
                raise ValueError(
                    f"buffer {i} is {length} bytes, not a whole number of {self.block_bytes}-byte blocks"
                )
            regions.append(MemoryRegion(i, address, length, self.granule_bytes))
        return regions

    def region_id(self, layer: int, kv: int = 0) -> int:
        """Region id of ``layer``'s buffer ``kv`` (0: K or packed, 1: V when split)."""
        return layer * self.buffers_per_layer + kv


_MUST_MATCH = ("num_layers", "model_kv_heads", "head_dim", "dtype", "kv_split")


def check_compatible(prefill: KVLayout, decode: KVLayout) -> None:
    """Raise ``LayoutMismatch`` unless P's blocks can be copied into D's blocks granule by granule.

    Different block sizes are mapped when both sides are token-major (a D block of 32 tokens is two
    P blocks of 16 laid end to end); heads-major blocks of different sizes interleave heads and tokens
    differently and are refused. K/V packed versus split changes the byte order inside every token and
    is refused as well. Different TP sizes (different heads per rank) need heads-major blocks, where a head's
    part of a block is contiguous; token-major caches would need a write per token and head (refused).
    """
    diffs = [
        f"{name}: prefill {getattr(prefill, name)!r} vs decode {getattr(decode, name)!r}"
        for name in _MUST_MATCH
        if getattr(prefill, name) != getattr(decode, name)
    ]
    fields = [name for name in _MUST_MATCH if getattr(prefill, name) != getattr(decode, name)]
    if prefill.tp_size != decode.tp_size and (prefill.token_major or decode.token_major):
        fields.append("tp_size")
        diffs.append(
            f"tp_size: prefill {prefill.tp_size} vs decode {decode.tp_size} with a token-major cache: "
            "different tensor parallelism needs heads-major blocks (or equal TP sizes)"
        )
    if prefill.token_major and decode.token_major:
        pass  # any block sizes map token by token
    elif prefill.block_tokens != decode.block_tokens or prefill.token_major != decode.token_major:
        fields.append("block_tokens" if prefill.block_tokens != decode.block_tokens else "token_major")
        diffs.append(
            f"block_tokens {prefill.block_tokens} vs {decode.block_tokens}, token_major "
            f"{prefill.token_major} vs {decode.token_major}: a heads-major block ([heads, tokens, dim]) "
            "is only contiguous as a whole, so both sides need the same block size and in-block order"
        )
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
    return msgspec.structs.replace(
        model, tp_size=tp_size, tp_rank=tp_rank, num_kv_heads=len(heads), total_kv_heads=total
    )


@dataclass(frozen=True)
class BlockMapping:
    """Copies one token range of a request from P's block table into D's (both in token order)."""

    prefill: KVLayout
    decode: KVLayout

    def runs(
        self,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        start_token: int,
        end_token: int,
        heads: HeadSlice | None = None,
    ) -> list[tuple[int, int, int]]:
        """Coalesced ``(src granule, dst granule, granules)`` runs moving tokens ``[start_token, end_token)``,
        sorted by source (merged by the transports' coalescer, ``transport.coalesce``).

        ``heads``: the head slice D takes from this P (None: every head; both sides hold the same ones). The
        same runs serve every layer (only the region differs), so callers compute them once per range.
        Heads-major layouts copy whole blocks (of the slice's heads), so the range is widened to block
        boundaries. Raises ``ValueError`` when a table is too short for the range, the slice does not fit or
        D's table names a block twice.
        """
        g = self.prefill.granule_tokens
        start, end = (start_token // g) * g, -(-end_token // g) * g
        ps, ds = self.prefill.block_tokens, self.decode.block_tokens
        if end > len(src_blocks) * ps or end > len(dst_blocks) * ds:
            raise ValueError(
                f"tokens [{start}, {end}) exceed the block tables: prefill {len(src_blocks)} x {ps}, "
                f"decode {len(dst_blocks)} x {ds} tokens"
            )
        hp, hd = self.prefill.granules_per_block, self.decode.granules_per_block
        if self.prefill.token_major:
            if heads is not None and heads.num_heads != self.prefill.num_kv_heads:
                raise ValueError("a token-major cache moves every head of a token (no head slices)")
            src_head, dst_head, width = 0, 0, 1
        else:
            sl = heads or HeadSlice(0, 0, 0, self.prefill.num_kv_heads)
            if sl.src_head + sl.num_heads > hp or sl.dst_head + sl.num_heads > hd or sl.num_heads <= 0:
                raise ValueError(f"head slice {sl} does not fit {hp} prefill and {hd} decode heads")
            src_head, dst_head, width = sl.src_head, sl.dst_head, sl.num_heads
        spans: list[BlockCopy] = []
        t = start
        while t < end:
            # Cut at the next block boundary on either side: inside that span both sides are contiguous.
            nxt = min(end, (t // ps + 1) * ps, (t // ds + 1) * ds)
            if self.prefill.token_major:
                src = src_blocks[t // ps] * ps + t % ps
                dst = dst_blocks[t // ds] * ds + t % ds
                n = nxt - t
            else:  # one whole block (equal block sizes): the slice's heads of it
                src = src_blocks[t // ps] * hp + src_head
                dst = dst_blocks[t // ds] * hd + dst_head
                n = width
            spans.append(BlockCopy(0, src, dst, n))
            t = nxt
        return [(src, dst, n) for _, src, dst, n in coalesce(spans)]

    def layer_copies(self, layer: int, runs: Sequence[tuple[int, int, int]]) -> list[BlockCopy]:
        """The transport copies of ``runs`` for every buffer (K and V when split) of ``layer``."""
        return [
            BlockCopy(self.prefill.region_id(layer, kv), src, dst, n)
            for kv in range(self.prefill.buffers_per_layer)
            for src, dst, n in runs
        ]

    def copies(
        self,
        layer: int,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        start_token: int,
        end_token: int,
        heads: HeadSlice | None = None,
    ) -> list[BlockCopy]:
        """Granule copies moving tokens ``[start_token, end_token)`` of ``layer`` (every buffer of it)."""
        return self.layer_copies(layer, self.runs(src_blocks, dst_blocks, start_token, end_token, heads))
