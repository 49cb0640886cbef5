"""The Ray Serve application's arguments (the ``args:`` of examples/ray_serve.yaml), parsed and checked once.

``app.build_app`` parses them in ``serve run``'s process, before anything is deployed, so a typo or a missing
secret fails there with a message naming the key; the deployments receive the checked ``AppArgs`` back as plain
data (``to_builtins``) and decode it again in each replica. Unknown keys are refused, as in every other
configuration of this project. docs/configuration.md (``## Ray Serve``) documents each field.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

from pd_connector.settings import SettingError
from pd_connector.vllm.config import PDConnectorConfig
from pd_disagg.autoscale.settings import AutoscaleSettings, check

#: Connector keys each replica sets from where it runs (``engine_command.kv_transfer_config``): not the user's.
PER_REPLICA_KEYS = frozenset(
    {
        "side_channel_host",
        "side_channel_port",
        "side_channel_advertise_host",
        "data_host",
        "data_advertise_host",
    }
)


class AppConfigError(ValueError):
    """The application's arguments do not validate; the message names the key."""


class RoleArgs(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The engines of one role (prefill or decode); how many, and their CPUs, are Serve's deployment options."""

    #: Extra ``vllm serve`` flags (dtype, --max-model-len, --block-size, ...). Host, port, model and
    #: --kv-transfer-config are set by the replica.
    vllm_args: tuple[str, ...] = ()
    #: Environment of the engine process (e.g. VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE).
    env: dict[str, str] = {}
    #: Seconds a replica waits for its engine's /health before the replica fails (Serve then replaces it).
    start_timeout_s: float = 300.0


class AppArgs(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Everything the application needs besides Serve's own deployment options."""

    #: The model directory; a relative path is resolved against ``serve run``'s working directory.
    model: str
    #: The name clients send as ``model`` (and vLLM's --served-model-name). Default: ``model`` as written.
    served_model_name: str = ""
    #: PDConnector's ``kv_connector_extra_config`` shared by P and D, without the per-replica addresses.
    connector: dict[str, Any] = {}
    #: P replica of rank r listens for D on this port + r (one port per P replica and node); 0: a free port
    #: picked at start.
    side_channel_port_base: int = 0
    #: What a decode replica does when a load fails (vLLM's ``kv_load_failure_policy``): "recompute" prefills
    #: the prompt locally and answers (vLLM's own default, "fail", ends the request with an error).
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    prefill: RoleArgs = RoleArgs()
    decode: RoleArgs = RoleArgs()
    #: pd-router's TOML tables (``server``, ``policy``, ``kv_routing``, ...; docs/configuration.md ## router)
    #: as a mapping, without ``[[prefill]]``/``[[decode]]`` (the replicas register) and ``model.path``.
    router: dict[str, Any] = {}
    #: Directory of the engines' and the router's logs on each node ("" = ``$TMPDIR/pd-ray``).
    log_dir: str = ""
    #: The planner-driven autoscaler's settings (``pd_disagg.autoscale.settings``); None: fixed replica counts.
    #: Its ``profile`` path is resolved like ``model``.
    autoscale: AutoscaleSettings | None = None
    #: The Ray dashboard the autoscaler scales through ("" = the head's address, port 8265).
    dashboard_url: str = ""

    def served_name(self) -> str:
        return self.served_model_name or self.model


def parse_args(raw: dict[str, Any], cwd: str | None = None) -> AppArgs:
    """Validate the application's ``args`` and resolve ``model`` against ``cwd`` (default: this process's)."""
    try:
        args = msgspec.convert(raw, AppArgs)
    except msgspec.ValidationError as e:
        raise AppConfigError(f"invalid pd-disagg Ray Serve args: {e}") from None
    errors = []
    owned = sorted(PER_REPLICA_KEYS & set(args.connector))
    if owned:
        errors.append(f"connector: {owned} are set per replica from its node address; remove them")
    connector = dict(args.connector)
    # The engines' variable, read where each engine runs (``PDConnectorConfig``), not in this process.
    secret_env = connector.pop("secret_env", "")
    try:
        settings = PDConnectorConfig.from_extra_config(connector)
    except SettingError as e:
        errors.append(f"connector: {e}")
    else:
        if not isinstance(secret_env, str):
            errors.append("connector.secret_env: must be the name of an environment variable")
        elif secret_env and settings.secret:
            errors.append("connector.secret_env: set together with secret: set one of them")
        elif not settings.secret and not secret_env and not settings.allow_insecure:
            errors.append(
                "connector.secret: required, or secret_env (P's side channel listens on the node's address)"
            )
    if not 0 <= args.side_channel_port_base <= 65535:
        errors.append(f"side_channel_port_base: out of range: {args.side_channel_port_base}")
    for role in ("prefill", "decode"):
        if getattr(args, role).start_timeout_s <= 0:
            errors.append(f"{role}.start_timeout_s: must be > 0")
    for key in ("prefill", "decode"):
        if key in args.router:
            errors.append(f"router.{key}: workers are not configured here; replicas register themselves")
    if "path" in args.router.get("model", {}):
        errors.append("router.model.path: set from served_model_name")
    autoscale = args.autoscale
    if autoscale is not None:
        autoscale = msgspec.structs.replace(autoscale, profile=_absolute(autoscale.profile, cwd))
        try:
            check(autoscale)
        except ValueError as e:
            errors.append(f"autoscale: {e}")
    if errors:
        raise AppConfigError("invalid pd-disagg Ray Serve args:\n  " + "\n  ".join(errors))
    return msgspec.structs.replace(
        args, model=_absolute(args.model, cwd), served_model_name=args.served_name(), autoscale=autoscale
    )


def _absolute(path: str, cwd: str | None) -> str:
    return os.path.abspath(os.path.join(cwd or os.getcwd(), path))
