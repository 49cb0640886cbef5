"""SGLang's KV cache events (``sglang/srt/disaggregation/kv_events.py``, recorded by
``sglang/srt/mem_cache/events.py``), decoded without importing SGLang. Checked against SGLang 0.5.23.

An SGLang server started with ``--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557",
"bind": true}'`` publishes its radix cache's changes after each scheduler step, in vLLM's wire shape
(``kv_events_common``): ``BlockStored`` when a radix node is inserted, ``BlockRemoved`` when one is evicted,
``AllBlocksCleared`` when the cache is flushed. What SGLang's events mean:

- A block is one page of the radix cache (``--page-size``; 1 token on CPU by default), so ``block_size`` is
  the page size and a stored node's pages arrive as one event (SGLang coalesces consecutive pages). The
  generated tokens a finished request leaves in the cache are stored too (a chat's next turn matches
  through the previous answer).
- ``block_hashes`` are the first 8 bytes of a SHA-256 chained over the pages from the root (SGLang's
  position-aware storage hash, as a signed int64), and ``parent_block_hash`` is the previous page's (None
  under the root). The router re-derives its own block hashes from the token ids instead
  (``kv_events.WorkerEvents``), so the page size need not be the router's block size.
- ``cache_salt`` (a salted request's blocks, namespaced by the salt) and a LoRA adapter's blocks
  (``lora_name``; hashes namespaced by the adapter) are not reachable by a plain prompt's tokens: skipped.
  ``medium`` ``CPU_PINNED``/``DISK``/``EXTERNAL`` (hierarchical cache tiers) is skipped, both stored and
  removed. ``session_id`` is attribution only. Bigram pages (EAGLE's token pairs) do not decode as token ids
  and are skipped.
- Only servers whose radix cache is on publish anything: SGLang's decode servers in P/D mode run without one
  unless started with ``--disaggregation-decode-enable-radix-cache``; prefill servers and aggregated ones
  have it.
- The ``format`` ``"dynamo"`` of the config namespaces hashes differently but keeps token ids and parent
  links, so it decodes the same here.
"""

from __future__ import annotations

from router.kv_events_common import Stored, StoredFields, decoder, device_tier


class BlockStored(StoredFields, tag=True):
    # A salted request's blocks, namespaced by the salt: a plain prompt cannot reach them.
    cache_salt: str | None = None


def _stored(event: BlockStored) -> Stored | None:
    plain = event.lora_id is None and event.lora_name is None and event.cache_salt is None
    if not plain or not device_tier(event.medium):
        return None
    return Stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)


#: One published batch's events (raises ``msgspec.DecodeError`` when it is no batch).
decode = decoder(BlockStored, _stored)
