"""Everything the SGLang transfer backend ``pd`` reads or changes inside SGLang, in one place.

Proven on sglang 0.5.23 (``PROVEN_ON``). SGLang has no transfer-backend registry and no public base for
backends, so the backend extends the CLI choices, adds a member to the ``TransferBackend`` enum (through the
enum's private maps), hooks ``get_kv_class`` (enum map ``KVClassType`` -> classes), subclasses the ``Common*``
classes of ``sglang.srt.disaggregation.common.conn`` (overriding and calling private methods), reads private
fields of the manager, and writes raw rows of SGLang's ``MetadataBuffers``. None of that is promised to stay,
so what the backend needs is checked by name, not only by version: ``SYMBOLS`` (every internal it touches),
``PARAMETERS`` (the parameters of what it overrides or calls by keyword), ``MANAGER_FIELDS`` and the metadata
rows (``require_metadata_rows``). A release of the supported line (``SUPPORTED_LINE``, from ``PROVEN_ON``
on) that has them all is registered (with a warning when it is not the proven one); one that lacks any is
refused at start with a message naming each missing piece.

Who calls what:
- ``plugin.register`` (the ``sglang.srt.plugins`` entry point, in SGLang's launcher, scheduler and
  detokenizer processes): ``startup_problem`` (version gate, then ``SYMBOLS`` and ``PARAMETERS``; on a
  problem it logs the message and registers nothing) and ``unproven_warning``, then ``add_backend_choice``,
  ``add_transfer_backend`` and ``hook_get_kv_class``; its hook calls ``kv_class_map``.
- ``conn.py`` (the backend's classes, imported through SGLang only): subclasses ``CommonKVManager``,
  ``CommonKVSender``, ``CommonKVReceiver``, ``CommonKVBootstrapServer`` and uses ``KVArgs``, ``KVPoll``,
  ``KVTransferDestination``, ``DisaggregationMode``, ``ServerArgs``, all imported from here;
  ``PdKVManager`` calls ``require_manager`` and ``require_metadata_rows`` after ``CommonKVManager.__init__``,
  and ``rank_kv_heads``, ``waiting_timeout_s``, ``metrics_enabled``, ``metric_labels``, ``read_first_token``,
  ``write_first_token``.
- ``layerwise.py`` (P's layer-wise push), through ``compat.forward`` (what it reads of a forward pass, re-exported
  here): ``plugin.register`` calls ``hook_layerwise`` (AROUND
  ``Scheduler.run_batch``, AFTER ``MHATokenToKVPool.set_kv_buffer``); the hooks call ``prefill_kv_manager``
  and ``written_layer``; ``PdKVManager.plan_forward`` calls ``layerwise_problem``, ``page_size`` and
  ``forward_requests``.

Importing this module imports no SGLang (so ``register`` can report what is missing instead of failing on an
import): the SGLang classes above resolve on first use (module ``__getattr__``).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from pd_connector.engine_symbols import has_path, missing

# The layer-wise push's hooks and reads, re-exported: callers use them as ``compat.NAME`` like the rest.
from pd_connector.sglang.compat.forward import RUN_BATCH as RUN_BATCH
from pd_connector.sglang.compat.forward import SET_KV_BUFFER as SET_KV_BUFFER
from pd_connector.sglang.compat.forward import ForwardRequest as ForwardRequest
from pd_connector.sglang.compat.forward import forward_requests as forward_requests
from pd_connector.sglang.compat.forward import hook_layerwise as hook_layerwise
from pd_connector.sglang.compat.forward import layerwise_problem as layerwise_problem
from pd_connector.sglang.compat.forward import page_size as page_size
from pd_connector.sglang.compat.forward import prefill_kv_manager as prefill_kv_manager
from pd_connector.sglang.compat.forward import written_layer as written_layer

if TYPE_CHECKING:
    from sglang.srt.disaggregation.base.conn import KVArgs as KVArgs
    from sglang.srt.disaggregation.base.conn import KVPoll as KVPoll
    from sglang.srt.disaggregation.base.conn import KVTransferDestination as KVTransferDestination
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer as CommonKVBootstrapServer
    from sglang.srt.disaggregation.common.conn import CommonKVManager as CommonKVManager
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver as CommonKVReceiver
    from sglang.srt.disaggregation.common.conn import CommonKVSender as CommonKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode as DisaggregationMode
    from sglang.srt.server_args import ServerArgs as ServerArgs

#: The release the integration tests run; the backend is registered on releases of its line from this one on.
PROVEN_ON = "0.5.23"
SUPPORTED_LINE = "0.5"
BACKEND_NAME = "pd"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"

_BASE = "sglang.srt.disaggregation.base.conn"
_COMMON = "sglang.srt.disaggregation.common.conn"
_UTILS = "sglang.srt.disaggregation.utils"

#: SGLang classes ``conn.py`` imports from here, and the module each comes from.
CLASSES = {
    "KVArgs": _BASE,
    "KVPoll": _BASE,
    "KVTransferDestination": _BASE,
    "CommonKVBootstrapServer": _COMMON,
    "CommonKVManager": _COMMON,
    "CommonKVReceiver": _COMMON,
    "CommonKVSender": _COMMON,
    "DisaggregationMode": _UTILS,
    "ServerArgs": "sglang.srt.server_args",
}

#: Every SGLang symbol the backend uses (``module:attribute.path``), checked by ``register`` before it
#: registers anything. Instance fields the ``Common*`` constructors set: ``MANAGER_FIELDS``.
SYMBOLS = (
    *(f"{module}:{name}" for name, module in CLASSES.items()),
    # registration: CLI choices, the enum looked up by value, the class lookup and its hook
    "sglang.srt.arg_groups.choices:DISAGG_TRANSFER_BACKEND_CHOICES",
    "sglang.srt.arg_groups.choices:add_disagg_transfer_backend_choices",
    f"{_UTILS}:TransferBackend",
    # extend_enum writes a member into the enum's private maps
    *(f"{_UTILS}:TransferBackend.{m}" for m in ("_value2member_map_", "_member_map_", "_member_names_")),
    f"{_UTILS}:get_kv_class",
    *(f"{_UTILS}:KVClassType.{m}" for m in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")),
    "sglang.srt.plugins.hook_registry:HookRegistry.register",
    "sglang.srt.plugins.hook_registry:HookType.AROUND",
    "sglang.srt.plugins.hook_registry:HookType.AFTER",
    # the layer-wise push: its two hook targets and the page lookup forward_requests does
    "sglang.srt.managers.scheduler:Scheduler.run_batch",
    "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool.set_kv_buffer",
    "sglang.srt.mem_cache.common:kv_to_page_indices",
    # the Common* methods conn.py overrides or calls
    *(
        f"{_COMMON}:CommonKVManager.{m}"
        for m in (
            "register_to_bootstrap",
            "update_status",
            "record_failure",
            "is_abort_release_safe",
            "_start_heartbeat_checker_thread",
            "_handle_node_failure",
            "supports_deferred_decode_kv_release",
        )
    ),
    *(f"{_COMMON}:CommonKVSender.{m}" for m in ("poll", "abort", "clear")),
    *(
        f"{_COMMON}:CommonKVReceiver.{m}"
        for m in ("send_metadata", "_register_kv_args", "_send_abort_notification")
    ),
    *(
        f"{_BASE}:KVPoll.{m}"
        for m in ("Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed")
    ),
    f"{_BASE}:KVTransferDestination.DEVICE",
    f"{_UTILS}:DisaggregationMode.PREFILL",
    f"{_UTILS}:DisaggregationMode.DECODE",
    # the metadata rows read_first_token / write_first_token address (see there)
    f"{_UTILS}:MetadataBuffers.get_buf_infos",
    "sglang.srt.environ:envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
    "sglang.srt.configs.model_config:ModelConfig.from_server_args",
    "sglang.srt.configs.model_config:ModelConfig.get_num_kv_heads",
    # what metrics_enabled / metric_labels read
    *(
        f"sglang.srt.server_args:ServerArgs.{f}"
        for f in ("enable_metrics", "served_model_name", "model_path")
    ),
)
#: Parameters of SGLang callables the backend overrides (SGLang calls ours with them) or calls by keyword; a
#: release that renamed or dropped one is refused (``startup_problem`` names ``symbol(parameter)``).
PARAMETERS: dict[str, tuple[str, ...]] = {
    f"{_COMMON}:CommonKVManager.__init__": ("args", "disaggregation_mode", "server_args", "is_mla_backend"),
    f"{_COMMON}:CommonKVSender.__init__": (
        "mgr",
        "bootstrap_addr",
        "bootstrap_room",
        "req_has_disagg_prefill_dp_rank",
    ),
    f"{_COMMON}:CommonKVReceiver.send_metadata": (
        "kv_indices",
        "aux_index",
        "state_indices",
        "decode_prefix_len",
        "destination",
    ),
    f"{_COMMON}:CommonKVReceiver._send_abort_notification": ("force_arm",),
    f"{_COMMON}:CommonKVManager.is_abort_release_safe": ("bootstrap_room", "required_acks"),
    f"{_COMMON}:CommonKVManager._handle_node_failure": ("failed_bootstrap_addr",),
    f"{_UTILS}:get_kv_class": ("transfer_backend", "class_type"),
    "sglang.srt.managers.scheduler:Scheduler.run_batch": ("batch",),
    "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool.set_kv_buffer": (
        "layer",
        "loc_info",
        "cache_k",
        "cache_v",
        "k_scale",
        "v_scale",
        "layer_id_override",
    ),
}
#: Fields ``CommonKVManager.__init__`` sets that ``PdKVManager`` reads, on every server and on decode only.
MANAGER_FIELDS = ("kv_args", "disaggregation_mode", "local_ip", "request_status")
DECODE_MANAGER_FIELDS = ("addr_to_rooms_tracker", "waiting_timeout")


def __getattr__(name: str) -> Any:
    """The SGLang class ``name`` of ``CLASSES``, imported on first use."""
    module = CLASSES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


# ---- start-up checks ---------------------------------------------------------------------------------------


def sglang_version() -> str | None:
    """The installed SGLang's version, None when SGLang is not installed."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric components of ``version`` (``0.5.23.post1`` -> ``(0, 5, 23)``)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def unsupported_reason(version: str | None) -> str | None:
    """Why this SGLang cannot use the backend (not installed, or outside ``SUPPORTED_LINE`` from
    ``PROVEN_ON`` on), or None when its internals are worth checking."""
    if version is None:
        return "sglang is not installed"
    release = _release(version)
    if release[:2] != _release(SUPPORTED_LINE) or release < _release(PROVEN_ON):
        return (
            f"sglang {version} is not supported by pd_connector's transfer backend {BACKEND_NAME!r} "
            f"(supported: sglang {SUPPORTED_LINE}.x from {PROVEN_ON}, proven on {PROVEN_ON}); it hooks "
            "SGLang internals that change between releases, so it is not registered"
        )
    return None


