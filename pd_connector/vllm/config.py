"""``kv_connector_extra_config`` of the PDConnector, parsed and validated once per process.

Both sides read the same keys (P uses the side-channel address it listens on; D uses the timeouts), so one
frozen dataclass covers both roles. Unknown keys are rejected: a typo in a JSON file must fail at start-up,
not silently fall back to a default. Every key is documented in docs/configuration.md (``## vLLM PDConnector``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

TRANSPORTS = ("tcp",)


@dataclasses.dataclass(frozen=True)
class PDConnectorConfig:
    """Settings of one PDConnector instance (seconds for every ``*_s``)."""

    #: Address P's worker listens on for D's connections (the router's ``bootstrap``).
    side_channel_host: str = "127.0.0.1"
    #: Port of that listener; 0 lets the kernel pick one (only useful in unit tests: D must know it).
    side_channel_port: int = 0
    #: Data plane used for the layer pushes.
    transport: str = "tcp"
    #: D: how long a request may wait for its KV (connect + all layers + Done) before the failure policy.
    load_timeout_s: float = 30.0
    #: D: time allowed to open the connection to P's side channel.
    connect_timeout_s: float = 5.0
    #: P: how long a finished prefill keeps its blocks for a D that has not acknowledged the transfer.
    lease_s: float = 60.0
    #: Shared secret both sides must hold; D proves it with an HMAC of the transfer id (empty: no auth).
    secret: str = ""
    #: Test only (P): honour ``"pd_test_corrupt": true`` in a request's kv_transfer_params by sending zeros
    #: instead of its KV, so tests can prove D really uses the transferred bytes. Never enable in production.
    test_allow_corruption: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not 0 <= self.side_channel_port <= 65535:
            raise ValueError(f"side_channel_port out of range: {self.side_channel_port}")
        for name in ("load_timeout_s", "connect_timeout_s", "lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> PDConnectorConfig:
        """Build from ``kv_connector_extra_config``; unknown keys and wrong types raise ``ValueError``."""
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"unknown PDConnector kv_connector_extra_config keys: {unknown}")
        values: dict[str, Any] = {}
        for key, raw in extra.items():
            kind = type(getattr(cls, key))
            if kind is bool:
                if not isinstance(raw, bool):
                    raise ValueError(f"{key} must be a boolean, got {raw!r}")
                values[key] = raw
            elif kind is float:
                if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                    raise ValueError(f"{key} must be a number, got {raw!r}")
                values[key] = float(raw)
            elif kind is int:
                if isinstance(raw, bool) or not isinstance(raw, int):
                    raise ValueError(f"{key} must be an integer, got {raw!r}")
                values[key] = raw
            else:
                if not isinstance(raw, str):
                    raise ValueError(f"{key} must be a string, got {raw!r}")
                values[key] = raw
        return cls(**values)
