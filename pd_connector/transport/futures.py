"""Small ``concurrent.futures`` helpers every transport uses to report results to engine threads.

Who calls them: the transports (``tcp``, ``cma``, ``ucx``), from engine threads (a write's future, a refused
``attach``) and from their I/O threads (failing a write)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def fail(future: Future[Any], error: Exception) -> None:
    """Fail ``future`` unless it already resolved (detach, close and I/O errors may race to fail it)."""
    if not future.done():
        future.set_exception(error)


def failed(error: Exception) -> Future[T]:
    """An already failed future: what a non-blocking call returns for a request refused up front."""
    future: Future[T] = Future()
    future.set_exception(error)
    return future


def running() -> Future[T]:
    """A new future already marked running, so nobody can cancel it: what ``write`` returns (the work is
    queued or posted and will resolve it)."""
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()
    return future
