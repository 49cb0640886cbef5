"""Start, health-check and always stop server processes (engines, routers) for tests, benchmarks and the demo.

Each server runs in its own process group with its output captured to a log file. ``stop()`` kills the whole
group (the API server and every engine/worker process it spawned), first with SIGTERM, then SIGKILL after a
grace period, so nothing outlives a test even when it fails or is interrupted. The server's main process also
gets ``PR_SET_PDEATHSIG`` so that if the harness itself is killed with SIGKILL, the server is told to exit.

Called in the harness process (pytest, a benchmark, the demo); never inside an engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time; the message carries the end of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1", attempts: int = 50) -> int:
    """The first of ``n`` consecutive TCP ports that are all free right now (a P engine's TP ranks listen on
    the side channel's port + rank)."""
    for _ in range(attempts):
        base = free_port(host)
        socks = []
        try:
            for k in range(n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, base + k))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports on {host} after {attempts} attempts")


def _stat(pid: int) -> tuple[str, list[str]] | None:
    """The command name of ``pid`` and the fields of /proc/PID/stat after it (None: the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def _cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds in the fields of a /proc/PID/stat (all the process's threads)."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _live_processes() -> Iterator[tuple[int, list[str]]]:
    """(PID, the fields of /proc/PID/stat after the command name) of every live (non-zombie) process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is not None and stat[1][0] != "Z":
            yield int(entry), stat[1]


def process_group_members(pgid: int) -> list[int]:
    """PIDs of live (non-zombie) processes in process group ``pgid``: how tests prove nothing was left behind."""
    return [pid for pid, fields in _live_processes() if int(fields[2]) == pgid]


def descendants(pid: int) -> set[int]:
    """PIDs of the live (non-zombie) processes descended from ``pid``, by parent links in /proc: what a test
    or benchmark started through a process that does not keep its children in one group (a Ray cluster's
    workers, and the engines under them)."""
    tree: dict[int, list[int]] = {}
    for child, fields in _live_processes():
        tree.setdefault(int(fields[1]), []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def process_group_cpu_seconds(pgid: int) -> float:
    """User + system CPU time of the live processes of group ``pgid`` (all their threads), from /proc.

    Benchmarks use it for per-request CPU and idle CPU, figures that depend less on other load than rates.
    """
    return sum(cpu for _, cpu in filter(None, map(process_cpu_seconds, process_group_members(pgid))))


def process_cpu_seconds(pid: int) -> tuple[str, float] | None:
    """The command name of ``pid`` and its user + system CPU seconds so far (None: the process is gone)."""
    stat = _stat(pid)
    return None if stat is None else (stat[0], _cpu_seconds(stat[1]))


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask the kernel to SIGTERM us when the parent dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ManagedServer:
    """One server process (group) with a log file and an HTTP health URL."""

    name: str
    argv: Sequence[str]
    log_path: Path
    health_url: str
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process for its lifetime
        try:
            self.proc = subprocess.Popen(
                list(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll the health URL until it answers 200; raise with the log tail on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise ServerStartError(
                    f"{self.name} exited with code {code} before becoming healthy; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(poll_s)
        raise ServerStartError(
            f"{self.name} not healthy after {timeout_s:.0f}s at {self.health_url}; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group at once (used by failure tests to kill a peer)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0, gone_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``, and return once no member is left alive
        (or after ``gone_s`` more); safe to call twice."""
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        # Engine workers may linger after the leader exits: always sweep the group.
        self.kill(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        # A killed worker is still alive while the kernel frees its memory (GBs for an engine): wait for it,
        # so that the caller's next server finds the cores and memory free.
        deadline = time.monotonic() + gone_s
        while process_group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)


@contextlib.contextmanager
def running(server: ManagedServer, timeout_s: float = 300.0) -> Iterator[ManagedServer]:
    """Start ``server``, wait for health, yield it, and stop it whatever happens."""
    try:
        server.start()
        server.wait_healthy(timeout_s)
        yield server
    finally:
        server.stop()
