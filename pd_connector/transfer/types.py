"""Plain data between the transfer engine and the adapters that drive it: its settings (``TransferConfig``,
built by an adapter at start-up), per-request states and results (reported by ``TransferEngine.poll``), and
counters (read by the adapters' metrics)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Protocol

from pd_connector.settings import ConnectorSettings, TransferSettings


@dataclass(frozen=True, kw_only=True)
class TransferConfig(TransferSettings):
    """The transfer engine's settings (documented in docs/configuration.md, all times in seconds): the shared
    ``TransferSettings`` (timeouts, lease, heartbeats, peer policy) plus the engine's own below.

    ``listen_host``/``listen_port``: where a prefill side (P) accepts decode sides (port 0 = ephemeral,
    read the bound address from ``TransferEngine.address``; ``listen_port=None``: no listener, a pure D).
    ``advertise_host``: the host peers should dial (default: ``listen_host``, or this host's address on
    its default route when that is a wildcard such as ``0.0.0.0``).
    ``secret``: shared HMAC-SHA256 key; None disables authentication (trusted networks only).
    """

    engine_id: str
    listen_host: str = "127.0.0.1"
    listen_port: int | None = None
    advertise_host: str | None = None
    load_timeout_s: float = 60.0
    write_timeout_s: float = 30.0
    secret: bytes | None = None
    max_frame_bytes: int = 16 * 1024 * 1024

    @classmethod
    def from_settings(
        cls,
        settings: ConnectorSettings,
        *,
        engine_id: str,
        listen_host: str,
        listen_port: int | None,
        load_timeout_s: float,
        advertise_host: str | None = None,
    ) -> TransferConfig:
        """An adapter's engine settings: its ``TransferSettings`` and ``secret`` as given, where this engine
        listens, and the load timeout (each engine has its own; ``write_timeout_s`` and ``max_frame_bytes``
        keep the defaults)."""
        shared = {f.name: getattr(settings, f.name) for f in fields(TransferSettings)}
        return cls(
            **shared,
            engine_id=engine_id,
            listen_host=listen_host,
            listen_port=listen_port,
            advertise_host=advertise_host,
            load_timeout_s=load_timeout_s,
            secret=settings.secret.encode() or None,
        )


class TransferState(enum.Enum):
    """Per-request state, on either side. DONE, FAILED and ABORTED are terminal.

    Sender (P): WAITING for D's destinations -> TRANSFERRING once they are known -> DONE once every write
    landed and ``Done`` was sent to each D rank it serves (P waits for no acknowledgement); FAILED on lease
    expiry, a write error, a hole or D's death; ABORTED by either side.
    Receiver (D): WAITING for P's first landed layer -> TRANSFERRING -> DONE on ``Done``; FAILED on timeout,
    refusal or P's death; ABORTED by either side.
    """

    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.ABORTED)


class _Stateful(Protocol):
    state: TransferState


def state_in(table: Mapping[str, _Stateful], transfer_id: str) -> TransferState | None:
    """The state of ``transfer_id`` in one side's table of live transfers, None when it holds none."""
    entry = table.get(transfer_id)
    return None if entry is None else entry.state


@dataclass(frozen=True)
class TransferResult:
    """A transfer that ended, reported exactly once by ``TransferEngine.poll``.

    Once reported, the engine holds no state for it and will not touch its blocks again: a sender adapter
    frees P's source blocks; a receiver adapter uses D's blocks (DONE) or recomputes / fails (otherwise).
    """

    transfer_id: str
    role: str  # "send" (P) or "recv" (D)
    state: TransferState
    reason: str = ""
    num_tokens: int = 0
    first_token: int | None = None
    bytes: int = 0
    duration_s: float = 0.0
    exposed_s: float = 0.0
    lease_expired: bool = False
    #: D: the load failed because the KV that landed did not match P's checksums (``integrity_check``).
    integrity_failed: bool = False
    #: When each stage happened on this side, wall-clock seconds (``pd_connector.timeline``).
    stages: dict[str, float] = field(default_factory=dict)


@dataclass
class TransferCounters:
    """Cumulative counters since start; adapters export them (e.g. as Prometheus counters).

    ``exposed_seconds``: on P, time from ``finish`` (last layer computed) until every write landed, i.e.
    the transfer time not hidden behind compute. ``layer_seconds``/``layer_writes``: summed duration and
    number of per-layer writes (mean time per layer = ratio).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_sent: int = 0
    transfers_received: int = 0
    failures: int = 0
    aborts: int = 0
    expired_leases: int = 0
    timeouts: int = 0
    layer_writes: int = 0
    layer_seconds: float = 0.0
    exposed_seconds: float = 0.0
    rejected_connections: int = 0
    #: D: loads failed because the KV that landed did not match P's checksums (``integrity_check``).
    integrity_failures: int = 0
    per_layer_seconds: dict[int, float] = field(default_factory=dict)
