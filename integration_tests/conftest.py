"""Fixtures that start real engine servers for integration tests.

Every test in this folder is marked ``integration``. Servers are started through ``pd_disagg.servers`` (own
process group, log file, health polling, kill-on-teardown). If a server cannot start, the fixture raises and
the test errors: integration tests never skip because an engine is missing or broken. Logs of servers used
by a failing test are printed in the test report (``-rfE``), and kept under ``logs/integration/``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from integration_tests.starter import server_starter
from pd_disagg import smollm2
from pd_disagg.servers import ManagedServer
from pd_disagg.tiny_model import PRESETS, build

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / "logs" / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny test model: ``PD_TEST_MODEL`` if set (``make test`` builds it), else built into .cache."""
    env = os.environ.get("PD_TEST_MODEL")
    if env:
        return Path(env)
    return build(ROOT / ".cache" / "models" / "tiny-llama", PRESETS["tiny"])


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct converted into .cache (``make smollm2`` does it first; else it is done here).
    Errors, never skips, when the wheel or the conversion's packages are missing."""
    return smollm2.chat_model(ROOT)


@pytest.fixture(scope="session")
def log_dir() -> Path:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    return LOG_DIR


ServerFactory = Callable[[ManagedServer], ManagedServer]


@pytest.fixture(scope="module")
def start_servers() -> Iterator[Callable[..., list[ManagedServer]]]:
    """Module-scoped: ``start_servers(a, b, ...)`` starts and health-checks servers, stops them at module end.

    Module scope lets the tests of one file share servers (each start costs 30-60 s of CPU); every server is
    stopped by PID/process group when the module finishes, also when a test failed. (A package of test files
    sharing servers uses ``starter.server_starter`` at package scope, as integration_tests/pd_connector/ does.)
    """
    with server_starter() as start:
        yield start
