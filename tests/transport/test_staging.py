"""Staging a KV cache through a pool of host slots smaller than the cache moves the same bytes as registering
the cache itself, through every transport; and a transport refuses at registration memory it cannot reach.

The staging copies are the torch copies a GPU worker runs (there on a dedicated CUDA stream, here on CPU
tensors: the same code), so these tests exercise the staged path itself, not a stand-in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.block_mapping import BlockMapping
from pd_connector.kv_tensors import KVTensors, describe
from pd_connector.staging import StagingPool, byte_views, plan
from pd_connector.transport import ucp_ffi
from pd_connector.transport.base import BlockCopy, MemoryRegion
from pd_connector.transport.cma import CmaTransport
from pd_connector.transport.loopback import LoopbackFabric, LoopbackTransport
from pd_connector.transport.tcp import TcpTransport
from pd_connector.transport.ucx import UcxTransport
from tests.transport.conftest import TRANSPORT_IDS, TRANSPORTS, PeerProcess, build

pytestmark = pytest.mark.unit

LAYERS, BLOCKS, TOKENS, HEADS, DIM = 2, 16, 4, 2, 8


def cache(seed: int | None) -> tuple[list[torch.Tensor], KVTensors]:
    """A vLLM-style CPU cache ``[blocks, heads, tokens, K|V, dim]`` per layer (random, or zeros)."""
    gen = torch.Generator().manual_seed(seed or 0)
    tensors = [
        torch.rand((BLOCKS, HEADS, TOKENS, 2, DIM), generator=gen)
        if seed
        else torch.zeros(BLOCKS, HEADS, TOKENS, 2, DIM)
        for _ in range(LAYERS)
    ]
    return tensors, describe(tensors, "bhtkd")


def staged(tensors: list[torch.Tensor], kv: KVTensors, slots: int) -> StagingPool:
    return StagingPool(kv.layout, byte_views(tensors, kv.buffers), slots)


def reserved(pool: StagingPool, owner: str, blocks: Sequence[int]) -> list[int]:
    slots = pool.reserve(owner, blocks)
    assert slots is not None
    return slots


def copies_for(kv: KVTensors, src: Sequence[int], dst: Sequence[int], tokens: int) -> list[BlockCopy]:
    mapping = BlockMapping(kv.layout, kv.layout)
    runs = mapping.runs(src, dst, 0, tokens)
    return [c for layer in range(LAYERS) for c in mapping.layer_copies(layer, runs)]


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_staging_on_both_sides_lands_what_the_direct_path_lands(data: st.DataObject) -> None:
    """Loopback (both sides in this process): P stages out, D stages in, through pools smaller than the cache
    that other transfers partly hold (so slot ids differ from block ids); D's cache equals the direct path's."""
    tokens = data.draw(st.integers(1, BLOCKS * TOKENS // 2), "tokens")
    n = -(-tokens // TOKENS)
    src = data.draw(st.permutations(range(BLOCKS)), "src")[:n]
    dst = data.draw(st.permutations(range(BLOCKS)), "dst")[:n]
    slots = data.draw(st.integers(n, BLOCKS - 1), "slots")
    others = data.draw(st.integers(0, slots - n), "slots other transfers hold")
    p_t, p = cache(seed=data.draw(st.integers(1, 2**31), "seed"))
    results = []
    for staging in (False, True):
        d_t, d = cache(seed=None)
        fabric = LoopbackFabric()
        sender, receiver = LoopbackTransport(fabric), LoopbackTransport(fabric)
        p_stage, d_stage = staged(p_t, p, slots), staged(d_t, d, slots)
        src_table, dst_table = src, dst
        if staging:
            reserved(p_stage, "other", range(others))
            reserved(d_stage, "other", range(BLOCKS - others, BLOCKS))
            src_table, dst_table = reserved(p_stage, "t", src), reserved(d_stage, "t", dst)
            for layer in range(LAYERS):
                p_stage.to_slots("t", layer, src)
        sender.register(p.layout.regions(p_stage.host_buffers() if staging else p.buffers))
        descriptor = receiver.register(d.layout.regions(d_stage.host_buffers() if staging else d.buffers))
        sender.attach("d", descriptor).result(5)
        copies = copies_for(p, src_table, dst_table, tokens)
        assert (
            sender.write("d", copies).result(5) == sum(c.num_blocks for c in copies) * p.layout.granule_bytes
        )
        if staging:
            assert not any(t.any() for t in d_t), "staged bytes must not reach the cache before from_slots"
            d_stage.from_slots("t", dst)
        sender.close()
        receiver.close()
        results.append(d_t)
    direct, via_host = results
    for layer in range(LAYERS):
        assert torch.equal(direct[layer], via_host[layer])
        assert torch.equal(direct[layer][dst], p_t[layer][src])  # whole blocks: the CPU layout is heads-major


@pytest.mark.parametrize(("kind", "tls"), TRANSPORTS, ids=TRANSPORT_IDS)
def test_staged_sender_writes_the_same_bytes_as_the_direct_one(
    kind: str, tls: str, peer_factory: type[PeerProcess]
) -> None:
    """Every real transport: a P registering a pool of 6 slots (of 16 cache blocks) filled by ``to_slots`` lands
    the bytes a P registering its cache lands (both receivers in another process, compared by digest). Two
    transfers take turns in the pool: the second reuses the slots the first released."""
    p_t, p = cache(seed=7)
    granules = p.buffers[0][1] // p.layout.granule_bytes
    src, dst = [3, 9, 4, 12, 5, 6, 0, 15], [1, 2, 14, 6, 3, 4, 7, 8]
    tokens = 4 * TOKENS - 1
    direct = [copies_for(p, src[:4], dst[:4], tokens), copies_for(p, src[4:], dst[4:], tokens)]
    p_stage = staged(p_t, p, 6)
    digests = []
    for buffers in (p.buffers, p_stage.host_buffers()):
        peer = peer_factory(kind, tls, LAYERS, granules, p.layout.granule_bytes)
        sender = build(kind, tls)
        try:
            sender.register(p.layout.regions(buffers))
            sender.attach("peer", peer.descriptor).result(30)
            tables = []
            for i, copies in enumerate(direct):
                if buffers != p.buffers:  # staged: the same destinations, read from the transfer's slots
                    blocks = src[4 * i : 4 * i + 4]
                    tables.append(reserved(p_stage, f"t{i}", blocks))
                    if i == 0:
                        assert p_stage.reserve("t1", src[4:]) is None, "6 slots cannot hold both transfers"
                    for layer in range(LAYERS):
                        p_stage.to_slots(f"t{i}", layer, blocks)
                    copies = copies_for(p, tables[-1], dst[4 * i : 4 * i + 4], tokens)
                sender.write("peer", copies).result(30)
                assert p_stage.release(f"t{i}") == (4 if buffers != p.buffers else 0)
            assert not tables or set(tables[0]) & set(tables[1]), "the second transfer reuses released slots"
            source = np.stack([np.frombuffer(t.numpy().tobytes(), np.uint8) for t in p_t])
            source = source.reshape(LAYERS, granules, -1)
            for c in (c for copies in direct for c in copies):
                peer.mirror[c.region_id, c.dst_block : c.dst_block + c.num_blocks] = source[
                    c.region_id, c.src_block : c.src_block + c.num_blocks
                ]
            digests.append(peer.digests())
            assert digests[-1] == peer.expected_digests()
        finally:
            sender.close()
    assert digests[0] == digests[1]


def test_host_only_transports_refuse_device_memory_at_registration() -> None:
    """tcp, cma and loopback never dereference a device pointer: a CUDA region is refused, naming why."""
    buf = np.zeros(4096, np.uint8)
    region = [MemoryRegion(0, buf.ctypes.data, buf.nbytes, 64, "cuda")]
    for transport in (TcpTransport(), CmaTransport(), LoopbackTransport(LoopbackFabric())):
        try:
            with pytest.raises(ValueError, match=f"transport {transport.name} cannot reach cuda memory"):
                transport.register(region)
        finally:
            transport.close()
    with pytest.raises(ValueError, match="memory type 'rocm'"):
        MemoryRegion(0, buf.ctypes.data, buf.nbytes, 64, "rocm")  # type: ignore[arg-type]


def test_each_transport_gets_the_path_it_can_take() -> None:
    """Direct for host caches and for CUDA caches with UCX (registered as CUDA memory); staged for CUDA
    caches with tcp and cma."""
    for transport in (TcpTransport, CmaTransport, LoopbackTransport, UcxTransport):
        assert plan("host", transport.memory_types) == "direct"
    assert plan("cuda", UcxTransport.memory_types) == "direct"
    assert plan("cuda", TcpTransport.memory_types) == "staged"
    assert plan("cuda", CmaTransport.memory_types) == "staged"
    assert ucp_ffi.memory_type("host") is None  # UCX detects host memory, as before
    assert ucp_ffi.memory_type("cuda") == 1  # UCS_MEMORY_TYPE_CUDA
    with pytest.raises(ValueError, match="reaches neither"):
        plan("cuda", frozenset())
