"""The Ray release gate: the proven line passes, any other is refused with a message saying what to install."""

from __future__ import annotations

import importlib.metadata

import pytest

from pd_disagg.ray_serve.versions import PROVEN_ON, check_version, unsupported_reason


@pytest.mark.parametrize("version", ["2.60.0", "2.60.3", "2.60"])
def test_the_proven_line_is_supported(version: str) -> None:
    assert unsupported_reason(version) is None


@pytest.mark.parametrize("version", ["2.61.0", "2.6.0", "2.600.1", "3.0.0"])
def test_other_lines_are_refused_naming_the_proven_one(version: str) -> None:
    reason = unsupported_reason(version)
    assert reason is not None and version in reason and PROVEN_ON in reason and "pd-disagg[ray]" in reason


def test_the_installed_ray_is_the_extras_pin() -> None:
    """CI installs the ``ray`` extra (make install): the gate must accept what it installs."""
    assert importlib.metadata.version("ray") == PROVEN_ON.split()[1]
    check_version()