def unproven_warning(version: str | None) -> str | None:
    """What to warn about a supported release that is not the proven one (None on ``PROVEN_ON``)."""
    if version is None or _release(version) == _release(PROVEN_ON):
        return None
    return (
        f"sglang {version} is not the release pd_connector's transfer backend {BACKEND_NAME!r} was proven on "
        f"({PROVEN_ON}); every SGLang internal it uses is present, so it is registered"
    )


def _missing_message(user: str, absent: list[str]) -> str:
    return (
        f"{user} needs SGLang internals that this SGLang ({sglang_version()}) lacks: {', '.join(absent)} "
        f"(proven on sglang {PROVEN_ON})"
    )


def missing_parameters(parameters: Mapping[str, tuple[str, ...]]) -> list[str]:
    """``symbol(parameter)`` for each parameter of ``parameters`` its callable lacks (the symbol itself
    missing is ``missing``'s to report)."""
    absent = []
    for symbol, names in parameters.items():
        module_name, _, path = symbol.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
            for part in path.split("."):
                target = getattr(target, part)
            accepted = inspect.signature(target).parameters
        except (ImportError, AttributeError, TypeError, ValueError):
            continue
        absent += [f"{symbol}({name})" for name in names if name not in accepted]
    return absent


def startup_problem() -> str | None:
    """Why the backend must not be registered (unsupported version, or symbols of ``SYMBOLS`` or parameters
    of ``PARAMETERS`` missing, all named), or None when it can be."""
    reason = unsupported_reason(sglang_version())
    if reason is not None:
        return reason
    absent = missing(SYMBOLS) + missing_parameters(PARAMETERS)
    if absent:
        return _missing_message(f"pd_connector's transfer backend {BACKEND_NAME!r}", absent) + (
            ", so it is not registered"
        )
    return None


