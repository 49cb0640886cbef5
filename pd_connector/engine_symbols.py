"""Which engine internals are missing: the check both engine ``compat`` modules run at start.

``pd_connector.vllm.compat`` and ``pd_connector.sglang.compat`` list each private or undocumented engine
symbol they use as ``"module:attribute.path"`` and call ``missing`` when the engine starts the adapter, so a
release that renamed or dropped one is refused with every absent symbol named, instead of failing later.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable


def has_path(obj: object, path: str) -> bool:
    """Whether ``obj.a.b...`` exists for the dotted ``path``."""
    for name in path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            return False
    return True


def missing(symbols: Iterable[str]) -> list[str]:
    """The ``module:attribute.path`` entries of ``symbols`` that do not resolve (module or attribute absent)."""
    absent = []
    for symbol in symbols:
        module_name, _, path = symbol.partition(":")
        try:
            module: object = importlib.import_module(module_name)
        except ImportError:
            absent.append(symbol)
            continue
        if path and not has_path(module, path):
            absent.append(symbol)
    return absent
