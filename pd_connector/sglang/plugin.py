"""``sglang.srt.plugins`` entry point: make ``--disaggregation-transfer-backend pd`` select our classes.

SGLang calls ``register()`` early in its launcher, scheduler and detokenizer processes (before it parses
arguments). SGLang 0.5.23 has no transfer-backend registry, so this (1) adds ``pd`` to the CLI choices,
(2) adds a ``PD`` member to its ``TransferBackend`` enum (``TransferBackend("pd")`` is how the scheduler
reads the flag), and (3) puts an AROUND hook on ``sglang.srt.disaggregation.utils.get_kv_class`` that returns
``conn.py``'s classes for ``PD`` and defers to SGLang for every other backend, and (4) puts the layer-wise
push's hooks on ``Scheduler.run_batch`` and ``MHATokenToKVPool.set_kv_buffer`` (``layerwise.py``; they act
only on a prefill server whose KV manager is ours). Each of these SGLang internals is reached through
``compat.py``. With ``PD_SGLANG_SCHEDULER=slo`` it also registers the SLO scheduler's hooks
(``scheduler_plugins.sglang``, through ``compat.scheduler``).

Only SGLang releases of ``compat.SUPPORTED_LINE`` (from ``compat.PROVEN_ON`` on) that have every symbol and
parameter ``compat.SYMBOLS`` and ``compat.PARAMETERS`` list are registered (with a warning on a release other
than the proven one); otherwise ``register`` logs an error naming the version or the missing pieces and
registers nothing (the server then rejects ``pd`` as an unknown choice instead of misbehaving). Nothing here raises into SGLang: a
plugin or hook that raises would kill the process that loads it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pd_connector.sglang import compat, layerwise

logger = logging.getLogger(__name__)

BACKEND_NAME = compat.BACKEND_NAME


def _class_mapping() -> dict[Any, type]:
    from pd_connector.sglang.conn import PdKVBootstrapServer, PdKVManager, PdKVReceiver, PdKVSender

    return compat.kv_class_map(PdKVManager, PdKVSender, PdKVReceiver, PdKVBootstrapServer)


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
    _register_slo_scheduler()
    try:
        problem = compat.startup_problem()
        if problem is not None:
            logger.error("pd_connector: %s", problem)
            return
        warning = compat.unproven_warning(compat.sglang_version())
        if warning is not None:
            logger.warning("pd_connector: %s", warning)
        compat.add_backend_choice(BACKEND_NAME)
        compat.add_transfer_backend(BACKEND_NAME)
        compat.hook_get_kv_class(get_kv_class_hook)
        compat.hook_layerwise(layerwise.run_batch_hook, layerwise.set_kv_buffer_hook)
    except Exception:
        logger.exception("pd_connector: registering the SGLang transfer backend %r failed", BACKEND_NAME)


def _register_slo_scheduler() -> None:
    """``scheduler_plugins.sglang`` (the SLO scheduler's SGLang adapter) when ``PD_SGLANG_SCHEDULER=slo``;
    independent of the transfer backend (it serves aggregated servers)."""
    try:
        from scheduler_plugins import sglang as slo_scheduler

        slo_scheduler.register()
    except Exception:
        logger.exception("pd_connector: registering scheduler_plugins' SLO scheduler failed")