def require_manager(manager: Any) -> None:
    """``PdKVManager`` start-up check, after ``CommonKVManager.__init__``: raise ``RuntimeError`` naming every
    field of ``MANAGER_FIELDS`` (and, on decode, ``DECODE_MANAGER_FIELDS``) the manager lacks."""
    fields = list(MANAGER_FIELDS)
    if getattr(getattr(manager, "disaggregation_mode", None), "value", None) == "decode":
        fields += DECODE_MANAGER_FIELDS
    absent = [f"CommonKVManager.{field}" for field in fields if not has_path(manager, field)]
    if absent:
        raise RuntimeError(_missing_message("the pd transfer backend's KV manager", absent))


# ---- registration: CLI choice, enum member, class lookup -------------------------------------------------


def extend_enum(enum_cls: type[Enum], name: str, value: str) -> Enum:
    """Add member ``name = value`` to ``enum_cls`` (idempotent); returns the member.

    Python enums are closed; SGLang looks members up by value (``TransferBackend("pd")``) and compares them
    by identity, so the new member must be in the enum's private value and name maps like a declared one.
    """
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def add_backend_choice(name: str) -> None:
    """Accept ``--disaggregation-transfer-backend name`` (SGLang's module-level list of choices)."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )

    if name not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([name])


def add_transfer_backend(name: str) -> Enum:
    """Add ``TransferBackend.<NAME> = name`` (the scheduler reads the flag as ``TransferBackend(name)``)."""
    from sglang.srt.disaggregation.utils import TransferBackend

    return extend_enum(TransferBackend, name.upper(), name)


def hook_get_kv_class(hook: Callable[..., Any]) -> None:
    """Put ``hook(original_fn, transfer_backend, class_type)`` AROUND SGLang's ``get_kv_class``."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(GET_KV_CLASS, hook, HookType.AROUND)


