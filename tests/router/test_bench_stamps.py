"""The router benchmark's added-latency method: the fake upstream's stamps and the transit arithmetic."""

from __future__ import annotations

import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from benchmarks.router import ClientStamps, Transit, added_ms, pct, transits
from test_support.fake_vllm import FakeEngine


async def _client(engine: FakeEngine) -> TestClient:
    client = TestClient(TestServer(engine.app()))
    await client.start_server()
    return client


async def test_fake_stamps_a_streamed_request_between_the_clients_send_and_last_byte() -> None:
    engine = FakeEngine(token_delay_s=0.002, stamps={})
    client = await _client(engine)
    try:
        body = {"model": "fake-model", "prompt": "hello world k7", "max_tokens": 8, "stream": True}
        sent = time.monotonic_ns()
        resp = await client.post("/v1/completions", json=body)
        text = await resp.text()
        got_last = time.monotonic_ns()
        assert text.endswith("data: [DONE]\n\n")
        stamps = engine.take_stamps()
        assert list(stamps) == ["k7"]
        arrived, first, done = stamps["k7"]
        assert sent <= arrived <= first <= done <= got_last
        # the first event follows one pause, [DONE] follows all eight
        assert first - arrived >= 2_000_000
        assert done - first >= 7 * 2_000_000
        # read once: the next call has nothing
        assert engine.take_stamps() == {}
        # a non-streamed request is not stamped
        await client.post("/v1/completions", json={**body, "stream": False, "prompt": "x k8"})
        assert engine.take_stamps() == {}
    finally:
        await client.close()


async def test_chat_is_keyed_by_the_last_word_of_the_last_message() -> None:
    engine = FakeEngine(stamps={})
    client = await _client(engine)
    try:
        body = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi there k9"}],
            "max_tokens": 3,
            "stream": True,
        }
        await (await client.post("/v1/chat/completions", json=body)).read()
        assert list(engine.take_stamps()) == ["k9"]
    finally:
        await client.close()


async def test_without_stamps_nothing_is_recorded() -> None:
    engine = FakeEngine()
    client = await _client(engine)
    try:
        body = {"model": "fake-model", "prompt": "a k1", "max_tokens": 2, "stream": True}
        await (await client.post("/v1/completions", json=body)).read()
        assert engine.take_stamps() == {}
        assert engine.stamps is None
    finally:
        await client.close()


def test_transit_is_time_outside_the_upstream() -> None:
    # sent 100, arrived 130 (30 forward); first event written 1000, seen 1012; [DONE] written 5000, seen 5020
    client = [ClientStamps("a", 100, 1012, 5020)]
    (t,) = transits(client, {"a": [130, 1000, 5000]})
    assert t == Transit(forward=30, first_back=12, last_back=20)
    assert t.total == 50
    assert t.ttft == 42


def test_transit_rejects_missing_and_inconsistent_stamps() -> None:
    with pytest.raises(ValueError, match="no stamps"):
        transits([ClientStamps("a", 0, 10, 20)], {"b": [1, 2, 3]})
    # the upstream claims to have seen the request before it was sent: different clocks or a bad join
    with pytest.raises(ValueError, match="out of order"):
        transits([ClientStamps("a", 50, 60, 70)], {"a": [40, 55, 65]})
    # the client saw the first event before the upstream wrote it
    with pytest.raises(ValueError, match="out of order"):
        transits([ClientStamps("a", 0, 5, 70)], {"a": [1, 10, 60]})


def test_added_is_percentile_through_minus_percentile_direct_in_ms() -> None:
    direct = [100_000 + i * 1_000 for i in range(100)]  # 0.100 .. 0.199 ms
    through = [v + 250_000 for v in direct]  # +0.25 ms everywhere
    assert pct(direct, 0.5) == 150_000
    assert pct(direct, 0.99) == 199_000
    assert added_ms(through, direct) == {"p50": 0.25, "p99": 0.25}
    # one slow request in a hundred moves p99, not p50
    slow = [*through[:-1], 5_000_000]
    assert added_ms(slow, direct) == {"p50": 0.25, "p99": 4.801}
