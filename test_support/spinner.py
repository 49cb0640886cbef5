"""A thread that runs Python for as long as a block runs: the load an engine's own threads put on the GIL.

An engine's scheduler and model threads run Python while a transfer is in flight, and a transport whose I/O
thread lets go of the GIL per span is starved by them (each time it wants the GIL back it waits up to the
interpreter's switch interval). ``python_spinner`` recreates that load in one process: the transport
benchmark's ``spin`` case (``benchmarks.transport``) and the transport tests' starvation test run a write
inside it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

#: The spinner thread's name, so a test can tell whether one is running.
THREAD_NAME = "python-spinner"


@contextlib.contextmanager
def python_spinner() -> Iterator[None]:
    """A thread of this process running Python (``x += 1`` in a loop) until the block ends, also on an error."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    thread = threading.Thread(target=spin, name=THREAD_NAME)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
