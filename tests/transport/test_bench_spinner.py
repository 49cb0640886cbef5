"""The transport benchmark's Python spinner: a thread runs Python exactly while the block runs."""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks import transport as bench


def _spinners() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "python-spinner"]


def test_the_spinner_takes_the_gil_while_the_block_runs_and_stops_after() -> None:
    with bench.python_spinner():
        assert len(_spinners()) == 1
        start = time.process_time()
        time.sleep(0.3)  # this thread sleeps: the CPU time the process uses meanwhile is the spinner's
        assert time.process_time() - start > 0.1
    assert _spinners() == []


def test_the_spinner_stops_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), bench.python_spinner():
        raise RuntimeError("run failed")
    assert _spinners() == []
