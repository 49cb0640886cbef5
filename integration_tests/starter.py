"""Start real engine servers for a fixture's scope and stop them all at its end.

Used by the ``start_servers`` fixture (integration_tests/conftest.py, one test module's servers) and by the
package-scoped fixtures of integration_tests/pd_connector/ (one P/D cluster shared by several files). Every
server is started in parallel and health-checked; each is stopped by PID/process group when the scope ends,
also when a test failed or a start failed, and the scope's teardown fails if any process of a stopped server's
group is still alive (an engine's EngineCore or worker outliving its API server would hold a core and GiBs
for every later module).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pd_disagg.servers import ManagedServer, ServerStartError, process_group_members

SERVER_START_TIMEOUT_S = float(os.environ.get("PD_TEST_SERVER_TIMEOUT_S", "420"))


def _start_all(servers: list[ManagedServer]) -> None:
    """Start all, then wait for each: engines load in parallel, which halves start-up on two cores."""
    for server in servers:
        server.start()
    for server in servers:
        try:
            server.wait_healthy(SERVER_START_TIMEOUT_S)
        except ServerStartError:
            for other in servers:
                other.stop()
            raise


@contextmanager
def server_starter() -> Iterator[Callable[..., list[ManagedServer]]]:
    """``start(a, b, ...)`` starts and health-checks servers and returns them; on exit every server it
    started is stopped, the last started first."""
    started: list[ManagedServer] = []

    def start(*servers: ManagedServer) -> list[ManagedServer]:
        started.extend(servers)
        _start_all(list(servers))
        return list(servers)

    try:
        yield start
    finally:
        for server in reversed(started):
            server.stop()
        left = {s.name: members for s in started if s.proc and (members := process_group_members(s.pid))}
        if left:
            raise AssertionError(f"processes left after stop (server: pids): {left}")
