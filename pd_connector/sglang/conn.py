"""KVManager, KVSender, KVReceiver and BootstrapServer of the SGLang transfer backend ``pd``.

SGLang's scheduler creates one ``PdKVManager`` per scheduler process (prefill or decode), one ``PdKVSender``
per request on a prefill server (P) and one ``PdKVReceiver`` per request on a decode server (D); the HTTP
``PdKVBootstrapServer`` runs in P's launcher process. They subclass SGLang's ``Common*`` classes, which keep
SGLang's bootstrap protocol (P registers its ranks with its bootstrap server; D looks them up by
``bootstrap_host:bootstrap_port``; requests are matched by ``bootstrap_room``) and the ``KVPoll`` bookkeeping
that ``decode.py``/``prefill.py`` call into; those classes and every other SGLang internal used here come
through ``compat.py``. What moves the KV is pd_connector's ``TransferEngine``:

- P's manager runs the engine's side-channel listener and advertises its port as the rank port in the
  bootstrap registration (the Common zmq socket of P is not used by this backend);
- D's receiver, once SGLang has allocated its pages (``send_metadata``), calls ``engine.expect`` with the
  room as transfer id, its page ids and P's side-channel address;
- P pushes each layer's new pages as the forward pass writes them (``layerwise.py``: the manager's
  ``plan_forward`` before each forward, a hook after each layer's write); P's sender, called once per
  prefill chunk after the forward pass, offers the chunk's pages, pushes every layer of what no layer-wise
  push covered (all of it where layer-wise pushing is off or unavailable), and on the last chunk calls
  ``finish`` with the first sampled token, which D writes into its metadata row.

A background thread per manager turns the engine's results into ``KVPoll`` states (and, with SGLang's
``--enable-metrics``, into the ``sglang:pd_connector_*`` metrics of ``stats.py``). Every path ends: P waits
for D at most ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (and its lease), D waits for the KV at most
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, dead peers are noticed by heartbeats, and aborts are sent to the
other side. Methods called by SGLang's scheduler never raise for transfer problems: they log, record the
failure and report ``KVPoll.Failed``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import numpy as np
import numpy.typing as npt

from pd_connector.sglang import compat
from pd_connector.sglang.compat import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    DisaggregationMode,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    ServerArgs,
    read_first_token,
    write_first_token,
)
from pd_connector.sglang.config import SGLangBackendConfig
from pd_connector.sglang.kv_buffers import UnsupportedPool, describe_pool, resolve_dtype
from pd_connector.sglang.layerwise import ForwardPlan, LayerPusher, transfer_id
from pd_connector.sglang.stats import TransferMetrics
from pd_connector.transfer.engine import TransferEngine
from pd_connector.transfer.types import TransferConfig, TransferResult, TransferState

logger = logging.getLogger(__name__)

#: How often the result thread drains the transfer engine (seconds): bounds the extra latency of a poll.
RESULT_POLL_INTERVAL_S = 0.002


class PdKVManager(CommonKVManager):
    """Per scheduler process: owns the transfer engine and maps its results onto SGLang's room states.

    With ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1`` D holds the pages of a failed or aborted
    request until ``is_abort_release_safe``: the engine reported the transfer, which it does only once P
    acknowledged the abort (or the connection was closed), so no late write can land in reused pages.
    """

    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None:
        if is_mla_backend:
            raise UnsupportedPool("the pd transfer backend supports MHA KV caches only (not MLA)")
        if getattr(server_args, "disaggregation_enable_kv_checksum", False):
            raise UnsupportedPool("--disaggregation-enable-kv-checksum is not supported by the pd backend")
        self.pd_config = SGLangBackendConfig.from_env()
        dtype = resolve_dtype(
            getattr(server_args, "kv_cache_dtype", None), getattr(server_args, "dtype", None)
        )
        self.pd_layout, self._pd_buffers = describe_pool(args, dtype, compat.rank_kv_heads(args, server_args))
        self._pd_engine: TransferEngine | None = None
        self._pd_lock = threading.Lock()
        self._pd_aux: dict[int, int] = {}  # D: room -> metadata row to fill on success
        self._pd_live_recvs: set[int] = set()  # D: rooms whose transfer the engine has not reported yet
        self._pd_stop = threading.Event()
        # CommonKVManager.__init__ calls register_to_bootstrap() on P, which starts the engine's listener.
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        compat.require_manager(self)
        compat.require_metadata_rows(args)
        self._pd_metrics = (
            TransferMetrics(compat.metric_labels(server_args, args, disaggregation_mode))
            if compat.metrics_enabled(server_args)
            else None
        )
        if self._pd_engine is None:
            self._pd_engine = self._start_engine(listen=False)
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        self._pd_pusher = LayerPusher(
            self.pd_engine,
            self.pd_layout.num_layers,
            layerwise=prefill and self.pd_config.layerwise,
            wrong_kv_rooms=self.pd_config.wrong_kv_rooms,
            skip_layer_rooms=self.pd_config.skip_layer_rooms,
            count=self._pd_metrics.layer_push if self._pd_metrics is not None else None,
        )
        self._pd_layerwise_checked = False
        if disaggregation_mode == DisaggregationMode.DECODE:
            self._start_heartbeat_checker_thread()
        self._pd_thread = threading.Thread(target=self._result_loop, name="pd-sglang-results", daemon=True)
        self._pd_thread.start()

    # ---- start-up --------------------------------------------------------------------------------------------
    def _start_engine(self, *, listen: bool) -> TransferEngine:
        from pd_connector.transport.factory import create_transport

        config = TransferConfig.from_settings(
            self.pd_config,
            engine_id=f"sglang-{self.disaggregation_mode.value}-{uuid.uuid4().hex[:8]}",
            listen_host=self.local_ip,
            listen_port=0 if listen else None,
            load_timeout_s=compat.waiting_timeout_s(),
        )
        transport = create_transport(self.pd_config.data_plane(self.local_ip))
        engine = TransferEngine(config, self.pd_layout, self._pd_buffers, transport)
        logger.info(
            "pd transfer backend (%s): engine %s, layout %s, side channel %s",
            self.disaggregation_mode.value,
            config.engine_id,
            self.pd_layout,
            engine.address,
        )
        return engine

    def register_to_bootstrap(self) -> None:
        """P only: start the engine's listener and advertise its port as this rank's port."""
        self._pd_engine = self._start_engine(listen=True)
        assert self._pd_engine.address is not None
        self.rank_port = int(self._pd_engine.address.rsplit(":", 1)[1])
        super().register_to_bootstrap()

    @property
    def pd_engine(self) -> TransferEngine:
        assert self._pd_engine is not None, "pd KV manager used before its engine started"
        return self._pd_engine

    # ---- prefill side (called by PdKVSender on the scheduler thread) -------------------------------------
    def open_send(self, room: int) -> None:
        """Start the sender state and its lease, before D's destinations arrive."""
        self._pd_pusher.open(room)

    def plan_forward(self, scheduler: Any, batch: Any) -> tuple[ForwardPlan, LayerPusher] | None:
        """Before a prefill forward pass (``layerwise.run_batch_hook``): plan the layer-wise push of the batch's
        rooms (None: nothing to push per layer, or layer-wise pushing is off; the first call decides whether it
        can be on and logs it). A room that cannot be planned fails."""
        pusher = self._pd_pusher
        if not pusher.layerwise:
            return None
        if not self._pd_layerwise_checked:
            self._pd_layerwise_checked = True
            problem = compat.layerwise_problem(scheduler)
            if problem is not None:
                pusher.layerwise = False
                logger.warning("pd backend: KV is pushed per chunk after each forward pass: %s", problem)
                return None
            logger.info("pd backend: KV is pushed layer by layer as the forward pass writes it")
        plan, failed = pusher.plan(
            compat.forward_requests(scheduler, batch, self), compat.page_size(scheduler)
        )
        for room, error in failed.items():
            logger.error("pd backend: layer-wise push of room %s cannot be planned: %s", room, error)
            self.fail_room(room, f"pd backend could not plan the layer-wise push: {error}")
        return None if plan is None else (plan, pusher)

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        **_: Any,
    ) -> None:
        """One prefill chunk is computed: push every layer of its pages no layer-wise push covered; the last
        chunk also finishes (``Done`` once every write landed)."""
        try:
            self._pd_pusher.add_chunk(
                bootstrap_room, [int(p) for p in kv_indices], index_slice.start, index_slice.stop
            )
            if is_last_chunk:
                first = read_first_token(self.kv_args, aux_index) if aux_index is not None else None
                self.pd_engine.finish(transfer_id(bootstrap_room), first_token=first)
            self.update_status(bootstrap_room, KVPoll.Transferring)
        except Exception as e:  # never raise into the scheduler
            logger.exception("pd backend: send of room %s failed", bootstrap_room)
            self.fail_room(bootstrap_room, f"pd backend send failed: {e}")

    # ---- decode side (called by PdKVReceiver on the scheduler thread) ------------------------------------
    def expect(
        self, room: int, prefill_addr: str, kv_indices: npt.NDArray[np.int32], aux_index: int | None
    ) -> None:
        """Ask P to write the request's KV into ``kv_indices`` (D's pages, in token order)."""
        try:
            pages = [int(p) for p in kv_indices]
            if not pages:
                raise ValueError("no destination pages")
            with self._pd_lock:
                self._pd_live_recvs.add(room)
                if aux_index is not None:
                    self._pd_aux[room] = aux_index
            self.pd_engine.expect(
                transfer_id(room),
                prefill_addr,
                pages,
                num_tokens=len(pages) * self.pd_layout.block_tokens,
                timeout_s=self.waiting_timeout,
            )
            self.update_status(room, KVPoll.Transferring)
        except Exception as e:  # never raise into the scheduler
            logger.exception("pd backend: expect for room %s failed", room)
            with self._pd_lock:
                self._pd_live_recvs.discard(room)
            self.fail_room(room, f"pd backend could not request the KV: {e}")

    # ---- both sides ------------------------------------------------------------------------------------------
    def fail_room(self, room: int, reason: str) -> None:
        """Record ``reason``, mark the room Failed and abort its transfer on both sides (idempotent; counted
        once as a failure)."""
        if self._pd_metrics is not None and self.request_status.get(room) != KVPoll.Failed:
            self._pd_metrics.failure()
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)
        self.abort_transfer(room, reason)

    def abort_transfer(self, room: int, reason: str) -> None:
        """Tell the engine (and through it the peer) to stop; unknown rooms are ignored."""
        self._pd_pusher.forget(room)
        with self._pd_lock:
            self._pd_aux.pop(room, None)
        try:
            self.pd_engine.abort(transfer_id(room), reason)
        except Exception:
            logger.exception("pd backend: abort of room %s failed", room)

    def _result_loop(self) -> None:
        """Background thread: apply engine results and D's arrival to the rooms' ``KVPoll`` states."""
        while not self._pd_stop.wait(RESULT_POLL_INTERVAL_S):
            try:
                self._promote_bootstrapped_sends()
                for result in self.pd_engine.poll():
                    self._apply(result)
            except Exception:
                logger.exception("pd backend: result loop error (continuing)")

    def _promote_bootstrapped_sends(self) -> None:
        """P: a room whose decode side sent its destinations may run its prefill (WaitingForInput)."""
        if self.disaggregation_mode != DisaggregationMode.PREFILL:
            return
        for room in self._pd_pusher.rooms():
            if self.request_status.get(room) != KVPoll.Bootstrapping:
                continue
            if self.pd_engine.state(transfer_id(room)) is TransferState.TRANSFERRING:
                self.update_status(room, KVPoll.WaitingForInput)

    def _apply(self, result: TransferResult) -> None:
        if not result.transfer_id.startswith("sgl-"):
            return
        if self._pd_metrics is not None:
            self._pd_metrics.record(result, self.pd_engine.counters().layer_seconds)
        room = int(result.transfer_id[4:])
        self._pd_pusher.forget(room)
        with self._pd_lock:
            aux_index = self._pd_aux.pop(room, None)
            if result.role == "recv":
                self._pd_live_recvs.discard(room)
        if room not in self.request_status:
            return  # SGLang already cleared the request
        if result.state is TransferState.DONE:
            if result.role == "recv":
                if aux_index is None or result.first_token is None:
                    self.fail_room(room, "transfer finished without the first token")
                    return
                write_first_token(self.kv_args, aux_index, result.first_token, room)
            self.update_status(room, KVPoll.Success)
        else:
            self.record_failure(room, f"pd transfer {result.state.value}: {result.reason}")
            self.update_status(room, KVPoll.Failed)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """D: the pages of a failed/aborted room may be reused once the engine reported its transfer."""
        with self._pd_lock:
            return bootstrap_room not in self._pd_live_recvs

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        """D: a prefill's bootstrap server stopped answering heartbeats: fail and abort its rooms."""
        rooms = list(self.addr_to_rooms_tracker.get(failed_bootstrap_addr, []))
        super()._handle_node_failure(failed_bootstrap_addr)
        for room in rooms:
            if self.request_status.get(room) == KVPoll.Failed:
                self.abort_transfer(room, f"prefill {failed_bootstrap_addr} stopped answering heartbeats")

    def table_sizes(self) -> dict[str, int]:
        """Open per-room entries here and in the engine (tests and logs check they drain to zero)."""
        with self._pd_lock:
            own = {
                "pages": len(self._pd_pusher.rooms()),
                "aux": len(self._pd_aux),
                "live_recvs": len(self._pd_live_recvs),
            }
        return {**own, **self.pd_engine.table_sizes()}


