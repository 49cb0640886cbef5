"""Per-step metadata the scheduler-side connector hands to the worker-side connector.

Built by ``SchedulerSide.build_connector_meta`` in the EngineCore process once per engine step, bound to the
worker by vLLM before the forward pass. Every field is a msgspec Struct or a builtin, so the object survives
vLLM's msgspec serialization between the scheduler and multi-process workers (no pickle needed).
"""

from __future__ import annotations

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


class SendSpec(msgspec.Struct, frozen=True):
    """P: this step computes prompt tokens ``[start_token, end_token)`` of a request D is waiting for.

    ``block_ids`` is the request's whole block table (index i holds tokens ``[i*bs, (i+1)*bs)``); the worker
    pushes the blocks this step touched, layer by layer, right after each layer's attention wrote them.
    """

    req_id: str
    transfer_id: str
    block_ids: list[int]
    start_token: int
    end_token: int
    prompt_len: int
    #: Test only (``test_allow_corruption``): send zeros instead of this request's KV.
    corrupt: bool = False
    #: ``protocol.prompt_digest`` of the prompt: P writes nothing for a D whose prompt differs.
    prompt_hash: bytes = b""


class RecvSpec(msgspec.Struct, frozen=True):
    """D: load prompt blocks ``block_ids[i]`` for block indices ``i >= start_block`` from P's side channel."""

    req_id: str
    transfer_id: str
    prefill_addr: str
    block_ids: list[int]
    start_block: int
    num_tokens: int
    #: ``protocol.prompt_digest`` of the prompt, checked by P against its own.
    prompt_hash: bytes = b""


class FinishedSend(msgspec.Struct, frozen=True):
    """P: the scheduler finished a request; ``ok`` is False when it was aborted (stop pushing now).

    ``report`` is True when the scheduler kept the request's blocks and waits for ``finished_sending``.
    ``first_token``: the token P sampled at the end of the prompt, which ``Done`` carries to D (a D asked
    to seed continues from it).
    """

    req_id: str
    ok: bool
    report: bool
    first_token: int | None = None


class PDConnectorMetadata(KVConnectorMetadata):
    """What one worker step must do: pushes (P), loads to start (D), finished or aborted requests."""

    def __init__(
        self,
        sends: list[SendSpec] | None = None,
        recvs: list[RecvSpec] | None = None,
        finished_sends: list[FinishedSend] | None = None,
        aborted_recvs: list[str] | None = None,
        idle_step: bool = False,
    ) -> None:
        self.sends: list[SendSpec] = sends or []
        self.recvs: list[RecvSpec] = recvs or []
        self.finished_sends: list[FinishedSend] = finished_sends or []
        #: D request ids whose load must stop (request aborted while waiting for KV).
        self.aborted_recvs: list[str] = aborted_recvs or []
        #: The step schedules no tokens: vLLM only polls transfers (it spins while any are pending).
        self.idle_step = idle_step

    def __repr__(self) -> str:
        return (
            f"PDConnectorMetadata(sends={len(self.sends)}, recvs={len(self.recvs)}, "
            f"finished_sends={len(self.finished_sends)}, aborted_recvs={len(self.aborted_recvs)})"
        )


class FirstTokens(KVConnectorWorkerMetadata):
    """D: P's first sampled token per request whose load finished this step (from P's ``Done``).

    Worker -> scheduler, in the same step output as ``finished_recving``; the scheduler side seeds the
    requests that asked for it. Under tensor parallelism every rank learns the same token from its P rank's
    ``Done``; ``aggregate`` merges the ranks' maps.
    """

    def __init__(self, tokens: dict[str, int]) -> None:
        self.tokens = tokens

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, FirstTokens):
            return FirstTokens({**self.tokens, **other.tokens})
        return self
