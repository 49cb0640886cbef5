"""``kv_connector_extra_config`` of the PDConnector, parsed and validated once per process.

Both roles read the same keys (P uses the side-channel address it listens on and the lease; D the load
timeout), so one frozen dataclass covers both. Unknown keys and wrong types are rejected at start-up: a typo
in a JSON file must not silently fall back to a default. Every key is documented in docs/configuration.md
(``## vLLM PDConnector``); the lifecycle keys map onto ``pd_connector.transfer.TransferConfig`` fields of the
same names (``write_timeout_s`` and ``max_frame_bytes`` keep the engine's defaults, and ``load_timeout_s``
defaults to 30 s here, below the engine's 60 s, so a request waits less than a prefill holds its lease).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

from pd_connector.transfer import TransferConfig
from pd_connector.transport.factory import TransportConfig, TransportKind
from pd_connector.transport.host import advertised_host
from pd_connector.transport.tcp import TcpConfig
from pd_connector.trust import PeerPolicy

TRANSPORTS = ("tcp", "ucx", "cma", "auto")


@dataclasses.dataclass(frozen=True)
class PDConnectorConfig:
    """Settings of one PDConnector instance (seconds for every ``*_s``)."""

    #: P: address the side-channel listener binds to. Not loopback -> a ``secret`` is required (protected mode).
    side_channel_host: str = "127.0.0.1"
    #: P: side-channel port of TP rank 0 (rank k listens on it + k); 0 lets the kernel pick one (TP 1 only;
    #: then D cannot be told it: tests only).
    side_channel_port: int = 0
    #: P: the host D dials (returned in ``kv_transfer_params``); default ``side_channel_host``, or this host's
    #: default-route address when that is a wildcard (0.0.0.0).
    side_channel_advertise_host: str = ""
    #: Data plane: "tcp" (dependency-free), "ucx" (ucxx: shared memory / RDMA), "cma" (P and D on one host:
    #: process_vm_writev), "auto" (ucx if installed, never cma).
    transport: str = "tcp"
    #: Address the TCP data listener binds to (D receives there; "0.0.0.0" across hosts).
    data_host: str = "127.0.0.1"
    #: Address peers use to reach the TCP data listener; default ``data_host``, or this host's default-route
    #: address when that is a wildcard (0.0.0.0).
    data_advertise_host: str = ""
    #: D: how long a request may wait for its KV before ``kv_load_failure_policy`` applies.
    load_timeout_s: float = 30.0
    #: Connecting and handshaking with a peer.
    connect_timeout_s: float = 5.0
    #: P: idle lease of a transfer; a D that never shows up (or stalls) frees P's blocks after this.
    lease_s: float = 60.0
    #: After an abort, how long a side waits for the peer's acknowledgement before closing the connection.
    abort_grace_s: float = 5.0
    #: Control-connection heartbeat period and the silence after which a peer is declared dead.
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    #: Shared HMAC-SHA256 key for the control plane ("" disables authentication: loopback only, unless
    #: ``allow_insecure``).
    secret: str = ""
    #: D: the prefill side channels it may dial (``host``, ``host:port``, CIDR ``10.0.0.0/8[:port]``, IPv6 in
    #: brackets; names compared as written). Empty: any with a ``secret``, loopback only without one.
    allowed_prefill_addrs: tuple[str, ...] = ()
    #: Lift protected mode: listen beyond loopback and dial any prefill with no secret (trusted networks only).
    allow_insecure: bool = False
    #: Append one JSON line per transfer (request id, transfer id, when each stage happened) to this file
    #: ("" = off); every worker of the engine appends to it (docs/architecture.md, First-token trace).
    trace_path: str = ""
    #: Test only (P): honour ``"pd_test_corrupt": true`` in a request's kv_transfer_params by zeroing its KV
    #: before it is pushed, so tests can prove D uses the transferred bytes. The zeroed blocks stay in P's
    #: (and D's) prefix cache for that prompt: use such prompts for nothing else. Never enable in production.
    test_allow_corruption: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not 0 <= self.side_channel_port <= 65535:
            raise ValueError(f"side_channel_port out of range: {self.side_channel_port}")
        self.peer_policy()  # a bad allow-list entry fails here, at start
        # TransferConfig validates the lifecycle settings (positive times, heartbeat ordering).
        self.transfer_config("check")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> PDConnectorConfig:
        """Build from ``kv_connector_extra_config``; unknown keys and wrong types raise ``ValueError``."""
        extra = dict(extra or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"unknown PDConnector kv_connector_extra_config keys: {unknown}")
        values: dict[str, Any] = {}
        for key, raw in extra.items():
            kind = type(getattr(cls, key))
            if kind is bool:
                ok = isinstance(raw, bool)
            elif kind is tuple:
                ok = isinstance(raw, list) and all(isinstance(v, str) for v in raw)
                raw = tuple(raw) if ok else raw
            elif kind is float:
                ok = isinstance(raw, (int, float)) and not isinstance(raw, bool)
                raw = float(raw) if ok else raw
            elif kind is int:
                ok = isinstance(raw, int) and not isinstance(raw, bool)
            else:
                ok = isinstance(raw, str)
            if not ok:
                what = "a list of strings" if kind is tuple else f"of type {kind.__name__}"
                shown = "<hidden>" if key == "secret" else repr(raw)
                raise ValueError(f"{key} must be {what}, got {shown}")
            values[key] = raw
        return cls(**values)

    def transfer_config(self, engine_id: str, listen: bool = False, tp_rank: int = 0) -> TransferConfig:
        """The transfer engine's settings; ``listen`` (P roles) opens the side channel, on the configured port
        plus ``tp_rank`` (one per tensor-parallel rank; D derives them from rank 0's)."""
        port = self.side_channel_port + tp_rank if self.side_channel_port else 0
        return TransferConfig(
            engine_id=engine_id,
            listen_host=self.side_channel_host,
            listen_port=port if listen else None,
            connect_timeout_s=self.connect_timeout_s,
            load_timeout_s=self.load_timeout_s,
            lease_s=self.lease_s,
            abort_grace_s=self.abort_grace_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            secret=self.secret.encode() or None,
            advertise_host=self.side_channel_advertise_host or None,
            allowed_prefill_addrs=self.allowed_prefill_addrs,
            allow_insecure=self.allow_insecure,
        )

    def peer_policy(self) -> PeerPolicy:
        """Which prefill addresses D may dial (the scheduler side checks it before it plans a load)."""
        return PeerPolicy(bool(self.secret), self.allowed_prefill_addrs, self.allow_insecure)

    @property
    def side_channel_addr(self) -> str:
        """``host:port`` D dials for this P (what P returns in ``kv_transfer_params``)."""
        host = advertised_host(self.side_channel_host, self.side_channel_advertise_host or None)
        return f"[{host}]:{self.side_channel_port}" if ":" in host else f"{host}:{self.side_channel_port}"

    def transport_config(self) -> TransportConfig:
        return TransportConfig(
            kind=cast(TransportKind, self.transport),
            tcp=TcpConfig(host=self.data_host, advertise_host=self.data_advertise_host or None),
        )