class PdKVSender(CommonKVSender):
    """P side of one request; SGLang calls ``send`` once per prefill chunk (Common splits the indices)."""

    kv_mgr: PdKVManager

    def __init__(
        self,
        mgr: PdKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        if self.conclude_state is None and self.init_time is not None:
            try:
                mgr.open_send(bootstrap_room)
            except Exception as e:  # never raise into the scheduler
                logger.exception("pd backend: cannot open send of room %s", bootstrap_room)
                mgr.fail_room(bootstrap_room, f"pd backend could not start the transfer: {e}")

    def poll(self) -> KVPoll:
        status = super().poll()
        if status == KVPoll.Failed:
            # Bootstrap timeout or a failure elsewhere: make sure the engine lets go of the room too.
            self.kv_mgr.abort_transfer(self.bootstrap_room, "prefill gave up on the request")
        return status

    def abort(self) -> None:
        super().abort()
        self.kv_mgr.abort_transfer(self.bootstrap_room, "aborted on prefill")

    def clear(self) -> None:
        if self.kv_mgr.request_status.get(self.bootstrap_room) not in (KVPoll.Success, None):
            self.kv_mgr.abort_transfer(self.bootstrap_room, "prefill request cleared")
        super().clear()


class PdKVReceiver(CommonKVReceiver):
    """D side of one request: bootstrap lookup (Common), then ``send_metadata`` asks P for the KV."""

    kv_mgr: PdKVManager
    conclude_state: int | None  # a KVPoll value once concluded (set by CommonKVReceiver)

    def _register_kv_args(self) -> bool:
        # The transfer engine's handshake carries D's layout and memory; nothing to send over zmq.
        return self.bootstrap_infos is not None

    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ) -> None:
        if self.conclude_state is not None:
            return
        infos = [i for i in getattr(self, "bootstrap_infos", None) or [] if not i.get("is_dummy")]
        if len(infos) != 1 or decode_prefix_len or state_indices:
            reason = (
                f"pd backend needs exactly one prefill rank per decode rank and no decode prefix/state "
                f"(got {len(infos)} ranks, prefix {decode_prefix_len}, state {bool(state_indices)})"
            )
            self.kv_mgr.fail_room(self.bootstrap_room, reason)
            self.conclude_state = KVPoll.Failed
            return
        self.init_time = time.time()
        addr = f"{infos[0]['rank_ip']}:{infos[0]['rank_port']}"
        self.kv_mgr.expect(self.bootstrap_room, addr, kv_indices, aux_index)

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        self.kv_mgr.abort_transfer(self.bootstrap_room, "aborted on decode")


class PdKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap server, unchanged: P ranks register, D ranks look them up."""
