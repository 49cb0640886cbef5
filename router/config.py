"""The router's TOML configuration, decoded and validated into typed msgspec Structs.

Read once by ``pd-router`` (``cli.py``) at start-up; every other module receives the typed ``RouterConfig``.
Unknown keys, wrong types and impossible values are refused with a message naming the offending key, so a
typo never silently falls back to a default. API keys are ``Secret`` strings whose ``repr`` is ``***``:
printing or logging a config never shows them.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

Engine = Literal["vllm", "sglang"]
Flow = Literal["pd-push", "vllm-standard", "sglang-bootstrap"]
Role = Literal["prefill", "decode"]


class ConfigError(ValueError):
    """The configuration file is missing, not TOML, or does not validate; the message says where."""


class Secret(str):
    """A string that never shows itself in ``repr`` (logs, tracebacks, config dumps)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'***'"


def _keys(listed: tuple[Secret, ...], env: str) -> frozenset[str]:
    """``listed`` plus the comma-separated keys in environment variable ``env`` (if named)."""
    keys: set[str] = set(listed)
    if env:
        keys.update(k.strip() for k in os.environ.get(env, "").split(",") if k.strip())
    return frozenset(keys)


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where the router listens and what it accepts from clients."""

    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 4 * 1024 * 1024
    # Clients must send ``Authorization: Bearer <key>`` with one of these; empty means no authentication.
    api_keys: tuple[Secret, ...] = ()
    # Name of an environment variable holding more client keys, comma-separated (keeps keys out of files).
    api_keys_env: str = ""
    # Keys for the admin API (``/admin/*``: adding a worker chooses where requests and KV go), which client
    # keys never open. Empty: the admin API is open only when no client key is set either (no authentication
    # at all), and refused (403) otherwise.
    admin_keys: tuple[Secret, ...] = ()
    # Name of an environment variable holding more admin keys, comma-separated.
    admin_keys_env: str = ""
    # Requests admitted at once (in flight + waiting for a decode slot); beyond it: 429.
    max_pending: int = 4096
    retry_after_s: int = 1
    # Seconds an idle client connection stays open.
    keepalive_s: float = 75.0
    # Seconds requests in flight get to finish after SIGINT/SIGTERM before they are cancelled.
    shutdown_timeout_s: float = 60.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Append one JSON line per P->D request (transfer id, when each stage happened in the router) to this
    # file; "" = off. The engines' ``trace_path`` records join it on the transfer id.
    trace_path: str = ""


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The model served by every worker, and where its tokenizer lives."""

    path: str
    # Names clients may use in ``model``; the first is what ``/v1/models`` lists. Default: ``path``.
    served_names: tuple[str, ...] = ()
    # Directory with tokenizer.json (+ tokenizer_config.json / chat_template.jinja). Default: ``path``.
    tokenizer: str = ""
    # The workers' --max-model-len: prompt + max_tokens must fit.
    max_model_len: int = 2048


class PolicyConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Conditional disaggregation: which prompts go P->D and which straight to D."""

    name: Literal["threshold"] = "threshold"
    # Prompts with fewer tokens than this go straight to a decode worker (it prefills locally).
    threshold_tokens: int = 256
    # A prefill worker is saturated when its outstanding prefill tokens reach this.
    prefill_saturated_tokens: int = 16384
    # A decode worker is saturated at this many active requests; new requests then wait for a slot.
    decode_max_active: int = 256
    # Prefill on D instead of P when every P is saturated and the least loaded D is below this fraction.
    decode_headroom_fraction: float = 0.5
    # How long a request may wait for a decode slot before it is refused with 429.
    queue_timeout_s: float = 30.0
    # How long a request may wait for a worker of a pool it needs to come back when none is usable (all
    # unhealthy, their circuits open, draining, or failed by this request) before it is refused with 503;
    # 0 refuses at once.
    unavailable_wait_s: float = 10.0
    # A short request (LOCAL, reason short) may run alone on a prefill worker that has no prefill leg in
    # flight and fewer than this many requests, when that is fewer than the least loaded decode worker has:
    # P's idle capacity serves short requests instead of idling (``ThresholdPolicy``). 0: P only prefills.
    lend_max_active: int = 0


class KvRoutingConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """KV-aware routing: send a prompt where its prefix is cached, disaggregate on its uncached tokens."""

    # Off: D by power of two choices, P by least outstanding tokens, the policy on whole prompts.
    enabled: bool = True
    # The router's block, in tokens: vLLM's --block-size (16 on GPU, 128 by default on CPU); any for SGLang,
    # which caches whole pages (1 token by default).
    block_size: int = 16
    # Blocks remembered per worker, least recently routed dropped first (~130 bytes each).
    max_blocks_per_worker: int = 65536
    # Prompt tokens one active request on a decode worker weighs as, in the decode worker's cost.
    load_tokens: int = 256


class TimeoutConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    connect_s: float = 5.0
    # Until the first byte (headers + first chunk) from an upstream leg.
    first_byte_s: float = 120.0
    # Longest silence between two streamed chunks before the leg counts as failed.
    idle_s: float = 60.0
    # Whole request, from arrival to the last byte sent.
    request_s: float = 600.0
    # How long a role switch (admin API) waits for the worker's legs of its old role to finish; then the
    # switch is refused and the worker keeps its old role.
    role_drain_s: float = 60.0


class RetryConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Retries happen only before the first byte reached the client; mid-stream D failures are resumed."""

    max_attempts: int = 3
    backoff_base_s: float = 0.05
    backoff_max_s: float = 1.0
    # Each backoff is multiplied by a random factor in [1 - jitter, 1 + jitter].
    jitter: float = 0.5
    # Mid-stream decode failures resumed on another decode worker, per request.
    max_resumes: int = 2


class HealthConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    interval_s: float = 2.0
    timeout_s: float = 1.0
    # Consecutive failed checks before a worker is taken out, and successful ones to bring it back.
    unhealthy_after: int = 2
    healthy_after: int = 1


class CircuitConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Consecutive request failures that open a worker's circuit.
    failure_threshold: int = 3
    # How long an open circuit refuses requests before one trial request is let through.
    open_s: float = 10.0


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One engine server: ``url`` is its OpenAI HTTP base (``http://host:port``)."""

    url: str
    engine: Engine = "vllm"
    # Prefill only: the connector's side channel ``host:port`` (pd-push) or SGLang's bootstrap port.
    bootstrap: str = ""
    bootstrap_port: int = 0
    # Sent upstream as ``Authorization: Bearer``; never logged.
    api_key: Secret = Secret("")
    # ZMQ endpoint of the engine's KV event publisher (``--kv-events-config`` of vLLM or SGLang: ``engine``
    # picks the format), "" = none (KV-aware routing then knows this worker's cache from the routing history
    # alone).
    kv_events: str = ""
    # The roles the engine can serve; empty: only the pool it is listed in. Both (``["prefill", "decode"]``,
    # a vLLM engine started with ``kv_role`` ``kv_both``) lets the admin API switch it at run time: the router
    # cannot ask an engine which roles it serves, so the operator says so here.
    roles: tuple[Role, ...] = ()


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model: ModelConfig
    decode: tuple[WorkerConfig, ...]
    prefill: tuple[WorkerConfig, ...] = ()
    flow: Flow = "pd-push"
    server: ServerConfig = ServerConfig()
    policy: PolicyConfig = PolicyConfig()
    kv_routing: KvRoutingConfig = KvRoutingConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    retry: RetryConfig = RetryConfig()
    health: HealthConfig = HealthConfig()
    circuit: CircuitConfig = CircuitConfig()

    def client_keys(self) -> frozenset[str]:
        """Accepted client API keys: the file's ``api_keys`` plus those in ``api_keys_env``."""
        return _keys(self.server.api_keys, self.server.api_keys_env)

    def admin_keys(self) -> frozenset[str]:
        """Accepted admin API keys: the file's ``admin_keys`` plus those in ``admin_keys_env``."""
        return _keys(self.server.admin_keys, self.server.admin_keys_env)

    def served_names(self) -> tuple[str, ...]:
        return self.model.served_names or (self.model.path,)

    def tokenizer_dir(self) -> str:
        return self.model.tokenizer or self.model.path

    def decode_prefills(self) -> bool:
        """Whether a decode worker can serve a request alone, prefilling it itself.

        vLLM decode workers can (the local path, and the fallback when P fails). SGLang's decode-mode servers
        cannot: they only decode what a prefill server sends them, so in ``sglang-bootstrap`` every request
        goes P->D (``_check`` refuses a configuration that would route any elsewhere).
        """
        return self.flow != "sglang-bootstrap"


def secret_hook(typ: type, obj: Any) -> Any:
    """msgspec ``dec_hook`` that builds ``Secret`` values (config file and admin API)."""
    if typ is Secret and isinstance(obj, str):
        return Secret(obj)
    raise NotImplementedError(f"cannot decode {typ}")


def _check(cfg: RouterConfig) -> None:
    """Cross-field checks msgspec's types cannot express."""
    errors: list[str] = []
    if not cfg.decode:
        errors.append("decode: at least one decode worker is required")
    positive = {
        "server.port": cfg.server.port,
        "server.max_body_bytes": cfg.server.max_body_bytes,
        "server.max_pending": cfg.server.max_pending,
        "server.keepalive_s": cfg.server.keepalive_s,
        "model.max_model_len": cfg.model.max_model_len,
        "policy.decode_max_active": cfg.policy.decode_max_active,
        "policy.prefill_saturated_tokens": cfg.policy.prefill_saturated_tokens,
        "policy.queue_timeout_s": cfg.policy.queue_timeout_s,
        "kv_routing.block_size": cfg.kv_routing.block_size,
        "kv_routing.max_blocks_per_worker": cfg.kv_routing.max_blocks_per_worker,
        "timeouts.connect_s": cfg.timeouts.connect_s,
        "timeouts.first_byte_s": cfg.timeouts.first_byte_s,
        "timeouts.idle_s": cfg.timeouts.idle_s,
        "timeouts.request_s": cfg.timeouts.request_s,
        "timeouts.role_drain_s": cfg.timeouts.role_drain_s,
        "retry.max_attempts": cfg.retry.max_attempts,
        "health.interval_s": cfg.health.interval_s,
        "health.timeout_s": cfg.health.timeout_s,
        "health.unhealthy_after": cfg.health.unhealthy_after,
        "health.healthy_after": cfg.health.healthy_after,
        "circuit.failure_threshold": cfg.circuit.failure_threshold,
        "circuit.open_s": cfg.circuit.open_s,
    }
    errors += [f"{name}: must be > 0, got {value}" for name, value in positive.items() if value <= 0]
    if cfg.server.shutdown_timeout_s < 0:
        errors.append("server.shutdown_timeout_s: must be >= 0")
    if cfg.policy.threshold_tokens < 0:
        errors.append("policy.threshold_tokens: must be >= 0")
    if cfg.policy.unavailable_wait_s < 0:
        errors.append("policy.unavailable_wait_s: must be >= 0")
    if cfg.policy.lend_max_active < 0:
        errors.append("policy.lend_max_active: must be >= 0")
    if cfg.kv_routing.load_tokens < 0:
        errors.append("kv_routing.load_tokens: must be >= 0")
    if not 0.0 <= cfg.policy.decode_headroom_fraction <= 1.0:
        errors.append("policy.decode_headroom_fraction: must be within [0, 1]")
    if not 0.0 <= cfg.retry.jitter <= 1.0:
        errors.append("retry.jitter: must be within [0, 1]")
    if cfg.retry.backoff_base_s < 0 or cfg.retry.backoff_max_s < cfg.retry.backoff_base_s:
        errors.append("retry: need 0 <= backoff_base_s <= backoff_max_s")
    if cfg.retry.max_resumes < 0:
        errors.append("retry.max_resumes: must be >= 0")
    if not cfg.decode_prefills():
        why = "SGLang's decode servers cannot prefill alone, so every request goes P->D"
        if cfg.policy.threshold_tokens != 0:
            errors.append(f'policy.threshold_tokens: must be 0 with flow = "sglang-bootstrap" ({why})')
        if not cfg.prefill:
            errors.append(f'prefill: flow = "sglang-bootstrap" needs at least one prefill worker ({why})')
    for role, workers in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        seen: set[str] = set()
        for i, w in enumerate(workers):
            errors += [f"{role}[{i}].{e}" for e in worker_errors(w, role, cfg.flow)]
            if w.url in seen:
                errors.append(f"{role}[{i}].url: duplicate {w.url}")
            seen.add(w.url)
    if errors:
        raise ConfigError("invalid router config:\n  " + "\n  ".join(errors))


def worker_errors(w: WorkerConfig, role: str, flow: Flow) -> list[str]:
    """What is wrong with one worker entry (also used by the admin API before adding a worker)."""
    errors = []
    if not (w.url.startswith("http://") or w.url.startswith("https://")):
        errors.append(f"url: must start with http:// or https://, got {w.url!r}")
    elif urlsplit(w.url).path not in ("", "/"):  # legs and health checks use the server's own paths
        errors.append(f"url: must be the server's base, scheme://host:port without a path, got {w.url!r}")
    if role == "prefill" and flow == "pd-push" and ":" not in w.bootstrap:
        errors.append("bootstrap: pd-push prefill workers need the connector side channel as 'host:port'")
    if w.kv_events and not w.kv_events.startswith(("tcp://", "ipc://")):
        errors.append(f"kv_events: must be a ZMQ endpoint tcp://host:port or ipc://path, got {w.kv_events!r}")
    if role == "prefill" and flow == "sglang-bootstrap" and w.bootstrap_port <= 0:
        errors.append("bootstrap_port: sglang-bootstrap prefill workers need their bootstrap port")
    if w.roles and role not in w.roles:
        errors.append(f"roles: lists {list(w.roles)}, not {role!r}, the role it is added as")
    if len(set(w.roles)) > 1 and w.engine != "vllm":
        errors.append("roles: only vLLM engines (kv_role kv_both) serve both roles")
    return errors


def parse_config(data: dict[str, Any]) -> RouterConfig:
    """Validate an already-parsed TOML table into a ``RouterConfig`` (raises ``ConfigError``)."""
    try:
        cfg = msgspec.convert(data, RouterConfig, dec_hook=secret_hook)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid router config: {e}") from None
    _check(cfg)
    return cfg


def load_config(path: str | Path) -> RouterConfig:
    """Read and validate a TOML file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None
    return parse_config(data)
