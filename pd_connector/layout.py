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
heads-major (``[heads, tokens, dim]``: only whole blocks are contiguous).

Transports address memory in *granules* (``MemoryRegion.block_bytes``): one token for token-major layouts,
one block for heads-major layouts. Two compatible layouts always have the same granule size in bytes, so a
copy list in granules is valid on both sides even when P and D use different block sizes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from pd_connector.transport.base import BlockCopy, MemoryRegion

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


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one engine worker's KV cache is laid out in memory (sent in the handshake).

    ``kv_split``: False when K and V share one buffer per layer (packed), True for separate K and V buffers.
    ``token_major``: True when tokens are the outermost axis inside a block (``[tokens, heads, dim]``).
    """

    num_layers: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_split: bool
    token_major: bool

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_tokens", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

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
        """Tokens per transport addressing unit: 1 when any token range is contiguous, else a block."""
        return 1 if (self.token_major or self.num_kv_heads == 1) else self.block_tokens

    @property
    def granule_bytes(self) -> int:
        return self.token_bytes * self.granule_tokens

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


_MUST_MATCH = ("num_layers", "num_kv_heads", "head_dim", "dtype", "kv_split")


def check_compatible(prefill: KVLayout, decode: KVLayout) -> None:
    """Raise ``LayoutMismatch`` unless P's blocks can be copied into D's blocks granule by granule.

    Different block sizes are mapped when both sides are token-major (a D block of 32 tokens is two
    P blocks of 16 laid end to end); heads-major blocks of different sizes interleave heads and tokens
    differently and are refused. K/V packed versus split changes the byte order inside every token and
    is refused as well.
    """
    diffs = [
        f"{name}: prefill {getattr(prefill, name)!r} vs decode {getattr(decode, name)!r}"
        for name in _MUST_MATCH
        if getattr(prefill, name) != getattr(decode, name)
    ]
    fields = [name for name in _MUST_MATCH if getattr(prefill, name) != getattr(decode, name)]
    if prefill.granule_tokens == 1 and decode.granule_tokens == 1:
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


@dataclass(frozen=True)
class BlockMapping:
    """Copies one token range of a request from P's block table into D's (both in token order)."""

    prefill: KVLayout
    decode: KVLayout

    def runs(
        self, src_blocks: Sequence[int], dst_blocks: Sequence[int], start_token: int, end_token: int
    ) -> list[tuple[int, int, int]]:
        """Coalesced ``(src granule, dst granule, granules)`` runs moving tokens ``[start_token, end_token)``.

        The same runs serve every layer (only the region differs), so callers compute them once per range.
        Heads-major layouts copy whole blocks, so the range is widened to block boundaries. Raises
        ``ValueError`` when a table is too short for the range.
        """
        g = self.prefill.granule_tokens
        start, end = (start_token // g) * g, -(-end_token // g) * g
        ps, ds = self.prefill.block_tokens, self.decode.block_tokens
        if end > len(src_blocks) * ps or end > len(dst_blocks) * ds:
            raise ValueError(
                f"tokens [{start}, {end}) exceed the block tables: prefill {len(src_blocks)} x {ps}, "
                f"decode {len(dst_blocks)} x {ds} tokens"
            )
        runs: list[tuple[int, int, int]] = []
        t = start
        while t < end:
            # Cut at the next block boundary on either side: inside that span both sides are contiguous.
            nxt = min(end, (t // ps + 1) * ps, (t // ds + 1) * ds)
            src = (src_blocks[t // ps] * ps + t % ps) // g
            dst = (dst_blocks[t // ds] * ds + t % ds) // g
            n = (nxt - t) // g
            if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
            else:
                runs.append((src, dst, n))
            t = nxt
        return runs

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
    ) -> list[BlockCopy]:
        """Granule copies moving tokens ``[start_token, end_token)`` of ``layer`` (every buffer of it)."""
        return self.layer_copies(layer, self.runs(src_blocks, dst_blocks, start_token, end_token))
