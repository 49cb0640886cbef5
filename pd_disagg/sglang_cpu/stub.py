"""Import-only stand-in modules: every attribute and submodule exists, using one raises.

Called from ``stand_ins/<package>/__init__.py`` in SGLang server processes (see ``pd_disagg.sglang_cpu``).
A CPU code path that really needs the missing package fails loudly with the name it wanted, instead of
computing something wrong.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class Missing:
    """A placeholder for a name of a missing package: imports, chains attributes, raises when called."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"{self._qualname} is not available in this CPU stand-in (pd_disagg.sglang_cpu)"
        )

    def __getattr__(self, name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<missing {self._qualname}>"


class _StubModule(types.ModuleType):
    """A module whose unknown attributes are ``Missing`` placeholders."""

    def __getattr__(self, name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self.__name__}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``<package>.<anything>`` importable as a ``_StubModule``."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.package + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(package: str) -> Callable[[str], Missing]:
    """Register the submodule finder for ``package``; returns the package's module-level ``__getattr__``."""
    if not any(isinstance(f, _SubmoduleFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_SubmoduleFinder(package))

    def module_getattr(name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{package}.{name}")

    return module_getattr
