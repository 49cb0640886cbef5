"""The vLLM version gate: the tested release line runs, any other is refused naming both versions."""

from __future__ import annotations

import pytest

from pd_connector.vllm.compat import check_version, unsupported_reason


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.4", "0.32"])
def test_the_tested_line_is_supported(version: str) -> None:
    assert unsupported_reason(version) is None


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "0.320.1", "1.0.0", "0.3.2"])
def test_other_versions_are_refused_naming_them(version: str) -> None:
    reason = unsupported_reason(version)
    assert reason is not None and f"this is vLLM {version}" in reason and "0.32.x" in reason


def test_the_installed_vllm_passes() -> None:
    check_version()
