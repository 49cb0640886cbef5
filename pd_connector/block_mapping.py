"""The P-block -> D-block copy mapping: which bytes of P's KV cache go where in D's, for one token range.

Who uses it: P's transfer engine (``transfer.send_state`` / ``transfer.sender``) maps each pushed layer's
token range of a request from P's block table into D's, in the granules of ``layout`` (one head vector), and
hands the runs to the transport; the vLLM worker side's staging (``staging``) and caches in kernel blocks
(``kernel_block_ids``) reuse it. The layouts (``layout.KVLayout``) may differ in block size, in-block order
(NHD/HND, where K/V sit) and TP share; ``BlockMapping.runs`` coalesces the vectors into contiguous runs (a
whole block when both sides lay it out alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pd_connector.layout import HeadSlice, KVLayout
from pd_connector.transport.base import BlockCopy


def kernel_block_ids(blocks: Sequence[int], per_block: int) -> list[int]:
    """The kernel block table of a KV manager block table, for caches in kernel blocks.

    Some attention backends' kernels take blocks smaller than the KV manager's: vLLM then lays the cache out in
    kernel blocks and splits manager block ``b`` of ``per_block * k`` tokens into kernel blocks
    ``b * per_block + j`` (``j < per_block``) of ``k`` tokens each. In this module's terms such a cache is a
    ``KVLayout`` whose block is the kernel block (``block_tokens = k``) and whose block table is this one:
    token ``t`` of a request sits at position ``t // k`` of it exactly as it sat at ``t // (per_block * k)``
    of the manager's, so ``BlockMapping`` maps it to and from any other layout and block size unchanged.
    """
    if per_block <= 0:
        raise ValueError(f"per_block must be positive, got {per_block}")
    return [b * per_block + j for b in blocks for j in range(per_block)]


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
        sorted by source.

        ``heads``: the head slice D takes from this P (None: every head; both sides hold the same ones). The
        same runs serve every layer (only the region differs), so callers compute them once per range.
        A heads-major P widens the range to its block boundaries (within both tables), so its blocks move
        whole. Every vector of the range is placed by both sides' strides, then neighbours on both sides are
        merged into runs. Raises ``ValueError`` when a table is too short for the range, the slice does not
        fit or D's table names a block twice.
        """
        p, d = self.prefill, self.decode
        ps, ds = p.block_tokens, d.block_tokens
        if end_token > len(src_blocks) * ps or end_token > len(dst_blocks) * ds or start_token < 0:
            raise ValueError(
                f"tokens [{start_token}, {end_token}) exceed the block tables: prefill {len(src_blocks)} x {ps}, "
                f"decode {len(dst_blocks)} x {ds} tokens"
            )
        g = p.granule_tokens
        start = (start_token // g) * g
        end = min(-(-end_token // g) * g, len(src_blocks) * ps, len(dst_blocks) * ds)
        sl = heads or HeadSlice(0, 0, 0, p.num_kv_heads)
        if (
            sl.num_heads <= 0
            or sl.src_head + sl.num_heads > p.num_kv_heads
            or sl.dst_head + sl.num_heads > d.num_kv_heads
        ):
            raise ValueError(
                f"head slice {sl} does not fit {p.num_kv_heads} prefill and {d.num_kv_heads} decode heads"
            )
        if end <= start:
            return []
        per_block = self._whole_block_vectors(sl, start, end)
        if per_block:
            src_b = np.asarray(src_blocks[start // ps : end // ps], np.int64)
            dst_b = np.asarray(dst_blocks[start // ps : end // ps], np.int64)
            return [(s * per_block, t * per_block, n * per_block) for s, t, n in merged_runs(src_b, dst_b)]
        return self.vector_runs(src_blocks, dst_blocks, start, end, sl)

    def vector_runs(
        self, src_blocks: Sequence[int], dst_blocks: Sequence[int], start: int, end: int, sl: HeadSlice
    ) -> list[tuple[int, int, int]]:
        """``runs`` by placing every vector of ``[start, end)`` (granule-aligned, checked) on both sides."""
        tokens = np.arange(start, end, dtype=np.int64)
        src = _vectors(self.prefill, np.asarray(src_blocks, np.int64), tokens, sl.src_head, sl.num_heads)
        dst = _vectors(self.decode, np.asarray(dst_blocks, np.int64), tokens, sl.dst_head, sl.num_heads)
        return merged_runs(src, dst)

    def _whole_block_vectors(self, sl: HeadSlice, start: int, end: int) -> int:
        """Vectors per block when the range moves whole blocks that P and D lay out alike and densely (a block
        is one contiguous run of vectors on both sides: ``runs`` is then block arithmetic, O(blocks) instead
        of O(vectors)); 0 otherwise."""
        p, d = self.prefill, self.decode
        per_block = p.block_tokens * p.num_kv_heads * p.kv_in_buffer
        alike = (
            d.block_tokens == p.block_tokens
            and p.vector_strides == d.vector_strides
            and p.vector_strides[0] == per_block
            and sl.src_head == sl.dst_head == 0
            and sl.num_heads == p.num_kv_heads == d.num_kv_heads
        )
        return per_block if alike and start % p.block_tokens == 0 and end % p.block_tokens == 0 else 0

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


def merged_runs(src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> list[tuple[int, int, int]]:
    """``(src, dst, count)`` runs of the pairs ``src[i] -> dst[i]``, sorted by source, neighbours on both sides
    merged; ``ValueError`` when a destination repeats (it would be written twice)."""
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    if np.unique(dst).size != dst.size:
        raise ValueError("decode block table names a block twice: its vectors would be written twice")
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist(), strict=True))


def _vectors(
    layout: KVLayout, blocks: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], head: int, num_heads: int
) -> npt.NDArray[np.int64]:
    """Vector index (in its buffer) of every (token, head, K/V) of the range, token-major, flattened."""
    sb, st, sh, sk = layout.vector_strides
    bt = layout.block_tokens
    per_token = blocks[tokens // bt] * sb + (tokens % bt) * st
    per_head = np.arange(head, head + num_heads, dtype=np.int64) * sh
    per_kv = np.arange(layout.kv_in_buffer, dtype=np.int64) * sk
    return (per_token[:, None, None] + per_head[None, :, None] + per_kv[None, None, :]).ravel()
