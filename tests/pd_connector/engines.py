"""Helpers shared by the transfer-engine tests: KV buffers in numpy, engine pairs, waiting for results."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import numpy as np

from pd_connector.layout import KVLayout
from pd_connector.transfer import TransferConfig, TransferEngine, TransferResult, TransferState
from pd_connector.transport.base import Transport
from pd_connector.transport.loopback import LoopbackFabric, LoopbackTransport
from tests.polling import wait_until

#: Scheduling slack added to every "ends within its timeout" bound: the machine is shared and loaded.
SLACK_S = 2.0

SMALL = KVLayout(
    num_layers=3,
    block_tokens=4,
    num_kv_heads=2,
    head_dim=4,
    dtype="float16",
    kv_split=False,
    token_major=False,
)


class KVCache:
    """One process's KV cache: a numpy buffer per (layer, K/V) region, filled with distinct bytes."""

    def __init__(self, layout: KVLayout, num_blocks: int, seed: int | None) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        n = layout.num_layers * layout.buffers_per_layer
        if seed is None:
            self.arrays = [np.zeros(num_blocks * layout.block_bytes, np.uint8) for _ in range(n)]
        else:
            rng = np.random.default_rng(seed)
            self.arrays = [rng.integers(0, 256, num_blocks * layout.block_bytes, np.uint8) for _ in range(n)]

    def buffers(self) -> list[tuple[int, int]]:
        return [(a.ctypes.data, a.nbytes) for a in self.arrays]

    def tokens(self, region: int, blocks: list[int], num_tokens: int) -> bytes:
        """The bytes of the first ``num_tokens`` tokens stored in ``blocks`` (token order) of a region.

        Works for any in-block order by reading token t's slice head by head.
        """
        lay, arr = self.layout, self.arrays[region]
        per_head = lay.token_bytes // lay.num_kv_heads
        out = bytearray()
        for t in range(num_tokens):
            base = blocks[t // lay.block_tokens] * lay.block_bytes
            slot = t % lay.block_tokens
            for h in range(lay.num_kv_heads):
                if lay.token_major:
                    off = base + (slot * lay.num_kv_heads + h) * per_head
                else:
                    off = base + (h * lay.block_tokens + slot) * per_head
                out += arr[off : off + per_head].tobytes()
        return bytes(out)


def make_engine(
    cache: KVCache, transport: Transport, listen: bool, name: str | None = None, **config: object
) -> TransferEngine:
    config.setdefault("listen_port", 0 if listen else None)
    cfg = TransferConfig(engine_id=name or uuid.uuid4().hex[:8], **config)  # type: ignore[arg-type]
    return TransferEngine(cfg, cache.layout, cache.buffers(), transport)


def addr(engine: TransferEngine) -> str:
    """The side-channel address of a listening engine."""
    assert engine.address is not None
    return engine.address


@contextmanager
def closing(*engines: TransferEngine) -> Iterator[None]:
    try:
        yield
    finally:
        for e in engines:
            with suppress(Exception):
                e.close()


def wait_results(engine: TransferEngine, ids: set[str], timeout_s: float = 10.0) -> dict[str, TransferResult]:
    """Poll until every id in ``ids`` was reported, each once; fail the test on timeout."""
    got: dict[str, TransferResult] = {}

    def all_reported() -> bool:
        for r in engine.poll():
            assert r.transfer_id in ids, f"unexpected result {r}"
            assert r.transfer_id not in got, f"reported twice: {r}"
            got[r.transfer_id] = r
        return set(got) == ids

    wait_until(all_reported, timeout_s, f"results for {sorted(ids)}")
    return got


def leaks(engine: TransferEngine) -> dict[str, int]:
    """The engine's per-request tables that are not empty (connections and tombstones of ended-before-
    destinations answers are bounded by time, not per request, so they do not count)."""
    return {k: v for k, v in engine.table_sizes().items() if k not in ("links", "peers", "tombstones") and v}


def assert_no_state(*engines: TransferEngine) -> None:
    for e in engines:
        assert not leaks(e), f"{e.config.engine_id} leaked {leaks(e)}"


DONE = TransferState.DONE


#: Fast heartbeats and abort grace, so failure tests end in a second.
FAST = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0, "abort_grace_s": 0.5}
#: The fault tests' timers: long leases and load timeouts, so a transfer that ends fast ended because of the
#: fault (a reset, a revoked grant), not a timer.
FAULT_CONFIG = {**FAST, "lease_s": 30.0, "load_timeout_s": 30.0}
#: P's and D's blocks of the three-block transfer the fault tests run.
FAULT_SRC, FAULT_DST = [3, 5, 7], [10, 2, 4]


class Pair:
    """A prefill engine (listening) and a decode engine on one loopback fabric."""

    def __init__(self, p_layout: KVLayout = SMALL, d_layout: KVLayout = SMALL, **config: object) -> None:
        self.fabric = LoopbackFabric()
        self.pc, self.dc = KVCache(p_layout, 32, seed=1), KVCache(d_layout, 32, seed=None)
        cfg = {**FAST, **config}
        self.p = make_engine(self.pc, LoopbackTransport(self.fabric), True, "P", **cfg)
        self.d = make_engine(self.dc, LoopbackTransport(self.fabric), False, "D", **cfg)

    def push_all(self, tid: str, src: list[int], first_token: int | None = None) -> None:
        self.p.offer(tid, src)
        for layer in range(self.pc.layout.num_layers):
            self.p.push_layer(tid, layer)
        self.p.finish(tid, first_token)

    def assert_copied(self, src: list[int], dst: list[int], num_tokens: int, start_token: int = 0) -> None:
        """Tokens ``[start_token, num_tokens)`` equal on both sides; D's earlier tokens untouched (zero)."""
        cut = start_token * self.dc.layout.token_bytes
        for region in range(len(self.pc.arrays)):
            want, got = self.pc.tokens(region, src, num_tokens), self.dc.tokens(region, dst, num_tokens)
            assert want[cut:] == got[cut:], region
            assert not any(got[:cut]), region

    def close(self) -> None:
        self.p.close()
        self.d.close()
        assert len(self.fabric) == 0  # every registration released
