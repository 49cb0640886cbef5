"""The KV-shaped prompt the transport benchmarks move, and the memory they move it in.

Used by ``benchmarks.transport`` (one TP rank's cache, every data path) and ``benchmarks.tp_pairs`` (the
whole model's cache split over P and D ranks of different TP sizes), so both time the same prompt: 4096 tokens
in 16-token blocks whose ids come from fragmented free lists, in pools whose pages are huge or small on request.
"""

from __future__ import annotations

import mmap

import numpy as np

from pd_connector.transport.hugepages import huge_page_bytes

PROMPT_TOKENS, BLOCK_TOKENS = 4096, 16
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK_TOKENS
POOL_BLOCKS = 384  # blocks per region on each side; the prompt's 256 are scattered in it


def small_pages(nbytes: int) -> np.ndarray:
    """Zeroed, not yet touched memory that will get 4 KiB pages (numpy would advise huge pages)."""
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(area, dtype=np.uint8)


def huge_pages(nbytes: int) -> np.ndarray:
    """Zeroed, not yet touched memory starting on a huge-page boundary and advised to huge pages."""
    page = huge_page_bytes()
    area = mmap.mmap(-1, nbytes + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(area, dtype=np.uint8)
    start = -whole.ctypes.data % page
    area.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start : start + nbytes]


def fragmented_blocks(seed: int) -> list[int]:
    """256 block ids as an allocator's free list leaves them after churn: short runs in shuffled order."""
    rng = np.random.default_rng(seed)
    runs, start = [], 0
    while start < POOL_BLOCKS:
        length = int(min(rng.geometric(1 / 8), POOL_BLOCKS - start))
        runs.append(list(range(start, start + length)))
        start += length
    order = rng.permutation(len(runs))
    return [b for i in order for b in runs[i]][:PROMPT_BLOCKS]


#: The prompt's block tables on P (source) and D (destination).
KV_SRC, KV_DST = fragmented_blocks(11), fragmented_blocks(12)
