"""Everything the SGLang transfer backend ``pd`` reads or changes inside SGLang, in one place.

Proven on sglang 0.5.23 (``SUPPORTED_SGLANG``). SGLang has no transfer-backend registry and no public base
for backends, so the backend extends the CLI choices, adds a member to the ``TransferBackend`` enum, hooks
``get_kv_class`` (enum map ``KVClassType`` -> classes), subclasses the ``Common*`` classes of
``sglang.srt.disaggregation.common.conn`` (overriding and calling private methods), reads private fields of
the manager, and writes raw rows of SGLang's ``MetadataBuffers``. None of that is promised to stay.

Who calls what:
- ``plugin.register`` (the ``sglang.srt.plugins`` entry point, in SGLang's launcher, scheduler and
  detokenizer processes): ``startup_problem`` (version gate, then every symbol in ``SYMBOLS``; on a problem
  it logs the message and registers nothing), then ``add_backend_choice``, ``add_transfer_backend`` and
  ``hook_get_kv_class``; its hook calls ``kv_class_map``.
- ``conn.py`` (the backend's classes, imported through SGLang only): subclasses ``CommonKVManager``,
  ``CommonKVSender``, ``CommonKVReceiver``, ``CommonKVBootstrapServer`` and uses ``KVArgs``, ``KVPoll``,
  ``KVTransferDestination``, ``DisaggregationMode``, ``ServerArgs``, all imported from here;
  ``PdKVManager`` calls ``require_manager`` after ``CommonKVManager.__init__``, and ``rank_kv_heads``,
  ``waiting_timeout_s``, ``read_first_token``, ``write_first_token``.

Importing this module imports no SGLang (so ``register`` can report what is missing instead of failing on an
import): the SGLang classes above resolve on first use (module ``__getattr__``).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

from pd_connector.engine_symbols import has_path, missing

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

SUPPORTED_SGLANG = ("0.5.23",)
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
    f"{_UTILS}:get_kv_class",
    *(f"{_UTILS}:KVClassType.{m}" for m in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")),
    "sglang.srt.plugins.hook_registry:HookRegistry.register",
    "sglang.srt.plugins.hook_registry:HookType.AROUND",
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
)
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


def unsupported_reason(version: str | None) -> str | None:
    """Why this SGLang cannot use the backend, or None when it can."""
    if version is None:
        return "sglang is not installed"
    if version not in SUPPORTED_SGLANG:
        return (
            f"sglang {version} is not supported by pd_connector's transfer backend {BACKEND_NAME!r} "
            f"(supported: {', '.join(SUPPORTED_SGLANG)}); it hooks SGLang internals that change between "
            "releases, so it is not registered"
        )
    return None


def _missing_message(user: str, absent: list[str]) -> str:
    return (
        f"{user} needs SGLang internals that this SGLang ({sglang_version()}) lacks: {', '.join(absent)} "
        f"(proven on sglang {', '.join(SUPPORTED_SGLANG)})"
    )


def startup_problem() -> str | None:
    """Why the backend must not be registered (unsupported version, or symbols of ``SYMBOLS`` missing, all
    named), or None when it can be."""
    reason = unsupported_reason(sglang_version())
    if reason is not None:
        return reason
    absent = missing(SYMBOLS)
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


def read_first_token(kv_args: Any, aux_index: int) -> int:
    """P side: the first sampled token of the request in metadata row ``aux_index``.

    SGLang's ``MetadataBuffers.get_buf_infos`` lists ``output_ids`` (int32 ``[rows, 16]``) first; the prefill
    writes the sampled token into its row before it sends the last chunk.
    """
    address = int(kv_args.aux_data_ptrs[0]) + aux_index * int(kv_args.aux_item_lens[0])
    return int(ctypes.c_int32.from_address(address).value)


def write_first_token(kv_args: Any, aux_index: int, first_token: int, bootstrap_room: int) -> None:
    """D side: fill metadata row ``aux_index`` as SGLang's decode expects after a transfer.

    ``output_ids[0]`` gets the first token; the ``bootstrap_room`` row (int64 ``[rows, 8]``, the last
    buffer: the manager refuses the optional KV checksum buffer) gets the room, which decode checks to detect
    a metadata row handed to the wrong request. Other rows (logprobs, hidden states) stay zero: the ``pd``
    backend does not transfer them (docs/sglang.md).
    """
    ptrs, items = kv_args.aux_data_ptrs, kv_args.aux_item_lens
    ctypes.c_int32.from_address(int(ptrs[0]) + aux_index * int(items[0])).value = int(first_token)
    room_buf = len(ptrs) - 1
    ctypes.c_int64.from_address(int(ptrs[room_buf]) + aux_index * int(items[room_buf])).value = int(
        bootstrap_room
    )