def kv_class_map(manager: type, sender: type, receiver: type, bootstrap_server: type) -> dict[Any, type]:
    """The backend's classes by SGLang's ``KVClassType`` (``KVARGS`` is left to SGLang's own class)."""
    from sglang.srt.disaggregation.utils import KVClassType

    return {
        KVClassType.MANAGER: manager,
        KVClassType.SENDER: sender,
        KVClassType.RECEIVER: receiver,
        KVClassType.BOOTSTRAP_SERVER: bootstrap_server,
    }


# ---- what the KV manager reads ------------------------------------------------------------------------------


def waiting_timeout_s() -> float:
    """``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``: how long D waits for a request's KV (seconds)."""
    from sglang.srt.environ import envs

    return float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())


def rank_kv_heads(args: Any, server_args: Any) -> int:
    """KV heads of this rank: SGLang sets ``KVArgs.kv_head_num`` on prefill only; decode asks the model
    config."""
    heads = getattr(args, "kv_head_num", None)
    if heads:
        return int(heads)
    from sglang.srt.configs.model_config import ModelConfig

    model_config = ModelConfig.from_server_args(server_args)
    return int(model_config.get_num_kv_heads(server_args.tp_size))


def metrics_enabled(server_args: Any) -> bool:
    """Whether SGLang exports Prometheus metrics (``--enable-metrics``): then its launcher has set the
    multiprocess directory its ``/metrics`` collects from (``pd_connector.sglang.stats``)."""
    return bool(server_args.enable_metrics)


