"""``sglang.srt.plugins`` entry point: make ``--disaggregation-transfer-backend pd`` select our classes.

SGLang calls ``register()`` early in its launcher, scheduler and detokenizer processes (before it parses
arguments). SGLang 0.5.23 has no transfer-backend registry, so this (1) adds ``pd`` to the CLI choices,
(2) adds a ``PD`` member to its ``TransferBackend`` enum (``TransferBackend("pd")`` is how the scheduler
reads the flag), and (3) puts an AROUND hook on ``sglang.srt.disaggregation.utils.get_kv_class`` that returns
``conn.py``'s classes for ``PD`` and defers to SGLang for every other backend.

These touch SGLang internals, so only versions in ``SUPPORTED_SGLANG`` are registered; on any other version
``register`` logs an error saying so and registers nothing (the server then rejects ``pd`` as an unknown
choice instead of misbehaving). Nothing here raises into SGLang: a plugin or hook that raises would kill the
process that loads it.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from enum import Enum
from typing import Any

logger = logging.getLogger(__name__)

BACKEND_NAME = "pd"
SUPPORTED_SGLANG = ("0.5.23",)
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


def sglang_version() -> str | None:
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


def extend_enum(enum_cls: type[Enum], name: str, value: str) -> Enum:
    """Add member ``name = value`` to ``enum_cls`` (idempotent); returns the member.

    Python enums are closed; SGLang looks members up by value (``TransferBackend("pd")``) and compares them
    by identity, so the new member must be in the enum's value and name maps like a declared one.
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


def _class_mapping() -> dict[Any, type]:
    from sglang.srt.disaggregation.utils import KVClassType

    from pd_connector.sglang.conn import PdKVBootstrapServer, PdKVManager, PdKVReceiver, PdKVSender

    return {
        KVClassType.MANAGER: PdKVManager,
        KVClassType.SENDER: PdKVSender,
        KVClassType.RECEIVER: PdKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: PdKVBootstrapServer,
    }


def get_kv_class_hook(original_fn: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """AROUND hook: our classes for the ``pd`` backend (KVArgs stays SGLang's), SGLang's for the others.

    If our classes cannot be imported, the cause is logged and SGLang's own lookup answers (it raises its
    "Unsupported transfer backend" error at start-up rather than anything failing later).
    """
    if getattr(transfer_backend, "value", None) == BACKEND_NAME:
        try:
            mapping = _class_mapping()
        except Exception:
            logger.exception("pd_connector: cannot import the SGLang transfer backend %r", BACKEND_NAME)
        else:
            if class_type in mapping:
                return mapping[class_type]
    return original_fn(transfer_backend, class_type)


def register() -> None:
    """Entry point called by SGLang's ``load_plugins``; logs and returns on any problem."""
    reason = unsupported_reason(sglang_version())
    if reason is not None:
        logger.error("pd_connector: %s", reason)
        return
    try:
        from sglang.srt.arg_groups.choices import (
            DISAGG_TRANSFER_BACKEND_CHOICES,
            add_disagg_transfer_backend_choices,
        )
        from sglang.srt.disaggregation.utils import TransferBackend
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
            add_disagg_transfer_backend_choices([BACKEND_NAME])
        extend_enum(TransferBackend, BACKEND_NAME.upper(), BACKEND_NAME)
        HookRegistry.register(GET_KV_CLASS, get_kv_class_hook, HookType.AROUND)
    except Exception:
        logger.exception("pd_connector: registering the SGLang transfer backend %r failed", BACKEND_NAME)
