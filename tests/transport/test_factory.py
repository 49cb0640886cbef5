"""Transport choice from configuration."""

from __future__ import annotations

import logging

import pytest

from pd_connector.transport import factory
from pd_connector.transport.cma import CmaConfig, CmaTransport
from pd_connector.transport.factory import TransportConfig, choose_kind, create_transport
from pd_connector.transport.tcp import TcpTransport


def test_explicit_and_auto_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_kind("tcp")[0] == "tcp"
    assert choose_kind("cma") == ("cma", "configured transport = cma")
    monkeypatch.setattr(factory, "ucx_available", lambda: False)
    assert choose_kind("auto") == ("tcp", "transport = auto and ucxx is not installed")
    with pytest.raises(ValueError, match="ucxx is not installed"):
        choose_kind("ucx")
    monkeypatch.setattr(factory, "ucx_available", lambda: True)
    assert choose_kind("auto")[0] == "ucx"  # auto never picks cma: same host is the operator's knowledge
    with pytest.raises(ValueError, match="unknown transport 'rdma'"):
        choose_kind("rdma")


def test_choice_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pd_connector.transport.factory")
    transport = create_transport(TransportConfig(kind="tcp"))
    try:
        assert isinstance(transport, TcpTransport)
        assert "data plane: tcp (configured transport = tcp)" in caplog.text
    finally:
        transport.close()


def test_cma_is_built_with_its_settings() -> None:
    transport = create_transport(TransportConfig(kind="cma", cma=CmaConfig(segment_bytes=1 << 20)))
    try:
        assert isinstance(transport, CmaTransport) and transport.config.segment_bytes == 1 << 20
    finally:
        transport.close()
