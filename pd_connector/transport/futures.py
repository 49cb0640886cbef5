"""Small ``concurrent.futures`` helpers every transport uses to report results to engine threads."""

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
