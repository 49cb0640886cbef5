"""benchmarks.chaos' own logic without engines: how a request is classified (against a small aiohttp server that
answers as vLLM does, right or wrong, completions and chats, by token ids or by text), the prompts, the seeded
fault timeline, SGLang's load reading and the recovery figures."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks.chaos import FAULT_KINDS, PHASE_FAULTS, Injector, Plan, run
from benchmarks.chaos_causes import Window, attribute, cause_of, roles_down, router_resumes
from benchmarks.chaos_cluster import Cluster, _loads
from benchmarks.chaos_load import Answer, Prompt, Record, load, one_request, prompts, recovery, timeline
from test_support.fault_proxy import FaultProxy

pytestmark = pytest.mark.unit

WANT = [5, 6, 7, 8]
PLAN = Plan(model=Path(), requests=1000, deadline_s=2.0)
COMPLETION, CHAT = Prompt(tokens=(1, 2)), Prompt(message="a b")


def _text(ids: list[int]) -> str:
    return "".join(f"t{i} " for i in ids)


def _server(
    text: list[int], stream_error: bool = False, status: int = 200, stall: bool = False
) -> web.Application:
    """Answers ``text`` (token ids; their text is ``_text``) as vLLM does: completions and chats, whole or
    streamed in two parts, with token ids when asked for."""

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = "messages" in body
        ids = bool(body.get("return_token_ids"))
        if status != 200:
            return web.json_response({"error": "no"}, status=status)
        if stall:
            await asyncio.sleep(10)  # longer than the plan's deadline: the client must give up

        def choice(part: list[int], stream: bool) -> dict[str, Any]:
            out: dict[str, Any] = {"text": _text(part)} if not chat else {}
            if chat:
                out["delta" if stream else "message"] = {"role": "assistant", "content": _text(part)}
            if ids:
                out["token_ids"] = part
            return out

        if not body["stream"]:
            return web.json_response({"choices": [choice(text, False)]})
        resp = web.StreamResponse()
        await resp.prepare(request)
        half = len(text) // 2
        for part in (text[:half], text[half:]):
            await resp.write(f"data: {json.dumps({'choices': [choice(part, True)]})}\n\n".encode())
            if stream_error:
                await resp.write(f"data: {json.dumps({'error': {'message': 'gone'}})}\n\n".encode())
                return resp
        await resp.write(f"data: {json.dumps({'choices': []})}\n\n".encode())  # a usage chunk has none
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    app.router.add_post("/v1/chat/completions", answer)
    return app


@pytest.mark.parametrize("prompt", [COMPLETION, CHAT], ids=["completion", "chat"])
@pytest.mark.parametrize("by_ids", [True, False], ids=["ids", "text"])
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
async def test_each_answer_is_classified(
    server: dict[str, Any], mode: str, outcome: str, prompt: Prompt, by_ids: bool
) -> None:
    """By token ids or, where the engine gives none (SGLang's chats), by text: the same verdicts."""
    srv = TestServer(_server(**server))
    await srv.start_server()
    answer = Answer(tuple(WANT) if by_ids else None, _text(WANT))
    try:
        async with aiohttp.ClientSession() as session:
            url = str(srv.make_url("")).rstrip("/")
            record = await one_request(session, url, prompt, answer, 4, PLAN.deadline_s, mode, 0.0)
    finally:
        await srv.close()
    assert record.outcome == outcome, record
    assert record.kind == prompt.path + ("" if mode == "plain" else " stream")


def test_prompts_are_seeded_mixed_and_fit_the_context(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    items = prompts(tmp_path, 30, seed=0)
    assert items == prompts(tmp_path, 30, seed=0) != prompts(tmp_path, 30, seed=1)
    chats = [p for p in items if p.chat]
    assert len(chats) == 15 and all(p.path == "/v1/chat/completions" and not p.tokens for p in chats)
    completions = [p for p in items if not p.chat]
    assert all(
        p.path == "/v1/completions" and min(p.tokens) >= 10 and max(p.tokens) < 990 for p in completions
    )
    assert {len(p.tokens) <= 120 for p in completions} == {True, False}  # short (D alone) and long (P->D)
    assert max(len(p.tokens) for p in completions) <= 800
    assert max(len(p.message.split()) for p in chats) <= 420 < 2 * max(len(p.message.split()) for p in chats)


def test_faults_that_do_not_apply_to_a_phase_are_refused(tmp_path: Path) -> None:
    assert "proxy_reset" in PHASE_FAULTS["vllm"] and "proxy_reset" not in PHASE_FAULTS["sglang"]
    plan = Plan(model=tmp_path, engine="sglang", prefills=1, decodes=1, faults={"proxy_reset": 1})
    with pytest.raises(ValueError, match="proxy_reset"):
        run(plan, tmp_path)  # refused before anything starts


def test_sglang_loads_are_summed_over_ranks_and_queues() -> None:
    """SGLang's /v1/loads shape (one entry per DP rank, the disaggregation section as a dict)."""
    loads = {
        "loads": [
            {
                "dp_rank": 0,
                "num_used_tokens": 30,
                "token_usage": 0.1,
                "num_running_reqs": 1,
                "num_waiting_reqs": 2,
                "disaggregation": {"mode": "prefill", "prefill_inflight_queue_reqs": 3},
            },
            {"dp_rank": 1, "num_used_tokens": 12, "num_running_reqs": 0, "num_total_tokens": 99},
        ]
    }
    assert _loads(loads) == (42, 6)
    assert _loads({"loads": [{"dp_rank": 0, "num_used_tokens": 0, "disaggregation": None}]}) == (0, 0)


def test_the_timeline_is_seeded_ordered_and_inside_the_load() -> None:
    faults = dict.fromkeys(FAULT_KINDS, 3)
    events = timeline(1000, faults, seed=0)
    assert events == timeline(1000, faults, seed=0) and events == sorted(events)
    assert len(events) == 3 * (len(FAULT_KINDS) - 1)  # client disconnects are drawn per request instead
    assert all(50 <= at <= 850 for at, _ in events)
    assert timeline(1000, faults, seed=1) != events


def test_recovery_is_the_first_right_answer_started_after_the_fault() -> None:
    records = [
        Record(0.0, 1.0, "ok"),  # started before the fault: does not count
        Record(2.0, 3.0, "failed_clean"),
        Record(2.5, 6.0, "ok"),
        Record(3.0, 4.0, "ok"),
    ]
    assert recovery(records, [(1.5, "kill_prefill")]) == {"kill_prefill": [2.5, 2.5]}
    assert recovery(records, [(5.0, "garbage")]) == {"garbage": None}  # no request started after it


class _Server:
    """Stands in for a ManagedServer toward the injector: records what was done to it, and when."""

    def __init__(self, name: str, restart_s: float = 0.0) -> None:
        self.name, self.restart_s = name, restart_s
        self.health_url = "http://127.0.0.1:9/health"  # nothing listens: its counters read as absent
        self.events: list[tuple[str, float]] = []

    def _note(self, what: str) -> None:
        self.events.append((what, time.monotonic()))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self._note(signal.Signals(sig).name)

    def stop(self, grace_s: float = 10.0) -> None:
        self._note("stop")

    def start(self) -> None:
        self._note("start")

    def wait_healthy(self, timeout_s: float) -> None:
        time.sleep(self.restart_s)  # a restart that takes a while
        self._note("healthy")

    def at(self, what: str, n: int = 0) -> float:
        return [t for w, t in self.events if w == what][n]


async def test_faults_overlap_but_never_strike_a_server_that_is_down() -> None:
    """A P restarting does not hold back a stop (it strikes D meanwhile); a second P kill waits until P is back."""
    p, d, router = _Server("p", restart_s=0.5), _Server("d"), _Server("router")
    cluster = Cluster("vllm", [p], [d], router, [9])  # type: ignore[list-item, arg-type]
    injector = Injector(cluster, seed=0, t0=time.monotonic())
    first = asyncio.create_task(injector.strike("kill_prefill"))
    await asyncio.sleep(0.1)  # let the first kill take P (a test's ordering, not a wait for a result)
    await asyncio.gather(first, injector.strike("stop_short"), injector.strike("kill_prefill"))
    assert not injector.errors, injector.errors
    assert [w for w, _ in d.events] == ["SIGSTOP", "SIGCONT"]  # P was down: the stop took D
    assert d.at("SIGSTOP") < p.at("healthy")  # while P restarted
    assert p.at("SIGKILL", 1) >= p.at("healthy", 0)  # the second kill waited for P to be back
    assert len(injector.restarts["kill_prefill"]) == 2 and not injector.busy
    assert [kind for _, kind in injector.struck] == ["kill_prefill", "stop_short", "kill_prefill"]
    # each fault's window, from the strike to its target back up, for attributing failures (chaos_causes)
    assert sorted((w.kind, w.target, w.role) for w in injector.windows) == [
        ("kill_prefill", "p", "prefill"),
        ("kill_prefill", "p", "prefill"),
        ("stop_short", "d", "decode"),
    ]
    assert all(w.end - w.start >= 0.4 for w in injector.windows if w.kind == "kill_prefill")  # the restart


async def test_a_kill_or_stop_never_takes_down_the_last_server_of_a_role_up() -> None:
    """With two P and two D, a second P kill waits until the first killed P is back, and a stop (any engine)
    waits while a D restarts when only D are left to stop: one of each role stays up throughout."""
    p0, p1 = _Server("p0", restart_s=0.4), _Server("p1", restart_s=0.4)
    router = _Server("router")
    cluster = Cluster("vllm", [p0, p1], [], router, [9, 9])  # type: ignore[list-item, arg-type]
    injector = Injector(cluster, seed=0, t0=time.monotonic())
    await asyncio.gather(injector.strike("kill_prefill"), injector.strike("kill_prefill"))
    (_, first), (t2, _) = sorted((t, s.name) for s in (p0, p1) for w, t in s.events if w == "SIGKILL")
    assert t2 >= {p0.name: p0, p1.name: p1}[first].at("healthy")  # (the same P again, or the other)

    d0, d1 = _Server("d0", restart_s=0.4), _Server("d1", restart_s=0.4)
    cluster = Cluster("vllm", [], [d0, d1], router, [])  # type: ignore[list-item, arg-type]
    injector = Injector(cluster, seed=0, t0=time.monotonic())
    await asyncio.gather(injector.strike("kill_decode"), injector.strike("stop_short"))
    (killed,) = [d for d in (d0, d1) if "SIGKILL" in dict(d.events)]
    (stopped,) = [d for d in (d0, d1) if "SIGSTOP" in dict(d.events)]
    assert stopped.at("SIGSTOP") >= killed.at("healthy")
    assert not injector.errors and not injector.busy


async def test_proxy_faults_strike_every_open_control_and_data_connection_and_hold_no_server() -> None:
    """proxy_delay, proxy_stall and proxy_reset act on the connections open through every proxy (a P's side
    channel, a D's data listener) at the moment they strike, and are counted by how many they found."""
    target = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = target.sockets[0].getsockname()[1]
    p, d, router = _Server("p"), _Server("d"), _Server("router")
    control, data = FaultProxy(("127.0.0.1", port)), FaultProxy(("127.0.0.1", port))
    cluster = Cluster("vllm", [p], [d], router, [9], [control], [data])  # type: ignore[list-item, arg-type]
    assert list(cluster.all_proxies()) == ["control-p0", "data-d0"]
    injector = Injector(cluster, seed=0, t0=time.monotonic())
    writers = []
    try:
        for proxy in (control, data):
            proxy.start()
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"up")
            assert await reader.readexactly(2) == b"up"  # relayed: the connection is open through it
            writers.append(writer)
        for kind in ("proxy_delay", "proxy_stall", "proxy_reset"):
            await injector.strike(kind)
    finally:
        for writer in writers:
            writer.close()
        for proxy in (control, data):
            proxy.stop()
        target.close()
    assert not injector.errors, injector.errors
    assert injector.proxy_hits == {"proxy_delay": 2, "proxy_stall": 2, "proxy_reset": 2}
    assert control.injected == data.injected == {"delay": 1, "stall": 1, "reset": 1}
    assert [k for _, k in injector.struck] == ["proxy_delay", "proxy_stall", "proxy_reset"]
    assert not injector.busy and not p.events and not d.events  # no server was held or touched


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def test_a_failed_request_holds_its_slot_for_the_backoff() -> None:
    """The load's client backs off after an error: four failures on one slot take at least 3 back-offs."""
    srv = TestServer(_server(text=WANT, status=503))
    await srv.start_server()
    url = str(srv.make_url("")).rstrip("/")
    answers = [Answer(tuple(WANT), _text(WANT))]

    async def nothing(kind: str) -> None:
        raise AssertionError(f"no fault was planned, {kind} struck")

    try:
        began = time.monotonic()
        records = await load(
            url,
            [COMPLETION],
            answers,
            requests=4,
            concurrency=1,
            faults={},
            max_tokens=4,
            deadline_s=2.0,
            backoff_s=0.3,
            seed=0,
            strike=nothing,
            t0=began,
        )
    finally:
        await srv.close()
    assert [r.outcome for r in records] == ["failed_clean"] * 4
    assert all(b.start >= a.end + 0.3 for a, b in itertools.pairwise(records))


def test_each_failure_is_attributed_to_a_cause_with_its_faults_and_survivors() -> None:
    """A drop while the router was down is the router's death; the same drop with it up, an error message of
    the router's, and the faults overlapping each request, with whether a P, a D and the router were up."""
    windows = [
        Window(10.0, 11.0, "router_restart", "router", "router"),
        Window(20.0, 60.0, "kill_decode", "d0", "decode"),
        Window(30.0, 36.0, "proxy_stall", "", "links"),
    ]
    drop = "ServerDisconnectedError('Server disconnected')"
    records = [
        Record(9.0, 10.5, "failed_clean", drop, "/v1/completions"),
        Record(25.0, 26.0, "failed_clean", drop, "/v1/completions"),
        Record(
            29.0,
            31.0,
            "failed_clean",
            "stream error: ... could not be resumed: x",
            "/v1/completions stream",
            3,
        ),
        Record(
            40.0, 41.0, "failed_clean", "HTTP 503: no healthy decode worker is available", "/v1/completions"
        ),
        Record(40.0, 41.0, "ok", "", "/v1/completions"),
    ]
    causes = attribute(records, windows, {"prefill": 2, "decode": 2, "router": 1})
    assert causes["router_died"]["n"] == 1 and causes["router_died"]["survivor_up"] == 0
    assert causes["router_died"]["faults"] == {"router_restart": 1}
    assert causes["connection_lost"] | {"examples": []} == {
        "n": 1,
        "survivor_up": 1,  # d1 was up: a survivor could have continued
        "streamed_tokens": 0,
        "faults": {"kill_decode": 1},
        "examples": [],
    }
    assert causes["resume_failed"]["streamed_tokens"] == 1
    assert causes["resume_failed"]["faults"] == {"kill_decode": 1, "proxy_stall": 1}
    assert causes["no_decode_worker"]["survivor_up"] == 1
    assert (
        roles_down(45.0, windows, {"decode": 1}) == ["decode"]
        and roles_down(45.0, windows, {"decode": 2}) == []
    )
    assert (
        cause_of("HTTP 502: upstream workers failed (connect) after 3 attempts")
        == "attempts_exhausted_connect"
    )
    assert cause_of("stream error: ... the stream broke inside a character (1 ...)") == (
        "resume_refused_partial_character"
    )


def test_the_routers_log_counts_resumed_streams(tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    log.write_text(
        "W router.proxy: resuming a broken stream on http://d1 after 4 tokens: x\n"
        "W router.proxy: resuming a broken stream on http://d1 after 2 tokens"
        " (chat, token-exact as a completion): x\n"
        "W router.proxy: not resuming a broken stream after 2 tokens: y\n"
        "W router.proxy: attempt 1 failed: z\n"
    )
    assert router_resumes(log) == {
        "resumed": 2,
        "resumed_chats_token_exact": 1,
        "resumed_chats_from_text": 0,
        "not_resumed": 1,
        "attempts_failed": 1,
    }
    assert router_resumes(tmp_path / "none") == {}
