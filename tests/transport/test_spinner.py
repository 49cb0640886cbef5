"""The Python spinner the transport tests and benchmark load the GIL with: it runs exactly while its block runs."""

from __future__ import annotations

import threading
import time

import pytest

from test_support.spinner import THREAD_NAME, python_spinner
from tests.polling import wait_until


def _spinners() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def test_the_spinner_burns_cpu_while_the_block_runs_and_stops_after() -> None:
    with python_spinner():
        assert len(_spinners()) == 1
        start = time.process_time()
        # This thread only polls: the CPU time the process gains meanwhile is the spinner's. However loaded
        # the machine, the spinner gets 0.1 s of a core within the timeout.
        wait_until(lambda: time.process_time() - start > 0.1, 30, "the spinner using 0.1 s of CPU")
    assert _spinners() == []


def test_the_spinner_stops_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), python_spinner():
        raise RuntimeError("run failed")
    assert _spinners() == []
