"""MLA's latent cache through two real worker sides: vLLM's per-layer ``[blocks, 1, block_size, latent]`` CPU
tensors registered as they are (TPRank.mla), P pushing layer by layer, D's blocks equal to P's, and under TP
only P rank 0 sends (every rank holds the whole latent)."""

from __future__ import annotations

import pytest
import torch

from pd_connector.vllm.compat import TPRank, kv_layout
from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.metadata import FinishedSend, PDConnectorMetadata, RecvSpec, SendSpec
from pd_connector.vllm.worker_side import WorkerSide
from tests.polling import wait_until

pytestmark = pytest.mark.unit

BS, BLOCKS, LATENT, LAYERS = 16, 8, 576, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MLA = TPRank(mla=True, total_kv_heads=1)


def caches(fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    shape = (BLOCKS, 1, BS, LATENT)
    return {n: torch.randn(shape, generator=gen) if fill else torch.zeros(shape) for n in NAMES}


def test_the_latent_is_described_as_one_head_every_rank_holds() -> None:
    kv = kv_layout(caches(False), BLOCKS, TPRank(rank=1, size=2, total_kv_heads=1, mla=True))
    assert kv.layout.mla and kv.layout.num_kv_heads == 1 and kv.layout.head_dim == LATENT
    assert kv.layout.vector_strides == (BS, 1, 0, 0) and len(kv.buffers) == LAYERS
    with pytest.raises(ValueError, match="latent"):
        kv_layout({"l": torch.zeros(BLOCKS, 1, BS)}, BLOCKS, MLA)


def test_latent_blocks_land_block_for_block() -> None:
    p_kv, d_kv = caches(True), caches(False)
    p = WorkerSide(PDConnectorConfig(lease_s=5), "p", BS, BLOCKS, producer=True, consumer=False, tp=MLA)
    d = WorkerSide(
        PDConnectorConfig(load_timeout_s=5), "d", BS, BLOCKS, producer=False, consumer=True, tp=MLA
    )
    try:
        p.register_kv_caches(p_kv)
        d.register_kv_caches(d_kv)
        assert p.side_channel_addr is not None
        meta = PDConnectorMetadata(sends=[SendSpec("p1", "T", [5, 1], 0, 20, 20)], finished_sends=[])
        p.bind(meta)
        for name in NAMES:
            p.save_kv_layer(meta, name, p_kv[name])
        p.bind(PDConnectorMetadata(sends=[], finished_sends=[FinishedSend("p1", ok=True, report=True)]))
        d.start_load_kv(
            PDConnectorMetadata(
                recvs=[RecvSpec("d1", "T", p.side_channel_addr, [2, 6], 0, 20)], aborted_recvs=[]
            )
        )
        done: set[str] = set()

        def loaded() -> bool:
            p.transfer_results()
            _, recving, failed = d.transfer_results()
            assert not failed
            done.update(recving)
            return "d1" in done

        wait_until(loaded, 15, "the latent load")
        for name in NAMES:
            assert torch.equal(d_kv[name][2], p_kv[name][5])
            assert torch.equal(d_kv[name][6][:, :4], p_kv[name][1][:, :4])  # tokens 16-19 of the prompt
            assert not d_kv[name][[0, 1, 3, 4, 5, 7]].any(), "no other block written"
        stats = p.stats()
        assert stats is not None and stats.data["bytes_sent"] == LAYERS * 20 * LATENT * 4
    finally:
        p.shutdown()
        d.shutdown()
