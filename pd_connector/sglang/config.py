"""Settings of the SGLang ``pd`` backend, read from the environment of the SGLang server process.

SGLang has no per-backend configuration object, so the backend reads ``PD_SGLANG_*`` variables (documented in
docs/configuration.md ``## SGLang backend``) once per scheduler process when its KV manager starts. SGLang's
own timeouts (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, ``..._WAITING_TIMEOUT``) keep their meaning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: The environment variable of each setting: the one spelling ``from_env`` reads and docs/configuration.md
#: (``## SGLang backend``) documents, which tests/test_docs.py checks.
ENV = {
    "transport": "PD_SGLANG_TRANSPORT",
    "lease_s": "PD_SGLANG_LEASE_S",
    "connect_timeout_s": "PD_SGLANG_CONNECT_TIMEOUT_S",
    "abort_grace_s": "PD_SGLANG_ABORT_GRACE_S",
    "heartbeat_interval_s": "PD_SGLANG_HEARTBEAT_INTERVAL_S",
    "heartbeat_timeout_s": "PD_SGLANG_HEARTBEAT_TIMEOUT_S",
    "secret": "PD_SGLANG_SECRET",
    "allowed_prefill_addrs": "PD_SGLANG_ALLOWED_PREFILL_ADDRS",
    "allow_insecure": "PD_SGLANG_ALLOW_INSECURE",
    "wrong_kv_rooms": "PD_SGLANG_FAULT_WRONG_KV_ROOMS",
}
#: The settings that are positive numbers of seconds.
NUMBERS = ("lease_s", "connect_timeout_s", "abort_grace_s", "heartbeat_interval_s", "heartbeat_timeout_s")


@dataclass(frozen=True)
class SGLangBackendConfig:
    """``transport``: ``tcp`` (default), ``ucx``, ``cma`` (P and D on one host) or ``auto``. ``lease_s``: how long P keeps a request's
    pages for a decode side that has not asked for them, or that stopped acknowledging. Heartbeats on the
    control connection detect a dead peer within ``heartbeat_timeout_s``. ``secret``: shared HMAC key for the
    control plane (unset: no authentication; then the side channel must be on loopback unless
    ``allow_insecure``). ``allowed_prefill_addrs``/``allow_insecure``: D's peer policy (``pd_connector.trust``).
    ``connect_timeout_s``: D's connect + handshake with P.
    ``wrong_kv_rooms``: fault injection for tests (negative control): for these bootstrap rooms P sends its
    first page's KV into every page D asked for (a complete transfer of the wrong bytes: a transfer with holes
    fails instead), so D decodes from KV that is not its prompt's. Empty in real use."""

    transport: str = "tcp"
    lease_s: float = 60.0
    connect_timeout_s: float = 5.0
    abort_grace_s: float = 5.0
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    secret: bytes | None = None
    allowed_prefill_addrs: tuple[str, ...] = ()
    allow_insecure: bool = False
    wrong_kv_rooms: frozenset[int] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SGLangBackendConfig:
        """Read ``PD_SGLANG_*`` (``ENV`` names each setting's variable); a malformed value raises ``ValueError``
        naming the variable."""
        env = os.environ if env is None else env
        defaults = cls()

        def raw(setting: str) -> str:
            return env.get(ENV[setting], "")

        def number(setting: str) -> float:
            text = raw(setting)
            if not text:
                return float(getattr(defaults, setting))
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{ENV[setting]}={text!r} is not a number") from None
            if value <= 0:
                raise ValueError(f"{ENV[setting]}={text!r} must be positive")
            return value

        transport = raw("transport") or defaults.transport
        if transport not in ("tcp", "ucx", "cma", "auto"):
            raise ValueError(f"{ENV['transport']}={transport!r}: expected tcp, ucx, cma or auto")
        insecure = env.get(ENV["allow_insecure"], "0")
        if insecure not in ("0", "1"):
            raise ValueError(f"{ENV['allow_insecure']}={insecure!r}: expected 0 or 1")
        wrong = raw("wrong_kv_rooms")
        try:
            wrong_kv_rooms = frozenset(int(r) for r in wrong.split(",") if r.strip())
        except ValueError:
            raise ValueError(
                f"{ENV['wrong_kv_rooms']}={wrong!r} is not a comma-separated list of rooms"
            ) from None
        return cls(
            transport=transport,
            secret=raw("secret").encode() or None,
            allowed_prefill_addrs=tuple(
                a.strip() for a in raw("allowed_prefill_addrs").split(",") if a.strip()
            ),
            allow_insecure=insecure == "1",
            wrong_kv_rooms=wrong_kv_rooms,
            **{setting: number(setting) for setting in NUMBERS},
        )
