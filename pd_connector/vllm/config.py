"""``kv_connector_extra_config`` of the PDConnector, parsed and validated once per process.

Who calls it: ``connector.PDConnector`` in every vLLM process it runs in (scheduler and workers), at start-up;
the worker side builds its transfer engine and transport from it. Both roles read the same keys (P uses the
side-channel address it listens on and the lease; D the load timeout), so one frozen dataclass covers both:
the settings both engines share (``pd_connector.settings.ConnectorSettings``: transport, timeouts, lease,
heartbeats, secret, peer policy) plus vLLM's own below. ``load_timeout_s`` defaults to 30 s here, below the
engine's 60 s, so a request waits less than a prefill holds its lease. Unknown keys and wrong types are
rejected at start-up (``settings.parse``): a typo in a JSON file must not silently fall back to a default.
Every key is documented in docs/configuration.md (``## vLLM PDConnector``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal

from pd_connector.settings import ConnectorSettings, SettingError, parse
from pd_connector.transfer import TransferConfig
from pd_connector.transport.factory import TransportConfig
from pd_connector.transport.host import advertised_host


@dataclasses.dataclass(frozen=True, kw_only=True)
class PDConnectorConfig(ConnectorSettings):
    """Settings of one PDConnector instance (seconds for every ``*_s``)."""

    #: P: address the side-channel listener binds to. Not loopback -> a ``secret`` is required (protected mode).
    side_channel_host: str = "127.0.0.1"
    #: P: side-channel port of TP rank 0 (rank k listens on it + k); 0 lets the kernel pick one (TP 1 only;
    #: then D cannot be told it: tests only).
    side_channel_port: int = 0
    #: P: the host D dials (returned in ``kv_transfer_params``); default ``side_channel_host``, or this host's
    #: default-route address when that is a wildcard (0.0.0.0).
    side_channel_advertise_host: str = ""
    #: Address the TCP data listener binds to (D receives there; "0.0.0.0" across hosts).
    data_host: str = "127.0.0.1"
    #: Address peers use to reach the TCP data listener; default ``data_host``, or this host's default-route
    #: address when that is a wildcard (0.0.0.0).
    data_advertise_host: str = ""
    #: Port of the TCP data listener of TP rank 0 (rank k listens on it + k); 0: a free port each start.
    data_port: int = 0
    #: Port peers dial for the TCP data listener of TP rank 0 (rank k: it + k); 0: the listener's own. Set it
    #: when something in between forwards another port to the listener (a NAT; the chaos benchmark's proxy).
    data_advertise_port: int = 0
    #: D: how long a request may wait for its KV before ``kv_load_failure_policy`` applies.
    load_timeout_s: float = 30.0
    #: Both: how the KV cache reaches the transport. "auto": registered as it is where the transport reaches its
    #: memory (host; CUDA with UCX), staged through a pool of pinned host slots where not (CUDA with tcp or
    #: cma). "always": staged even then (to compare, or to keep device memory away from UCX).
    kv_staging: Literal["auto", "always"] = "auto"
    #: Both, when staging: host memory of the staging pool per worker, in MiB (a slot holds one block of every
    #: layer; transfers borrow slots while they run). 0: one slot per cache block (as large as the cache).
    kv_staging_pool_mib: int = 1024
    #: Both, when staging: how long a transfer waits for free slots before it fails (P: from D's destinations
    #: on, its push held back; D: the load is started later, then fails to ``kv_load_failure_policy``).
    kv_staging_wait_s: float = 10.0
    #: EngineCore and workers, on steps that compute nothing (transfers pending): how long vLLM's
    #: shared-memory queue readers spin after a message before they sleep until notified (vLLM's own: 1 s).
    #: Short, so an engine waiting for KV does not spin a core.
    idle_spin_s: float = 0.001
    #: Append one JSON line per transfer (request id, transfer id, when each stage happened) to this file
    #: ("" = off); every worker of the engine appends to it (docs/architecture.md, First-token trace).
    trace_path: str = ""
    #: The name of an environment variable of the vLLM server's process that holds ``secret`` (then leave
    #: ``secret`` unset). Unlike ``secret`` itself, the key then appears neither on the server's command line
    #: (``--kv-transfer-config '{...}'``, which every user of the host can read) nor in vLLM's start-up log of
    #: its arguments, nor in a stored application config (Ray Serve).
    secret_env: str = ""
    #: Test only (P): honour ``"pd_test_corrupt": true`` in a request's kv_transfer_params by zeroing its KV
    #: before it is pushed, so tests can prove D uses the transferred bytes. The zeroed blocks stay in P's
    #: (and D's) prefix cache for that prompt: use such prompts for nothing else. Never enable in production.
    test_allow_corruption: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.secret_env:
            object.__setattr__(self, "secret", _secret_from(self.secret_env, given=bool(self.secret)))
        for name in ("side_channel_port", "data_port", "data_advertise_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise SettingError(name, f"out of range: {getattr(self, name)}")
        if self.kv_staging not in ("auto", "always"):
            raise SettingError("kv_staging", f"must be 'auto' or 'always', got {self.kv_staging!r}")
        if self.kv_staging_pool_mib < 0:
            raise SettingError("kv_staging_pool_mib", f"must be >= 0 MiB, got {self.kv_staging_pool_mib}")
        if self.kv_staging_wait_s < 0:
            raise SettingError("kv_staging_wait_s", f"must be >= 0 s, got {self.kv_staging_wait_s}")
        if not 0 <= self.idle_spin_s <= 1:
            raise SettingError("idle_spin_s", f"must be 0-1 s, got {self.idle_spin_s}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> PDConnectorConfig:
        """Build from ``kv_connector_extra_config``; unknown keys and wrong types raise ``SettingError``."""
        return parse(cls, extra or {}, source="PDConnector kv_connector_extra_config", text=False)

    def transfer_config(self, engine_id: str, listen: bool = False, tp_rank: int = 0) -> TransferConfig:
        """The transfer engine's settings; ``listen`` (P roles) opens the side channel, on the configured port
        plus ``tp_rank`` (one per tensor-parallel rank; D derives them from rank 0's)."""
        port = self.side_channel_port + tp_rank if self.side_channel_port else 0
        return TransferConfig.from_settings(
            self,
            engine_id=engine_id,
            listen_host=self.side_channel_host,
            listen_port=port if listen else None,
            advertise_host=self.side_channel_advertise_host or None,
            load_timeout_s=self.load_timeout_s,
        )

    @property
    def side_channel_addr(self) -> str:
        """``host:port`` D dials for this P (what P returns in ``kv_transfer_params``)."""
        host = advertised_host(self.side_channel_host, self.side_channel_advertise_host or None)
        return f"[{host}]:{self.side_channel_port}" if ":" in host else f"{host}:{self.side_channel_port}"

    def transport_config(self, tp_rank: int = 0) -> TransportConfig:
        """The data plane of TP rank ``tp_rank``: its listener on the configured ports plus the rank."""
        port = self.data_port + tp_rank if self.data_port else 0
        advertised = self.data_advertise_port + tp_rank if self.data_advertise_port else None
        return self.data_plane(self.data_host, self.data_advertise_host or None, port, advertised)


def _secret_from(variable: str, given: bool) -> str:
    """The shared secret held by the environment variable ``variable`` (``secret_env``); ``SettingError``
    when ``secret`` was given too, or when the variable is unset or empty (a P/D pair would otherwise run
    unauthenticated, or refuse each other, for a missing variable)."""
    if given:
        raise SettingError("secret_env", "is set together with secret: set one of them")
    value = os.environ.get(variable, "")
    if not value:
        raise SettingError(
            "secret_env", f"names {variable!r}, which is unset or empty in this process's environment"
        )
    return value
