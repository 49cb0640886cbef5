"""Scheduler-side half of the PDConnector (runs in vLLM's EngineCore process, one instance per engine).

Decides per request what the connector does, from the request's ``kv_transfer_params``:
- P (``pd_role: prefill`` from our router, or vLLM's standard ``do_remote_decode: true``): follow every
  scheduled step of the prompt (every chunk under chunked prefill) and tell the worker which blocks each
  step writes; when the request finishes, keep its blocks (``request_finished -> True``) until the worker
  reports the transfer ended (every write landed and Done sent, failed, aborted, or lease expired).
- D (``pd_role: decode``, or ``do_remote_prefill: true`` with the params P returned): report the prompt's
  uncomputed tokens as external and asynchronous (``get_num_new_matched_tokens -> (n, True)``), so vLLM
  allocates the blocks and parks the request until the worker finished loading them. A load is attempted
  once; if it fails, vLLM's ``kv_load_failure_policy`` recomputes (or fails) the request.
Only what this engine's ``kv_role`` allows: a consumer-only D never prefills for a remote decode (it would
hold the blocks for a send that never comes), a producer-only P never loads; a decode request loads only from a
prefill address the peer policy allows (``pd_connector.trust``); a transfer id serves one request, ever
(``n > 1`` children and prompt lists share their parent's parameters: the first one transfers, the others
are served locally; both sides send their prompt's digest, so a P and a D that paired different prompts under
one id fail the transfer instead of decoding the wrong KV). Anything refused is logged (request id and reason, never the values) and counted, and
the request is served locally. Never raises on bad parameters: that would kill the engine.

First-token seeding (docs/wire-contract.md): P's ``request_finished`` hands the token P sampled to the worker,
whose ``Done`` carries it to D. A D request whose parameters ask for it (``pd_seed_first_token``, set by
pd-router only) continues from that token when its load finished (``compat.seed_first_token``): D computes
the position after the prompt and samples the second token, instead of recomputing the last prompt position
and sampling a first token of its own. A load that failed is still seeded when the token is known (from
``Done``, or, in vLLM's standard flow, from P's answer, ``pd_first_token``): D recomputes the prompt and
the token. Any seeded load that ends without a usable token (a failed pd-push load whose ``Done`` never came,
or a load whose token is outside the vocabulary, from a faulty P) ends its request with an error
(``loads_to_fail``), whatever the engine's ``kv_load_failure_policy``, since going on unseeded would repeat
the token the client already has. A seeded request that also asks ``pd_stream_first_token`` (pd-router's
pd-push flow) has D's own stream carry P's token first (``compat.first_token_output``, kept in
``streamed_first_tokens`` until ``compat.hook_step_output`` adds it to the step's outputs as the
request's first), so the client need not wait for P's answer.

P pushes every token D may ask for, from token 0 of the prompt: P's own prefix-cache hit is part of P's block
table but was computed by an earlier request, and D may not have it. The transfer engine sends what D asked
for (``Destinations.start_token`` onward) and fails any transfer that leaves a hole.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_connector import wire
from pd_connector.protocol import prompt_digest
from pd_connector.trust import PeerPolicy
from pd_connector.vllm.compat import (
    StreamedFirstToken,
    first_output_token,
    first_token_output,
    seed_first_token,
)
from pd_connector.vllm.metadata import FinishedSend, PDConnectorMetadata, RecvSpec, SendSpec
from pd_connector.vllm.stats import PDConnectorStats, StatsRecorder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under "vllm." so records go through the handlers vLLM configures in its processes.
logger = logging.getLogger(f"vllm.{__name__}")

#: How many used transfer ids an engine remembers (about 1.6 MB): far more than it serves within a lease.
USED_IDS_KEPT = 16384


@dataclass(frozen=True)
class PrefillRole:
    transfer_id: str
    corrupt: bool = False


@dataclass(frozen=True)
class DecodeRole:
    """D: load from ``prefill_addr``; ``seed``: continue from P's first token (``first_token``: P's answer's
    copy of it, vLLM's standard flow, used when P's ``Done`` brings none); ``stream``: D's stream carries
    that token first."""

    transfer_id: str
    prefill_addr: str
    seed: bool = False
    first_token: int | None = None
    stream: bool = False


@dataclass
class _Send:
    """P: a request whose prompt we push; ``pushed`` is the prompt position the next step's push starts at."""

    request: Request
    role: PrefillRole
    digest: bytes
    pushed: int = 0


