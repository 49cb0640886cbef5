"""The process harness starts, health-checks and always stops its servers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pd_disagg.servers import (
    ManagedServer,
    ServerStartError,
    descendants,
    free_port,
    process_group_cpu_seconds,
    process_group_members,
    running,
)


def _server(tmp_path: Path, name: str, code: str, port: int | None = None) -> ManagedServer:
    """A ``python -c code`` server whose health URL is on ``port`` (default: a free port nothing listens on)."""
    return ManagedServer(
        name=name,
        argv=[sys.executable, "-c", code],
        log_path=tmp_path / f"{name}.log",
        health_url=f"http://127.0.0.1:{port or free_port()}/health",
    )


def _http_server(tmp_path: Path, port: int, extra: str = "") -> ManagedServer:
    code = (
        "import http.server, os, subprocess, sys\n"
        f"{extra}\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    return _server(tmp_path, "fake", code, port)


def test_running_waits_for_health_and_stops_the_group(tmp_path: Path) -> None:
    # The server spawns a grandchild, as vLLM spawns its EngineCore: stop() must kill both.
    extra = "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])"
    with running(_http_server(tmp_path, free_port(), extra), timeout_s=20) as server:
        pgid = server.pid
        assert len(process_group_members(pgid)) >= 2
    assert process_group_members(pgid) == []  # stop() returns only once the group is gone


def test_descendants_follow_parent_links_across_process_groups() -> None:
    """A grandchild in a session of its own (as Ray's workers and the engines under them) is found; once
    killed and reaped, neither is."""
    code = (
        "import subprocess, sys; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
        "print(c.pid, flush=True); c.wait()"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        assert {parent.pid, grandchild} <= descendants(os.getpid())
        assert descendants(parent.pid) == {grandchild}
    finally:
        os.kill(grandchild, signal.SIGKILL)
        parent.wait(timeout=20)
    assert parent.pid not in descendants(os.getpid()) and grandchild not in descendants(os.getpid())


def test_exit_before_health_raises_with_log(tmp_path: Path) -> None:
    server = _server(tmp_path, "crash", "print('boom'); raise SystemExit(3)")
    with (
        pytest.raises(ServerStartError, match=r"(?s)exited with code 3.*boom"),
        running(server, timeout_s=20),
    ):
        pass
    assert not server.alive()


def test_health_timeout_raises_and_kills(tmp_path: Path) -> None:
    server = _server(tmp_path, "mute", "import time; time.sleep(600)")
    with pytest.raises(ServerStartError, match="not healthy after"), running(server, timeout_s=1.5):
        pass
    assert not server.alive()


def test_process_group_cpu_seconds_counts_our_own_work() -> None:
    """The benchmarks' CPU figures: this process's group accumulates the CPU time this loop burns."""
    pgid = os.getpgid(0)
    before = process_group_cpu_seconds(pgid)
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert process_group_cpu_seconds(pgid) - before >= 0.15
