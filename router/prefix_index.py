"""Which prompt prefixes each worker probably holds in its prefix cache, as chained block hashes.

Lives in the router process (one ``PrefixIndex`` per router, owned by the ``Balancer``) and is touched only
from its event loop. The router records every prompt it routes on the workers it sent it to (``record``), and
where an engine publishes its KV events, what it stored and evicted (``kv_events.py``), so a later prompt that starts with the same tokens (the next turn of a conversation, an agent re-sending its
history, a shared system prompt) can be sent where those tokens are already cached (``match``).

Prompts are cut into blocks of ``block_size`` tokens and each full block is named by a hash of its tokens
and its parent's hash, as vLLM names its cached blocks: a block hash stands for the whole prefix up to it,
and a partial last block is never cached (vLLM caches full blocks only). The hash is Python's tuple hash
seeded with a per-index random root, not vLLM's: the router only compares its own hashes (a collision
costs a routing choice, never a wrong answer, since the engine checks its own cache).

Memory is bounded per worker by ``max_blocks``, least recently used first. A prompt's blocks are touched
last-to-first, so a prefix is always more recent than any block that extends it: eviction takes the tails
of conversations first (as vLLM's own eviction does) and a worker's set stays prefix-closed, so ``match``
can stop at the first miss.
"""

from __future__ import annotations

import random
import sys
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

#: Bytes of one key (a hash fills a 64-bit int); ``sys.getsizeof`` of a map counts its table, not its keys.
_KEY_BYTES = sys.getsizeof(1 << 62)


def block_hashes(ids: Sequence[int], block_size: int, root: int = 0) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``ids`` (a partial last block is left out).

    Called once per routed prompt (``requests.parse``'s caller); ~0.05 us per token here.
    """
    hashes: list[int] = []
    parent = root
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, *ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Per worker (any hashable key: the ``Worker``), the block hashes recently routed to it, LRU-bounded."""

    def __init__(self, block_size: int, max_blocks: int, rng: random.Random | None = None) -> None:
        if block_size <= 0 or max_blocks <= 0:
            raise ValueError("block_size and max_blocks must be > 0")
        self.block_size = block_size
        self.max_blocks = max_blocks
        # The chains' root: unknown outside this process, so clients cannot aim collisions at it.
        self.root = (rng or random.Random()).getrandbits(62)
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}

    def hashes(self, ids: Sequence[int]) -> list[int]:
        return block_hashes(ids, self.block_size, self.root)

    def match(self, worker: Hashable, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` ``worker`` holds.

        A binary search: a worker's set is prefix-closed (module doc), so holding block i means holding every
        block before it. ~log2(blocks) lookups instead of one per block (a lookup in a map of a million
        entries is a cache miss: ~0.1-0.3 us here).
        """
        blocks = self._blocks.get(worker)
        if not blocks:
            return 0
        lo, hi = 0, len(hashes)  # blocks [0, lo) held; [hi, ...) not
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in blocks:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def record(self, worker: Hashable, hashes: Sequence[int]) -> None:
        """``worker`` now holds this prefix: add or refresh its blocks (last first), evict beyond the bound."""
        if not hashes:
            return
        held = self.match(worker, hashes)
        blocks = self._blocks.setdefault(worker, OrderedDict())
        # Prefix-closed: the first ``held`` blocks are there and none after them. Both loops run in C.
        blocks.update(dict.fromkeys(reversed(hashes[held:])))
        deque(map(blocks.move_to_end, reversed(hashes[:held])), maxlen=0)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def remove(self, worker: Hashable, block: int) -> None:
        """The engine evicted ``block`` (KV events, ``kv_events.py``)."""
        blocks = self._blocks.get(worker)
        if blocks is not None:
            blocks.pop(block, None)

    def forget(self, worker: Hashable) -> None:
        """Drop everything known about ``worker`` (removed, or its cache was reset)."""
        self._blocks.pop(worker, None)

    def blocks(self) -> int:
        """Block entries held, all workers together."""
        return sum(len(b) for b in self._blocks.values())

    def memory_bytes(self) -> int:
        """Bytes the index holds: the per-worker maps' tables and their keys (tests check it against
        tracemalloc; about 110-140 bytes per block)."""
        return sum(sys.getsizeof(b) + len(b) * _KEY_BYTES for b in self._blocks.values())
