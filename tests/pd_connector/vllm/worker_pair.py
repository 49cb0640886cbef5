"""Two vLLM worker sides (P and D) over real transfer engines, with the forward pass played by the test.

The test writes KV into P's tensors and calls the hooks in vLLM's order (bind -> save_kv_layer per layer;
start_load_kv; get_transfer_results each step). P's scheduler finishes a request in a later step than its last
push (``FinishedSend``, with P's first token): then ``Done`` goes out. Used by ``test_worker_side`` and
``test_worker_side_staging`` (the ``make_pair`` fixture is in this folder's conftest).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.metadata import FinishedSend, PDConnectorMetadata, RecvSpec, SendSpec
from pd_connector.vllm.worker_side import WorkerSide
from tests.polling import wait_until

BS = 32
LAYERS = 3
NUM_BLOCKS = 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv(fill: bool) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: [num_blocks, kv_heads, block_size, head_k + head_v]."""
    gen = torch.Generator().manual_seed(1)
    shape = (NUM_BLOCKS, 2, BS, 128)
    return {n: torch.randn(shape, generator=gen) if fill else torch.zeros(shape) for n in NAMES}


class Pair:
    def __init__(
        self,
        p_config: PDConnectorConfig,
        d_config: PDConnectorConfig,
        p_kv: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.p_kv, self.d_kv = p_kv or kv(True), kv(False)
        self.p = WorkerSide(p_config, "p", BS, NUM_BLOCKS, producer=True, consumer=False)
        self.d = WorkerSide(d_config, "d", BS, NUM_BLOCKS, producer=False, consumer=True)
        self.p.register_kv_caches(self.p_kv)
        self.d.register_kv_caches(self.d_kv)
        assert self.p.side_channel_addr is not None
        self.addr = self.p.side_channel_addr
        self.sent: set[str] = set()
        self.recv: set[str] = set()
        self.failed: set[str] = set()

    def p_step(self, sends: list[SendSpec], finished: list[FinishedSend] | None = None) -> None:
        meta = PDConnectorMetadata(sends=sends, finished_sends=finished or [])
        self.p.bind(meta)
        for name in NAMES:
            self.p.save_kv_layer(meta, name, self.p_kv[name])

    def p_finish(self, first_token: int | None = None) -> None:
        """P's scheduler finished request p1 (the step after its last push)."""
        self.p_step([], [FinishedSend("p1", ok=True, report=True, first_token=first_token)])

    def d_step(self, recvs: list[RecvSpec] | None = None, aborted: list[str] | None = None) -> None:
        self.d.start_load_kv(PDConnectorMetadata(recvs=recvs or [], aborted_recvs=aborted or []))

    def poll(self) -> None:
        sending, _, _ = self.p.transfer_results()
        _, recving, failed = self.d.transfer_results()
        self.sent |= sending
        self.recv |= recving
        self.failed |= failed

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 15.0) -> float:
        """Poll both workers (as vLLM does each step) until ``predicate``; the seconds it took."""
        return wait_until(lambda: self.poll() or predicate(), timeout_s, "the pair's transfers")

    def close(self) -> None:
        self.p.shutdown()
        self.d.shutdown()


def equal(pair: Pair, p_blocks: list[int], d_blocks: list[int]) -> bool:
    return all(torch.equal(pair.p_kv[n][p_blocks], pair.d_kv[n][d_blocks]) for n in NAMES)
