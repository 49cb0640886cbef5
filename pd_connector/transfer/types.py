"""Plain data the transfer engine hands to adapters: configuration, states, results, counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransferConfig:
    """Control-plane and lifecycle settings (documented in docs/configuration.md, all times in seconds).

    ``listen_host``/``listen_port``: where a prefill side (P) accepts decode sides (port 0 = ephemeral,
    read the bound address from ``TransferEngine.address``; ``listen_port=None``: no listener, a pure D).
    ``advertise_host``: the host peers should dial (default: ``listen_host``, or this host's address on
    its default route when that is a wildcard such as ``0.0.0.0``).
    ``secret``: shared HMAC-SHA256 key; None disables authentication (trusted networks only).
    ``allowed_prefill_addrs`` / ``allow_insecure``: the peer policy (``pd_connector.trust``).
    """

    engine_id: str
    listen_host: str = "127.0.0.1"
    listen_port: int | None = None
    advertise_host: str | None = None
    connect_timeout_s: float = 5.0
    load_timeout_s: float = 60.0
    lease_s: float = 60.0
    abort_grace_s: float = 5.0
    write_timeout_s: float = 30.0
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    secret: bytes | None = None
    allowed_prefill_addrs: tuple[str, ...] = ()
    allow_insecure: bool = False
    max_frame_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in (
            "connect_timeout_s",
            "load_timeout_s",
            "lease_s",
            "abort_grace_s",
            "write_timeout_s",
            "heartbeat_interval_s",
            "heartbeat_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")


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
    #: When each stage happened on this side, wall-clock seconds (``pd_connector.transfer.timeline``).
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
    per_layer_seconds: dict[int, float] = field(default_factory=dict)
