"""The connector's transfer settings, defined once (names, types, defaults, checks), and the one parser of
them.

Who uses it, once per process at start-up: the engine adapters and the transfer engine. What a user sets on
either engine is ``ConnectorSettings`` plus the adapter's own fields: ``vllm.config.PDConnectorConfig`` (vLLM's
``kv_connector_extra_config``, JSON values) and ``sglang.config.SGLangBackendConfig`` (``PD_SGLANG_*``
environment variables, text), both read by ``parse``. The transfer engine's ``TransferConfig`` is
``TransferSettings`` plus where it listens and its own limits; ``TransferConfig.from_settings`` and
``ConnectorSettings.data_plane`` turn an adapter's settings into the engine's and the transport's.
docs/configuration.md documents each of them and tests/test_docs.py checks its tables against these classes.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pd_connector.transport.factory import TRANSPORT_KINDS, TransportConfig, TransportKind
from pd_connector.transport.tcp import TcpConfig
from pd_connector.trust import PeerPolicy


class SettingError(ValueError):
    """A setting cannot take the value it was given; the message names it as the user wrote it."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting} {problem}")
        self.setting = setting
        self.problem = problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferSettings:
    """How long a transfer and its connections may take and which peers to deal with: the settings the
    transfer engine and both adapters share, under these names and with these defaults. Every ``*_s`` (here
    and in subclasses) is a positive number of seconds."""

    #: Connecting and handshaking with a peer.
    connect_timeout_s: float = 5.0
    #: P: idle lease of a transfer; a D that never shows up (or stalls) frees P's blocks after this.
    lease_s: float = 60.0
    #: After an abort, how long a side waits for the peer's acknowledgement before closing the connection.
    abort_grace_s: float = 5.0
    #: Control-connection heartbeat period and the silence after which a peer is declared dead.
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    #: D: the prefill side channels it may dial (``host``, ``host:port``, CIDR ``10.0.0.0/8[:port]``, IPv6 in
    #: brackets; names compared as written). Empty: any with a secret, loopback only without one.
    allowed_prefill_addrs: tuple[str, ...] = ()
    #: Lift protected mode: listen beyond loopback and dial any prefill with no secret (trusted networks only).
    allow_insecure: bool = False
    #: Integrity mode: P sends xxh3 checksums of the KV it wrote, D fails a load whose bytes differ
    #: (``pd_connector.transfer.integrity``). P and D must agree (the handshake refuses a mismatch).
    integrity_check: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name.endswith("_s") and getattr(self, f.name) <= 0:
                raise SettingError(f.name, f"must be positive, got {getattr(self, f.name)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise SettingError(
                "heartbeat_timeout_s",
                f"must exceed heartbeat_interval_s ({self.heartbeat_interval_s}), got {self.heartbeat_timeout_s}",
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConnectorSettings(TransferSettings):
    """What a user sets on either engine: ``TransferSettings``, the data plane and the control plane's key."""

    #: Data plane: "tcp" (dependency-free), "ucx" (ucxx: shared memory / RDMA), "cma" (P and D on one host:
    #: process_vm_writev), "auto" (ucx if installed, never cma).
    transport: TransportKind = "tcp"
    #: Shared HMAC-SHA256 key for the control plane ("" disables authentication: loopback only, unless
    #: ``allow_insecure``). Kept out of the settings' repr.
    secret: str = dataclasses.field(default="", repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transport not in TRANSPORT_KINDS:
            raise SettingError("transport", f"must be one of {TRANSPORT_KINDS}, got {self.transport!r}")
        self.peer_policy()  # a bad allow-list entry fails here, at start

    def peer_policy(self) -> PeerPolicy:
        """Which prefill addresses D may dial, and whether this side may run unauthenticated beyond loopback."""
        return PeerPolicy(bool(self.secret), self.allowed_prefill_addrs, self.allow_insecure)

    def data_plane(
        self,
        data_host: str,
        data_advertise_host: str | None = None,
        data_port: int = 0,
        data_advertise_port: int | None = None,
    ) -> TransportConfig:
        """The transport to build: ``transport``, with the TCP data listener on ``data_host``:``data_port``
        (0: a free port) and peers told to dial the advertised host and port (other transport settings keep
        their defaults)."""
        tcp = TcpConfig(
            host=data_host,
            port=data_port,
            advertise_host=data_advertise_host,
            advertise_port=data_advertise_port,
        )
        return TransportConfig(kind=self.transport, tcp=tcp)


Settings = TypeVar("Settings", bound=ConnectorSettings)


def parse(
    cls: type[Settings],
    given: Mapping[str, Any],
    *,
    source: str,
    text: bool,
    names: Mapping[str, str] | None = None,
) -> Settings:
    """Build ``cls`` from the settings a user gave, by field name; ``SettingError`` for anything else.

    ``text``: the values are environment variables, converted by the field's type (numbers, ``0``/``1`` for
    flags, comma-separated lists; empty text means unset); otherwise they are JSON values and must already have
    the field's type (an int where a float goes is fine). ``names``: how the user spells each field (default:
    its name), used in every error; ``source``: where the settings came from, named when one is unknown.
    """
    names = names or {}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise SettingError(source, f"has unknown keys: {unknown}")
    values: dict[str, Any] = {}
    for field, raw in given.items():
        if text and raw == "":
            continue
        try:
            values[field] = (
                _from_text(_kind(hints[field]), raw) if text else _from_json(_kind(hints[field]), raw)
            )
        except ValueError as exc:
            shown = "<hidden>" if field == "secret" else repr(raw)
            raise SettingError(names.get(field, field), f"must be {exc}, got {shown}") from None
    try:
        return cls(**values)
    except SettingError as exc:
        raise SettingError(names.get(exc.setting, exc.setting), exc.problem) from None


#: What a JSON value of each kind of field must be, and the test.
_JSON: dict[type, tuple[str, Callable[[Any], bool]]] = {
    bool: ("of type bool", lambda v: isinstance(v, bool)),
    int: ("of type int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("of type float", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    str: ("of type str", lambda v: isinstance(v, str)),
    tuple: ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v)),
}
#: What the text of each kind of field must be, and its conversion (``ValueError`` when it is not that).
_TEXT: dict[type, tuple[str, Callable[[str], Any]]] = {
    bool: ("0 or 1", lambda t: {"0": False, "1": True}[t]),
    int: ("a whole number", int),
    float: ("a number", float),
    str: ("text", str),
    tuple: ("a comma-separated list", lambda t: tuple(_items(t))),
    frozenset: ("a comma-separated list of whole numbers", lambda t: frozenset(int(i) for i in _items(t))),
}


def _kind(hint: Any) -> type:
    """The kind of value a field holds: its type, a generic's container type, ``str`` for a ``Literal``."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return str
    return typing.cast(type, origin or hint)


def _from_json(kind: type, raw: Any) -> Any:
    what, ok = _JSON[kind]
    if not ok(raw):
        raise ValueError(what)
    return float(raw) if kind is float else tuple(raw) if kind is tuple else raw


def _from_text(kind: type, raw: str) -> Any:
    what, convert = _TEXT[kind]
    try:
        return convert(raw)
    except (KeyError, ValueError):
        raise ValueError(what) from None


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]
