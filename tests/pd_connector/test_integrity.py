"""Integrity mode (``integrity_check``): intact KV passes on every transport; KV damaged after it landed fails
the load on D with a reason naming the layer, leaks nothing and leaves the link usable; without the mode the
same damage goes through (the negative control); modes that differ are refused at the handshake."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest

from pd_connector.layout import KVLayout
from pd_connector.protocol import Checksums
from pd_connector.transfer import TransferConfig, TransferEngine, TransferState
from pd_connector.transfer.integrity import IntegrityError, RegionBytes, verify
from pd_connector.transport.base import BlockCopy, MemoryRegion, Transport
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.loopback import LoopbackFabric, LoopbackTransport
from pd_connector.transport.tcp import TcpConfig
from pd_connector.transport.ucx import UcxConfig
from tests.pd_connector.engines import FAST, SMALL, KVCache, Pair, addr, assert_no_state, closing, make_engine
from tests.pd_connector.engines import wait_results as wait
from tests.pd_connector.faults import DamagingTransport

pytestmark = pytest.mark.unit

#: Every data plane we ship, both engines in this process (bytes still cross the real data path).
KINDS = ["loopback", "tcp", "cma", "ucx"]
ON: dict[str, Any] = {**FAST, "integrity_check": True}
OFF: dict[str, Any] = {**FAST, "integrity_check": False}


def transports(kind: str) -> tuple[Transport, Transport]:
    if kind == "loopback":
        fabric = LoopbackFabric()
        return LoopbackTransport(fabric), LoopbackTransport(fabric)
    config = TransportConfig(kind=kind, tcp=TcpConfig(), ucx=UcxConfig(tls="sm,self"))  # type: ignore[arg-type]
    return create_transport(config), create_transport(config)


def flip_first_byte(cache: KVCache) -> Callable[[Sequence[BlockCopy]], None]:
    """Damage that flips the first byte a write put into D's ``cache``."""

    def damage(copies: Sequence[BlockCopy]) -> None:
        first = copies[0]
        cache.arrays[first.region_id][first.dst_block * cache.layout.granule_bytes] ^= 0xFF

    return damage


@contextmanager
def engines(
    kind: str, *, layout: KVLayout = SMALL, damage_write: int | None = None, **config: object
) -> Iterator[tuple[TransferEngine, TransferEngine, KVCache, KVCache, DamagingTransport]]:
    """P (listening, its transport wrapped to damage write ``damage_write``; None: none) and D over ``kind``."""
    pc, dc = KVCache(layout, 32, seed=1), KVCache(layout, 32, seed=None)
    tp, td = transports(kind)
    wrapped = DamagingTransport(tp, flip_first_byte(dc), after_write=damage_write or 0)
    p = make_engine(pc, wrapped, True, "P", **config)
    d = make_engine(dc, td, False, "D", **config)
    with closing(p, d):
        yield p, d, pc, dc, wrapped


def push(p: TransferEngine, tid: str, src: list[int], layers: int) -> None:
    p.offer(tid, src)
    for layer in range(layers):
        p.push_layer(tid, layer)
    p.finish(tid)


def copied(pc: KVCache, dc: KVCache, src: list[int], dst: list[int], num_tokens: int) -> bool:
    return all(pc.tokens(r, src, num_tokens) == dc.tokens(r, dst, num_tokens) for r in range(len(pc.arrays)))


@pytest.mark.parametrize("kind", KINDS)
def test_intact_kv_passes_the_check_on_every_transport(kind: str) -> None:
    with engines(kind, **ON) as (p, d, pc, dc, _):
        d.expect("t1", addr(p), [10, 2, 4], 10)
        push(p, "t1", [3, 5, 7], SMALL.num_layers)
        got = wait(d, {"t1"})["t1"]
        assert got.state is TransferState.DONE and not got.integrity_failed, got.reason
        assert wait(p, {"t1"})["t1"].state is TransferState.DONE
        assert copied(pc, dc, [3, 5, 7], [10, 2, 4], 10)
        assert d.counters().integrity_failures == 0
        assert_no_state(p, d)


@pytest.mark.parametrize("kind", KINDS)
def test_kv_damaged_after_it_landed_fails_the_load_and_leaks_nothing(kind: str) -> None:
    with engines(kind, damage_write=2, **ON) as (p, d, pc, dc, wrapped):
        d.expect("bad", addr(p), [10, 2, 4], 10)
        push(p, "bad", [3, 5, 7], SMALL.num_layers)
        got = wait(d, {"bad"})["bad"]
        assert wrapped.damaged == 1
        assert got.state is TransferState.FAILED
        assert "integrity check failed" in got.reason and "layer 1" in got.reason, got.reason
        assert got.integrity_failed  # what the adapters' metrics count (integrity_failures)
        wait(p, {"bad"})  # P's part ended (its writes landed); D alone judged the bytes
        assert d.counters().integrity_failures == 1
        assert_no_state(p, d)
        # The link survives a bad transfer: the next one on it passes.
        d.expect("good", addr(p), [20, 21, 22], 12)
        push(p, "good", [8, 9, 11], SMALL.num_layers)
        assert wait(d, {"good"})["good"].state is TransferState.DONE
        assert wait(p, {"good"})["good"].state is TransferState.DONE
        assert copied(pc, dc, [8, 9, 11], [20, 21, 22], 12)
        assert_no_state(p, d)


