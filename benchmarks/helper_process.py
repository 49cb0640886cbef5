"""The line protocol of the transport benchmarks' helper processes, from both ends.

A helper (a receiver that owns target memory, or a sender that drives one data path) prints ``READY`` once it
is set up (followed by its descriptor in hex when it has one), answers commands read from its stdin, and ends on
``exit``. ``benchmarks.transport``, ``benchmarks.tp_pairs`` and ``benchmarks.transfer_engine`` start theirs with ``Helper`` (orchestrator side)
and serve with ``wait_for_exit`` (helper side).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence


class Helper:
    """A started helper process, once it printed ``READY``; ``stop`` ends it (killed if it does not exit)."""

    def __init__(
        self, argv: Sequence[str], what: str, env: Mapping[str, str] | None = None, stop_wait_s: float = 30.0
    ) -> None:
        self.what, self._stop_wait_s = what, stop_wait_s
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self.expect("READY")

    @property
    def descriptor(self) -> bytes:
        """What a receiver printed after ``READY``: its transport descriptor."""
        return bytes.fromhex(self.ready[0])

    def expect(self, tag: str) -> list[str]:
        """The fields after ``tag`` on the next line starting with it (``RuntimeError`` if the helper exits)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line.split()[1:]
        raise RuntimeError(f"{self.what} exited with {self.proc.wait()} before {tag}")

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the helper so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        try:
            self.send("exit")
            self.proc.wait(self._stop_wait_s)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


def wait_for_exit() -> None:
    """Helper side: read stdin until ``exit`` (or its end)."""
    for line in sys.stdin:
        if line.strip() == "exit":
            return
