"""The peer policy: which prefill addresses a decode side dials, and protected mode for listeners."""

from __future__ import annotations

import pytest

from pd_connector.trust import InsecureConfig, PeerPolicy, is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.1", True), ("localhost", True), ("::1", True), ("[::1]", True)],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "my-host", "localhost.evil.com", ""])
def test_other_hosts_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


def test_without_secret_or_list_only_loopback_is_dialled() -> None:
    policy = PeerPolicy(authenticated=False)
    assert policy.refusal("127.0.0.1:7600") is None
    assert policy.refusal("[::1]:7600") is None
    assert "dials loopback only" in (policy.refusal("10.0.0.1:7600") or "")
    assert PeerPolicy(authenticated=False, allow_insecure=True).refusal("10.0.0.1:7600") is None
    assert PeerPolicy(authenticated=True).refusal("10.0.0.1:7600") is None


@pytest.mark.parametrize(
    ("entry", "allowed", "refused"),
    [
        ("10.0.0.5", ["10.0.0.5:1", "10.0.0.5:7600"], ["10.0.0.6:7600", "127.0.0.1:7600"]),
        ("10.0.0.5:7600", ["10.0.0.5:7600"], ["10.0.0.5:7601"]),
        ("10.0.0.0/24", ["10.0.0.1:7600", "10.0.0.255:2"], ["10.0.1.1:7600", "p0:7600"]),
        ("10.0.0.0/24:7600", ["10.0.0.9:7600"], ["10.0.0.9:7601"]),
        ("P0.cluster", ["p0.cluster:7600", "P0.CLUSTER:1"], ["p1.cluster:7600", "10.0.0.5:7600"]),
        ("[fd00::/8]:7600", ["[fd00::1]:7600"], ["[fd00::1]:7601", "[fe80::1]:7600"]),
        ("fd00::1", ["[fd00::1]:7600"], ["[fd00::2]:7600"]),
    ],
)
def test_allow_list_entries(entry: str, allowed: list[str], refused: list[str]) -> None:
    """An allow-list applies with or without a secret; names are compared as written, never resolved."""
    for authenticated in (False, True):
        policy = PeerPolicy(authenticated, (entry,))
        for addr in allowed:
            assert policy.refusal(addr) is None, (entry, addr)
        for addr in refused:
            assert "not in allowed_prefill_addrs" in (policy.refusal(addr) or ""), (entry, addr)


@pytest.mark.parametrize("entry", ["", "host:port", "10.0.0.1:99999", "[::1", "[::1]7600", "a:"])
def test_bad_allow_list_entries_fail_at_start(entry: str) -> None:
    with pytest.raises(ValueError, match="allowed_prefill_addrs entry"):
        PeerPolicy(True, (entry,))


def test_protected_mode() -> None:
    """A listener other hosts can reach needs a secret or the explicit opt-in."""
    PeerPolicy(False).check_listener("side channel", "127.0.0.1")
    PeerPolicy(True).check_listener("side channel", "0.0.0.0")
    PeerPolicy(False, allow_insecure=True).check_listener("side channel", "0.0.0.0")
    for host in ("0.0.0.0", "10.0.0.1", "::"):
        with pytest.raises(InsecureConfig, match="allow_insecure"):
            PeerPolicy(False).check_listener("side channel", host)


def test_a_bad_address_is_an_error_not_a_pass() -> None:
    with pytest.raises(ValueError, match="host:port"):
        PeerPolicy(True).refusal("no-port")