def test_without_the_mode_the_same_damage_becomes_a_done_load() -> None:
    """Negative control: the damage is real and only the check catches it."""
    with engines("loopback", damage_write=2, **OFF) as (p, d, pc, dc, wrapped):
        d.expect("bad", addr(p), [10, 2, 4], 10)
        push(p, "bad", [3, 5, 7], SMALL.num_layers)
        assert wait(d, {"bad"})["bad"].state is TransferState.DONE
        assert wrapped.damaged == 1
        assert not copied(pc, dc, [3, 5, 7], [10, 2, 4], 10)


def test_a_block_pushed_again_by_the_next_chunk_is_checked_on_its_final_bytes() -> None:
    """Heads-major blocks move whole: chunk 1's partial last block is written, then computed further and
    written again by chunk 2. The check must judge the final bytes, not chunk 1's."""
    pair = Pair(**ON)
    try:
        src, dst = [3, 5, 7], [10, 2, 4]
        pair.d.expect("chunked", addr(pair.p), dst, 10)
        pair.p.offer("chunked", src[:2])
        for layer in range(SMALL.num_layers):
            pair.p.push_layer("chunked", layer, 0, 2)  # tokens 0..5 computed: block 5 half full
        # Chunk 2 computes tokens 6..9: the rest of block 5 and block 7, on every layer.
        half = SMALL.block_bytes // 2
        for array in pair.pc.arrays:
            array[5 * SMALL.block_bytes + half : 6 * SMALL.block_bytes] ^= 0x5A
        pair.p.offer("chunked", src)
        for layer in range(SMALL.num_layers):
            pair.p.push_layer("chunked", layer, 1)
        pair.p.finish("chunked")
        got = wait(pair.d, {"chunked"})["chunked"]
        assert got.state is TransferState.DONE, got.reason
        assert wait(pair.p, {"chunked"})["chunked"].state is TransferState.DONE
        pair.assert_copied(src, dst, 10)
        assert_no_state(pair.p, pair.d)
    finally:
        pair.close()


def test_per_layer_tables_and_a_prefix_hit_are_checked_per_layer() -> None:
    layout = msgspec.structs.replace(SMALL, kv_split=True, token_major=True)
    with engines("loopback", layout=layout, damage_write=3, **ON) as (p, d, _, _, _):
        tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
        d.expect("t", addr(p), [], 10, layer_dst_blocks=tables, start_token=4)
        push(p, "t", [11, 12, 13], layout.num_layers)
        got = wait(d, {"t"})["t"]
        assert got.state is TransferState.FAILED and "layer 2 (K buffer" in got.reason, got.reason
        wait(p, {"t"})
        assert_no_state(p, d)


@pytest.mark.parametrize(("prefill", "decode"), [(True, False), (False, True)])
def test_modes_that_differ_are_refused_at_the_handshake(prefill: bool, decode: bool) -> None:
    fabric = LoopbackFabric()
    pc, dc = KVCache(SMALL, 8, seed=1), KVCache(SMALL, 8, seed=None)
    p = make_engine(pc, LoopbackTransport(fabric), True, "P", **FAST, integrity_check=prefill)
    d = make_engine(dc, LoopbackTransport(fabric), False, "D", **FAST, integrity_check=decode)
    with closing(p, d):
        d.expect("t", addr(p), [1], 4)
        got = wait(d, {"t"})["t"]
        assert got.state is TransferState.FAILED and "integrity_check mismatch" in got.reason, got.reason
        assert p.counters().rejected_connections == 1
        assert_no_state(d)


def test_malformed_checksums_are_refused_before_any_read_outside_the_cache() -> None:
    kv = np.arange(64, dtype=np.uint8)
    memory = RegionBytes([MemoryRegion(0, kv.ctypes.data, kv.nbytes, 8)])
    run = np.array([[0, 8]], "<i8").tobytes()  # all 8 granules of the region: fine
    good = Checksums([run], [memory.digest(0, np.frombuffer(run, "<i8").reshape(-1, 2))])
    verify(memory, [[0]], good, 1)
    bad = {
        "leaves KV region": Checksums([np.array([[4, 5]], "<i8").tobytes()], [0]),
        "not whole runs": Checksums([run[:12]], [0]),
        "expected 1 and 1": Checksums([run, run], [0, 0]),
        "no KV region 3": Checksums([run], [0]),
    }
    for needle, sums in bad.items():
        with pytest.raises(IntegrityError, match=needle):
            verify(memory, [[3]] if needle.startswith("no KV") else [[0]], sums, 1)
    kv[0] ^= 1
    with pytest.raises(IntegrityError, match="layer 0"):
        verify(memory, [[0]], good, 1)


def test_a_cache_in_device_memory_is_refused_with_the_reason() -> None:
    fabric = LoopbackFabric()
    cache = KVCache(SMALL, 4, seed=None)
    with pytest.raises(ValueError, match="integrity_check hashes KV in host memory"):
        TransferEngine(
            TransferConfig(engine_id="P", integrity_check=True),
            SMALL,
            cache.buffers(),
            LoopbackTransport(fabric),
            memory="cuda",
        )
    assert len(fabric) == 0  # the transport was closed, nothing stays registered
