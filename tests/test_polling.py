"""The polling helpers the unit tests wait with: they return once the condition holds and fail the test, naming
what was awaited, once it did not hold in time."""

from __future__ import annotations

import asyncio

import pytest

from tests.polling import wait_until, wait_until_async


def test_wait_until_returns_the_time_it_took() -> None:
    polls = iter([False, False, True])
    assert 0 <= wait_until(lambda: next(polls), 5) < 5


def test_wait_until_fails_naming_what_never_came() -> None:
    with pytest.raises(AssertionError, match=r"after 0\.05 s waiting for the moon"):
        wait_until(lambda: False, 0.05, "the moon")


async def test_wait_until_async_polls_an_async_predicate_while_the_loop_runs() -> None:
    done = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, done.set)  # only runs if the helper yields to the loop

    async def is_done() -> bool:
        return done.is_set()

    assert await wait_until_async(is_done, 5) >= 0.02


async def test_wait_until_async_fails_naming_what_never_came() -> None:
    with pytest.raises(AssertionError, match="waiting for the tide"):
        await wait_until_async(lambda: False, 0.05, "the tide")
