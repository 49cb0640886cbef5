"""Which peers a transfer engine deals with: the allow-list of prefill addresses and protected mode.

Why: a decode side (D) dials the prefill address a request names and, after the handshake, hands that peer
the descriptor that lets it write into D's KV cache; a prefill side (P) pushes a prompt's KV to whoever asks
with its transfer id. Request bodies are untrusted (docs/architecture.md ``## Trust model``), so neither may
follow them blindly. The rules, checked by ``TransferEngine`` (engine-agnostic: the vLLM and SGLang
adapters get the same ones):

- D dials a prefill address only if it matches ``allowed_prefill_addrs`` when that list is set; with no
  list, any address when a shared secret is set (the handshake then proves P knows it before D reveals its
  memory), and only loopback addresses without a secret unless ``allow_insecure``.
- Protected mode (as Redis has it): a side channel bound to an address other hosts can reach, with no
  shared secret, is refused at start unless the operator sets ``allow_insecure``.

Names in the allow-list are compared as written, never resolved (a client must not win by DNS).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from pd_connector.control import split_addr

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class InsecureConfig(ValueError):
    """A listener reachable from other hosts with no shared secret, and no explicit opt-in."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IPs (127.0.0.0/8, ::1); names other than localhost are not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class _Rule:
    """One allow-list entry: a host name, an IP or a CIDR network, with or without a port."""

    name: str | None
    network: IPNetwork | None
    port: int | None

    @classmethod
    def parse(cls, entry: str) -> _Rule:
        text = entry.strip()
        port: int | None = None
        if text.startswith("["):  # [v6] or [v6]:port or [v6/len]:port
            host, bracket, rest = text[1:].partition("]")
            if not bracket:
                raise ValueError(f"allowed_prefill_addrs entry {entry!r}: no closing bracket")
            if rest:
                if not rest.startswith(":") or not rest[1:].isdigit():
                    raise ValueError(f"allowed_prefill_addrs entry {entry!r}: expected [IPv6]:PORT")
                port = int(rest[1:])
        elif text.count(":") == 1:
            host, _, port_text = text.partition(":")
            if not port_text.isdigit():
                raise ValueError(f"allowed_prefill_addrs entry {entry!r}: port must be a number")
            port = int(port_text)
        else:
            host = text
        if not host:
            raise ValueError(f"allowed_prefill_addrs entry {entry!r} names no host")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"allowed_prefill_addrs entry {entry!r}: port out of range")
        try:
            return cls(None, ipaddress.ip_network(host, strict=False), port)
        except ValueError:
            return cls(host.lower(), None, port)

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.name is not None:
            return host.lower() == self.name
        assert self.network is not None
        try:
            return ipaddress.ip_address(host) in self.network
        except ValueError:  # a name never matches a network: we do not resolve
            return False


@dataclass(frozen=True)
class PeerPolicy:
    """The rules above for one engine; built from its settings, so a bad entry fails at start."""

    authenticated: bool
    allowed_prefill_addrs: tuple[str, ...] = ()
    allow_insecure: bool = False
    _rules: tuple[_Rule, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rules", tuple(_Rule.parse(e) for e in self.allowed_prefill_addrs))

    def check_listener(self, what: str, host: str) -> None:
        """Raise ``InsecureConfig`` when ``host`` is reachable from other hosts with nothing protecting it."""
        if self.authenticated or self.allow_insecure or is_loopback(host):
            return
        raise InsecureConfig(
            f"{what} binds {host!r}, which other hosts can reach, but no shared secret is set: set the same "
            "`secret` on prefill and decode nodes (or, on a network you trust completely, allow_insecure = true)"
        )

    def refusal(self, prefill_addr: str) -> str | None:
        """Why D must not dial ``prefill_addr``, or None when it may (``ValueError`` if it is no address)."""
        host, port = split_addr(prefill_addr)
        if self._rules:
            if any(rule.matches(host, port) for rule in self._rules):
                return None
            return f"prefill address {prefill_addr} is not in allowed_prefill_addrs"
        if self.authenticated or self.allow_insecure or is_loopback(host):
            return None
        return (
            f"prefill address {prefill_addr} is not loopback, and with no shared secret and no "
            "allowed_prefill_addrs this decode node dials loopback only"
        )