def _prompt_len(request: Request) -> int:
    return len(request.prompt_token_ids or ())


class SchedulerSide:
    """Bookkeeping of transfers between scheduler steps; builds the worker's per-step metadata."""

    def __init__(
        self,
        block_size: int,
        side_channel_addr: str,
        vocab_size: int,
        max_model_len: int,
        *,
        producer: bool = True,
        consumer: bool = True,
        policy: PeerPolicy | None = None,
        allow_corruption: bool = False,
    ) -> None:
        self._block_size = block_size
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self._producer = producer
        self._consumer = consumer
        self._policy = policy or PeerPolicy(authenticated=False)
        self._allow_corruption = allow_corruption
        self._side_channel_addr = side_channel_addr
        self._kv_cache_manager: KVCacheManager | None = None
        # What each live request asked of us (None: served locally), decided once per request.
        self._roles: dict[str, PrefillRole | DecodeRole | None] = {}
        # P: requests whose prompt we push, by request id.
        self._sends: dict[str, _Send] = {}
        # Transfer ids this engine has taken (either role), oldest first: each serves one request, ever.
        self._used_ids: OrderedDict[str, None] = OrderedDict()
        # D: loads planned (never load twice), and those still loading.
        self._load_planned: set[str] = set()
        self._loading: set[str] = set()
        # D: loading requests that continue from P's first token once it arrives, by request id.
        self._seeding: dict[str, Request] = {}
        # D: seeded requests whose stream is to carry P's token, by request id: filled while vLLM handles a
        # step's transfer output, emptied by ``compat.hook_step_output`` as that step's outputs are built.
        self.streamed_first_tokens: dict[str, StreamedFirstToken] = {}
        self._pending_recvs: list[RecvSpec] = []
        self._pending_finished: list[FinishedSend] = []
        self._pending_aborts: list[str] = []
        self._stats = StatsRecorder()  # refused requests, reported with the engine's stats

    def classify(self, request: Request) -> PrefillRole | DecodeRole | None:
        """What ``kv_transfer_params`` ask of this engine for ``request`` and may (None: serve it locally)."""
        req_id = request.request_id
        if req_id in self._roles:
            return self._roles[req_id]
        role: PrefillRole | DecodeRole | None = None
        why = ""
        try:
            params = wire.parse_params(request.kv_transfer_params)
        except wire.BadParams as e:
            params, why = None, str(e)
        if isinstance(params, (wire.PushPrefill, wire.StandardPrefill)):
            tid = params.pd_transfer_id if isinstance(params, wire.PushPrefill) else req_id
            if not self._producer:
                why = "prefill parameters on a kv_consumer engine (it never sends KV)"
            elif self._used(tid):
                why = "its transfer id was already used by another request"
            else:
                corrupt = isinstance(params, wire.PushPrefill) and params.pd_test_corrupt
                role = PrefillRole(tid, corrupt)
        elif isinstance(params, (wire.PushDecode, wire.PrefillReturned)):
            refusal = self._policy.refusal(params.pd_prefill_addr)
            if not self._consumer:
                why = "decode parameters on a kv_producer engine (it never loads KV)"
            elif refusal is not None:
                why = refusal
            elif self._used(params.pd_transfer_id):
                why = "its transfer id was already used by another request"
            else:
                first = params.pd_first_token if isinstance(params, wire.PrefillReturned) else None
                stream = isinstance(params, wire.PushDecode) and params.pd_stream_first_token
                role = DecodeRole(
                    params.pd_transfer_id, params.pd_prefill_addr, params.pd_seed_first_token, first, stream
                )
        if why:
            self._stats.refused()
            logger.warning("PDConnector: request %s served locally: %s", req_id, why)
        self._roles[req_id] = role
        return role

    def _used(self, transfer_id: str) -> bool:
        """Whether ``transfer_id`` was taken before; takes it if not (the oldest are forgotten past a bound).

        Ids are single-use: the router makes a fresh one per request, and a second request with a used id (the
        other sequences of ``n > 1`` or of a prompt list, a replay) could otherwise be paired with the first
        one's transfer, or hold P's blocks for a D that never comes.
        """
        if transfer_id in self._used_ids:
            return True
        self._used_ids[transfer_id] = None
        if len(self._used_ids) > USED_IDS_KEPT:
            self._used_ids.popitem(last=False)
        return False

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    # ---- vLLM scheduler hooks ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        role = self.classify(request)
        if not isinstance(role, DecodeRole) or request.request_id in self._load_planned:
            return 0, False
        count = _prompt_len(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        role = self.classify(request)
        if isinstance(role, PrefillRole):
            if req_id not in self._sends:
                self._sends[req_id] = _Send(request, role, prompt_digest(request.prompt_token_ids or ()))
        elif isinstance(role, DecodeRole) and num_external_tokens > 0:
            if req_id in self._load_planned:
                return
            prompt_len = _prompt_len(request)
            local_tokens = prompt_len - num_external_tokens
            if local_tokens % self._block_size:
                logger.warning("PDConnector: %s has %d local tokens, not block aligned", req_id, local_tokens)
            self._load_planned.add(req_id)
            self._loading.add(req_id)
            if role.seed:
                self._seeding[req_id] = request
            self._pending_recvs.append(
                RecvSpec(
                    req_id=req_id,
                    transfer_id=role.transfer_id,
                    prefill_addr=role.prefill_addr,
                    block_ids=list(blocks.get_block_ids()[0]),
                    start_block=local_tokens // self._block_size,
                    num_tokens=prompt_len,
                    prompt_hash=prompt_digest(request.prompt_token_ids or ()),
                )
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        sends: list[SendSpec] = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            send = self._sends.get(req_id)
            if send is None:
                continue
            request, role = send.request, send.role
            prompt_len = _prompt_len(request)
            # Called before vLLM advances num_computed_tokens: this step computes up to ``end``. The push starts
            # where the last one ended (token 0 at first: P's prefix-cache hit must reach D too) and stops at
            # the last whole block, so a block a chunk boundary splits moves once, with the step that fills it.
            end = min(request.num_computed_tokens + num_tokens, prompt_len)
            if end < prompt_len:
                end -= end % self._block_size
            if end <= send.pushed:
                continue
            sends.append(
                SendSpec(
                    req_id=req_id,
                    transfer_id=role.transfer_id,
                    block_ids=list(self._block_ids(req_id)),
                    start_token=send.pushed,
                    end_token=end,
                    prompt_len=prompt_len,
                    corrupt=role.corrupt and self._allow_corruption,
                    prompt_hash=send.digest,
                )
            )
            send.pushed = end
        meta = PDConnectorMetadata(
            sends=sends,
            recvs=self._pending_recvs,
            finished_sends=self._pending_finished,
            aborted_recvs=self._pending_aborts,
            idle_step=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._pending_recvs, self._pending_finished, self._pending_aborts = [], [], []
        return meta

    def update_connector_output(self, finished_recving: set[str], first_tokens: dict[str, int]) -> None:
        """Loads that ended this step (``first_tokens``: P's first token of those whose ``Done`` carried one).

        Called by vLLM before it promotes the finished loads, so a seeded request is promoted with P's token
        as its first output. A failed load is seeded too when the token is known (``_seed_token``): vLLM then
        recomputes the prompt and the token, and D still continues from the token the client was streamed.
        """
        self._loading.difference_update(finished_recving)
        for req_id in finished_recving:
            request = self._seeding.pop(req_id, None)
            if request is None:
                continue
            token = self._seed_token(req_id, first_tokens)
            if token is None or not seed_first_token(request, token):
                logger.warning("PDConnector: seeded request %s loaded without P's first token", req_id)
                continue
            role = self._roles.get(req_id)
            if not (isinstance(role, DecodeRole) and role.stream):
                continue
            streamed = first_token_output(request, self._max_model_len)
            if streamed is None:
                logger.warning(
                    "PDConnector: request %s asked D to stream P's first token with logprobs; not streamed "
                    "(P's answer carries the token and its logprobs)",
                    req_id,
                )
                continue
            self.streamed_first_tokens[req_id] = streamed

    def _seed_token(self, req_id: str, first_tokens: dict[str, int]) -> int | None:
        """The token a seeded request continues from: P's ``Done``'s, else the copy in P's answer (vLLM's
        standard flow); None when neither came, or the token is outside the vocabulary (a faulty or hostile
        peer or caller: it would crash the model's embedding lookup)."""
        role = self._roles.get(req_id)
        token = first_tokens.get(req_id)
        if token is None and isinstance(role, DecodeRole):
            token = role.first_token
        if token is not None and not 0 <= token < self._vocab_size:
            logger.warning("PDConnector: seeded request %s got a token outside the vocabulary", req_id)
            return None
        return token

    def loads_to_fail(self, ended: set[str], first_tokens: dict[str, int]) -> set[str]:
        """D (EngineCore, each step before vLLM applies its failure policy and promotes the step's loads): the
        seeded requests among the loads that ended this step (``ended``: done or failed) that no usable token
        can seed. The client already has P's token, so going on without it (recomputing, or decoding after a
        load that landed) would make D sample a first token of its own and the stream would repeat it; they
        end with an error instead (``compat.hook_step_output``), under any ``kv_load_failure_policy``."""
        doomed = {r for r in ended if r in self._seeding and self._seed_token(r, first_tokens) is None}
        for req_id in doomed:
            del self._seeding[req_id]
            self._loading.discard(req_id)  # reported finished: ending the request aborts no load
            logger.warning(
                "PDConnector: seeded request %s ends with an error: its load ended without a usable first "
                "token from P (going on unseeded would repeat the token the client has)",
                req_id,
            )
        return doomed

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._roles.pop(req_id, None)
        self._load_planned.discard(req_id)
        self._seeding.pop(req_id, None)
        if req_id in self._loading:
            # D aborted while loading: vLLM keeps the blocks until the worker reports the load finished.
            self._loading.discard(req_id)
            self._pending_aborts.append(req_id)
            return False, None
        send = self._sends.pop(req_id, None)
        if send is None:
            return False, None
        transfer_id = send.role.transfer_id
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        delay = bool(block_ids)
        first = first_output_token(request) if ok else None
        self._pending_finished.append(FinishedSend(req_id=req_id, ok=ok, report=delay, first_token=first))
        if not ok:
            return delay, None
        # What a D needs to pull this prefill through vLLM's standard P-then-D flow.
        return delay, wire.encode(
            wire.PrefillReturned(transfer_id, self._side_channel_addr, pd_first_token=first)
        )

    def stats(self) -> PDConnectorStats | None:
        """This interval's refusals (vLLM aggregates the scheduler's stats with the workers')."""
        return self._stats.drain()

    def has_pending_work(self) -> bool:
        return bool(self._pending_finished or self._pending_aborts or self._pending_recvs)

    def _block_ids(self, req_id: str) -> list[int]:
        if self._kv_cache_manager is None:
            raise RuntimeError("PDConnector: vLLM did not bind the KV cache manager")
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])