def metric_labels(server_args: Any, kv_args: Any, mode: Any) -> dict[str, str]:
    """Labels of this scheduler process's transfer metrics, named like SGLang's own scheduler metrics: the
    served model, ``engine_type`` (prefill or decode) and the TP rank (``KVArgs.engine_rank``)."""
    return {
        "model_name": str(server_args.served_model_name or server_args.model_path),
        "engine_type": str(mode.value),
        "tp_rank": str(kv_args.engine_rank),
    }


#: Bytes of one row of the metadata buffers the backend addresses: ``output_ids`` (int32 ``[rows, 16]``, the
#: first buffer of ``MetadataBuffers.get_buf_infos``) and ``bootstrap_room`` (int64 ``[rows, 8]``, the last:
#: the manager refuses the optional KV checksum buffer that would follow it).
OUTPUT_IDS_ROW_BYTES = 16 * 4
ROOM_ROW_BYTES = 8 * 8


def require_metadata_rows(kv_args: Any) -> None:
    """``PdKVManager`` start-up check: raise ``RuntimeError`` when the metadata buffers SGLang handed over
    are not laid out as ``read_first_token`` / ``write_first_token`` address them."""
    items = [int(n) for n in kv_args.aux_item_lens]
    if len(items) < 2 or items[0] != OUTPUT_IDS_ROW_BYTES or items[-1] != ROOM_ROW_BYTES:
        raise RuntimeError(
            _missing_message(
                "the pd transfer backend's metadata rows",
                [
                    f"MetadataBuffers rows of {OUTPUT_IDS_ROW_BYTES} bytes (output_ids) first and "
                    f"{ROOM_ROW_BYTES} bytes (bootstrap_room) last, got rows of {items} bytes"
                ],
            )
        )


def _row_address(kv_args: Any, buffer: int, aux_index: int, nbytes: int) -> int:
    """Address of row ``aux_index`` of metadata buffer ``buffer``; ``IndexError`` for a row outside it."""
    item = int(kv_args.aux_item_lens[buffer])
    if not 0 <= aux_index < int(kv_args.aux_data_lens[buffer]) // item or nbytes > item:
        raise IndexError(f"metadata row {aux_index} is outside buffer {buffer}")
    return int(kv_args.aux_data_ptrs[buffer]) + aux_index * item


def read_first_token(kv_args: Any, aux_index: int) -> int:
    """P side: the first sampled token of the request in metadata row ``aux_index`` (``output_ids[0]``, which
    the prefill writes before it sends the last chunk)."""
    return int(ctypes.c_int32.from_address(_row_address(kv_args, 0, aux_index, 4)).value)


def write_first_token(kv_args: Any, aux_index: int, first_token: int, bootstrap_room: int) -> None:
    """D side: fill metadata row ``aux_index`` as SGLang's decode expects after a transfer.

    ``output_ids[0]`` gets the first token; the ``bootstrap_room`` row gets the room, which decode checks to
    detect a metadata row handed to the wrong request. Other rows (logprobs, hidden states) stay zero: the
    ``pd`` backend does not transfer them (docs/sglang.md).
    """
    ctypes.c_int32.from_address(_row_address(kv_args, 0, aux_index, 4)).value = int(first_token)
    last = len(kv_args.aux_item_lens) - 1
    ctypes.c_int64.from_address(_row_address(kv_args, last, aux_index, 8)).value = int(bootstrap_room)
