"""benchmarks.chaos' own logic without engines: how a request is classified (against a small aiohttp server that
answers as vLLM does, right or wrong), the seeded fault timeline and the recovery figures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks.chaos import FAULT_KINDS, Plan, Record, one_request, recovery, timeline

pytestmark = pytest.mark.unit

WANT = [5, 6, 7, 8]
PLAN = Plan(model=Path(), requests=1000, deadline_s=2.0)


def _server(
    text: list[int], stream_error: bool = False, status: int = 200, stall: bool = False
) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if status != 200:
            return web.json_response({"error": "no"}, status=status)
        if stall:
            await asyncio.sleep(10)  # longer than the plan's deadline: the client must give up
        if not body["stream"]:
            return web.json_response({"choices": [{"text": "", "token_ids": text}]})
        resp = web.StreamResponse()
        await resp.prepare(request)
        half = len(text) // 2
        for part in (text[:half], text[half:]):
            event = {"choices": [{"text": "", "token_ids": part}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            if stream_error:
                await resp.write(f"data: {json.dumps({'error': {'message': 'gone'}})}\n\n".encode())
                return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.mark.parametrize(
    ("server", "mode", "outcome"),
    [
        (dict(text=WANT), "plain", "ok"),
        (dict(text=WANT), "stream", "ok"),
        (dict(text=[5, 6, 7, 9]), "plain", "wrong_tokens"),
        (dict(text=[5, 6, 7, 9]), "stream", "wrong_tokens"),
        (dict(text=WANT, stream_error=True), "stream", "failed_clean"),  # a correct prefix, then an error
        (dict(text=[9, 6, 7, 8], stream_error=True), "stream", "wrong_tokens"),
        (dict(text=WANT, status=503), "plain", "failed_clean"),
        (dict(text=WANT), "drop", "disconnected"),
        (dict(text=WANT, stall=True), "plain", "hung"),
    ],
)
async def test_each_answer_is_classified(server: dict[str, Any], mode: str, outcome: str) -> None:
    srv = TestServer(_server(**server))
    await srv.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            url = str(srv.make_url("")).rstrip("/")
            record = await one_request(session, url, [1, 2], WANT, PLAN, mode, 0.0)
    finally:
        await srv.close()
    assert record.outcome == outcome, record


def test_the_timeline_is_seeded_ordered_and_inside_the_load() -> None:
    plan = Plan(model=Path(), requests=1000, faults=dict.fromkeys(FAULT_KINDS, 3))
    events = timeline(plan)
    assert events == timeline(plan) and events == sorted(events)
    assert len(events) == 3 * (len(FAULT_KINDS) - 1)  # client disconnects are drawn per request instead
    assert all(50 <= at <= 850 for at, _ in events)
    assert timeline(Plan(model=Path(), requests=1000, seed=1, faults=plan.faults)) != events


def test_recovery_is_the_first_right_answer_started_after_the_fault() -> None:
    records = [
        Record(0.0, 1.0, "ok"),  # started before the fault: does not count
        Record(2.0, 3.0, "failed_clean"),
        Record(2.5, 6.0, "ok"),
        Record(3.0, 4.0, "ok"),
    ]
    assert recovery(records, [(1.5, "kill_prefill")]) == {"kill_prefill": [2.5, 2.5]}
    assert recovery(records, [(5.0, "garbage")]) == {"garbage": None}  # no request started after it
