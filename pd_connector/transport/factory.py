"""Pick and build the data plane from configuration: ``"ucx"``, ``"tcp"``, ``"cma"`` or ``"auto"``.

Called once per engine worker process by the connector at start-up. ``auto`` takes UCX when ``ucxx`` imports
(shared memory on one host, RDMA with a system UCX) and the dependency-free TCP fallback otherwise; it never
picks ``cma`` (same-host only: whether P and D share a host is known to the operator, not to one endpoint at
start-up), which is the one to configure when both run on one machine. The choice and the reason are logged at
INFO so an operator can see which data plane a node runs.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Literal, get_args

from .base import Transport
from .cma import CmaConfig, CmaTransport
from .tcp import TcpConfig, TcpTransport
from .ucx import UcxConfig

log = logging.getLogger(__name__)

#: The transports a user can configure: the one list of their names.
TransportKind = Literal["ucx", "tcp", "cma", "auto"]
TRANSPORT_KINDS: tuple[TransportKind, ...] = get_args(TransportKind)
ConcreteKind = Literal["ucx", "tcp", "cma"]


@dataclass(frozen=True)
class TransportConfig:
    """Which transport to run and the settings of each (see docs/configuration.md ``## transport``)."""

    kind: TransportKind = "auto"
    tcp: TcpConfig = field(default_factory=TcpConfig)
    ucx: UcxConfig = field(default_factory=UcxConfig)
    cma: CmaConfig = field(default_factory=CmaConfig)


def ucx_available() -> bool:
    """True when the ``ucxx`` binding is installed (the ``ucx`` extra)."""
    return importlib.util.find_spec("ucxx") is not None


def choose_kind(kind: str) -> tuple[ConcreteKind, str]:
    """Resolve ``kind`` to a concrete transport and say why (``ValueError`` for an unknown kind)."""
    if kind == "tcp":
        return "tcp", "configured transport = tcp"
    if kind == "cma":
        return "cma", "configured transport = cma"
    if kind == "ucx":
        if not ucx_available():
            raise ValueError("transport = ucx but ucxx is not installed (pip install 'pd-disagg[ucx]')")
        return "ucx", "configured transport = ucx"
    if kind == "auto":
        if ucx_available():
            return "ucx", "transport = auto and ucxx is importable"
        return "tcp", "transport = auto and ucxx is not installed"
    *others, last = (repr(k) for k in TRANSPORT_KINDS)
    raise ValueError(f"unknown transport {kind!r}: expected {', '.join(others)} or {last}")


def create_transport(config: TransportConfig | None = None) -> Transport:
    """Build the configured transport; logs the choice and the reason."""
    config = config or TransportConfig()
    kind, why = choose_kind(config.kind)
    log.info("pd_connector data plane: %s (%s)", kind, why)
    if kind == "ucx":
        from .ucx import UcxTransport

        return UcxTransport(config.ucx)
    if kind == "cma":
        return CmaTransport(config.cma)
    return TcpTransport(config.tcp)
