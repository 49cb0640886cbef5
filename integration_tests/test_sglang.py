"""The SGLang transfer backend ``pd`` on real SGLang CPU servers (tiny model), driven like a PD router.

First an aggregated SGLang server answers the prompts alone (the reference), then a prefill server (P) and
a decode server (D) with ``--disaggregation-transfer-backend pd`` replace it (never more than two SGLang
servers at once). Checks: identical greedy output, also for a prompt P prefills in several chunks and
through SGLang's own router (``sglang-router``) and pd-router; the transfer metrics on SGLang's /metrics
(P's bytes sent = D's bytes received = the prompt's KV); P pushes each layer's pages as its forward pass writes
them (per-layer push counters; its cached prefix before the forward); negative controls (P sends its first
page's KV into every page of one room: D's output changes after the first token; P drops one layer's pushes:
the transfer fails); and the failure paths end within their timeouts and free their memory. "Memory freed" is SGLang's own accounting: servers run with
``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1``, so a leaked page or request slot crashes the scheduler at
its next idle check; the tests wait until the server is idle with empty queues, then require it to be alive,
leak-free in its log, and still serving.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integration_tests.sglang_checks import (
    CACHED_PUSHES,
    CHUNK_TOKENS,
    LONG_PROMPT,
    MAX_NEW_TOKENS,
    NUM_LAYERS,
    SLO_PROMPT,
    TPOT_PROMPT,
    TPOT_TARGET_MS,
    Aggregated,
    answer_with_target,
    assert_drained,
    assert_slo_chunks,
    assert_tpot_limited,
    bootstrap,
    check_transferred,
    decode_transfer_queue,
    fresh_pushes,
)
from integration_tests.sglang_client import (
    Reply,
    body,
    generate,
    generate_pd,
    new_room,
    post,
    stream_then_disconnect,
)
from pd_disagg.engines import base_url, router_server, sglang_router, sglang_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port, running
from tests.polling import wait_until

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Request:\n    def __init__(self",
]
# Another several-chunk prompt, sent to P only by the layer-wise test: its first request finds no cached prefix.
LAYER_PROMPT = "".join(f"item_{i} = table[{i}] + offset({i * 3})\n" for i in range(1, 16))
LOOSE_TARGET_MS = 100000  # the aggregated server's ITL target: no chunk smaller than SGLang's own
CHUNK = ("--chunked-prefill-size", str(CHUNK_TOKENS))
METRICS = ("--enable-metrics",)
WRONG_KV_ROOM = 4242424242
SKIP_LAYER_ROOM = 4343434343
BOOTSTRAP_TIMEOUT_S = 10  # P gives up on a decode partner that never comes
WAITING_TIMEOUT_S = 15  # D gives up on KV that never comes
HEARTBEAT_TIMEOUT_S = 3.0  # a dead peer is noticed this fast
SLACK_S = 15  # scheduling noise on a shared 2-core machine
COMMON_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "PD_SGLANG_HEARTBEAT_INTERVAL_S": "0.5",
    "PD_SGLANG_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
    "PD_SGLANG_LEASE_S": "20",
    "PD_SGLANG_TRANSPORT": "tcp",
}


@pytest.fixture(scope="module")
def aggregated(tiny_model: Path, log_dir: Path) -> Aggregated:
    """An aggregated SGLang server (stopped before the P/D pair starts) running scheduler_plugins' SLO
    scheduler with a target so loose that every chunk is SGLang's own (``CHUNK_TOKENS``): the reference
    answers are stock SGLang's (the P/D tests compare stock P/D servers with them). Last, one request brings
    its own 1 ms target while another streams, so the scheduler cuts its prefill into small chunks (16
    tokens, the minimum, or a little more: ``lost_target_slack``; a prefill with no decode beside it would
    not be chunked); then one more beside a stream with a
    TPOT target."""
    server = sglang_server(
        tiny_model,
        log_dir=log_dir,
        name="sglang-agg",
        extra_args=(*CHUNK, "--enable-mixed-chunk"),
        env={
            "PD_SGLANG_SCHEDULER": "slo",
            "PD_SCHED_ITL_TARGET_MS": str(LOOSE_TARGET_MS),
            "PD_SCHED_LOG_INTERVAL_S": "0",
        },
    )
    with running(server, timeout_s=420):
        replies = {
            p: generate(base_url(server), p, MAX_NEW_TOKENS) for p in [*PROMPTS, LONG_PROMPT, LAYER_PROMPT]
        }
        slo_reply, before, during = answer_with_target(
            server, SLO_PROMPT, MAX_NEW_TOKENS, {"itl_target_ms": 1}
        )
        _, _, tpot_log = answer_with_target(
            server, TPOT_PROMPT, MAX_NEW_TOKENS, {}, companion_targets={"tpot_target_ms": TPOT_TARGET_MS}
        )
    for prompt, reply in replies.items():
        assert reply.ok and len(reply.output_ids) == MAX_NEW_TOKENS, (prompt, reply)
    return Aggregated(replies, slo_reply, before, during, tpot_log)


@pytest.fixture(scope="module")
def reference(aggregated: Aggregated) -> dict[str, Reply]:
    """Greedy answers of the aggregated server (SGLang's own chunk sizes)."""
    return aggregated.replies


@pytest.fixture(scope="module")
def pd_pair(
    reference, tiny_model: Path, log_dir: Path, start_servers
) -> tuple[ManagedServer, ManagedServer, int]:
    """P (core 0) and D (core 1) with the pd backend; returns ``(P, D, bootstrap_port)``."""
    bootstrap_port = free_port()
    prefill = sglang_server(
        tiny_model,
        log_dir=log_dir,
        name="sglang-prefill",
        cpu_core=0,
        disaggregation_mode="prefill",
        bootstrap_port=bootstrap_port,
        extra_args=(*CHUNK, *METRICS),
        env={
            **COMMON_ENV,
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S),
            "PD_SGLANG_FAULT_WRONG_KV_ROOMS": str(WRONG_KV_ROOM),
            "PD_SGLANG_FAULT_SKIP_LAYER_ROOMS": str(SKIP_LAYER_ROOM),
        },
    )
    decode = sglang_server(
        tiny_model,
        log_dir=log_dir,
        name="sglang-decode",
        cpu_core=1,
        disaggregation_mode="decode",
        extra_args=METRICS,
        env={
            **COMMON_ENV,
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S),
            "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
            "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
            # SGLang's default, explicit because the failure tests rely on it: hold the pages of a failed or
            # aborted transfer until the backend says P can no longer write them.
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1",
        },
    )
    start_servers(prefill, decode)
    return prefill, decode, bootstrap_port


def test_disaggregated_output_equals_aggregated(pd_pair, reference):
    prefill, decode, port = pd_pair
    for prompt in [*PROMPTS, LONG_PROMPT]:
        p, d = generate_pd(base_url(prefill), base_url(decode), bootstrap(port), prompt, MAX_NEW_TOKENS)
        assert p.ok, p
        assert d.ok, d
        assert d.output_ids == reference[prompt].output_ids, (prompt, d.body, reference[prompt].body)
        assert d.body["text"] == reference[prompt].body["text"]
    assert "(recv) done" in decode.log_path.read_text(errors="replace")
    assert_drained(prefill)
    assert_drained(decode)


def test_slo_scheduler_sizes_sglang_chunks_and_keeps_greedy_tokens(pd_pair, aggregated):
    """scheduler_plugins.sglang on the aggregated server (hooked through SGLang's HookRegistry): at the loose
    server target it chose SGLang's own chunk size; for the request with a 1 ms target, sent while another
    request streamed, it chose small chunks (the 16-token minimum, or more where a step costs little more)
    at every step, and SGLang ran exactly those chunks (its own "Prefill batch" log lines).
    The answer equals the stock P/D pair's (no scheduler plugin) for the same prompt."""
    prefill, decode, port = pd_pair
    slo = aggregated.slo_reply
    assert_slo_chunks(aggregated, LOOSE_TARGET_MS)
    p, d = generate_pd(base_url(prefill), base_url(decode), bootstrap(port), SLO_PROMPT, MAX_NEW_TOKENS)
    assert p.ok and d.ok, (p, d)
    assert len(d.output_ids) == MAX_NEW_TOKENS and slo.output_ids == d.output_ids, (slo.body, d.body)
    assert_drained(prefill)
    assert_drained(decode)


def test_slo_scheduler_holds_a_tpot_account_on_sglang(aggregated):
    """scheduler_plugins.sglang keeps a TPOT account for a stream with ``tpot_target_ms`` in its
    ``custom_params``: a prompt sent beside it is planned within what the stream can still afford, not the
    server's loose ITL limit."""
    assert_tpot_limited(aggregated, LOOSE_TARGET_MS)


def test_layer_by_layer_push(pd_pair, reference):
    """P pushes each layer's pages from the hook after the layer's KV write, once per forward pass (chunk) and
    layer; only the page of the prompt's last token goes after the forward (SGLang may swap it for a cached
    copy). Asked again, P's cached prefix goes before the forward. Both times D answers as the aggregated
    server from exactly the prompt's KV bytes, with no failure."""
    prefill, decode, port = pd_pair
    tokens, fresh = check_transferred(prefill, decode, port, reference, LAYER_PROMPT)
    assert tokens > 3 * CHUNK_TOKENS
    assert fresh == fresh_pushes(tokens), fresh
    _, cached = check_transferred(prefill, decode, port, reference, LAYER_PROMPT)
    assert cached == CACHED_PUSHES, cached
    assert "KV is pushed layer by layer" in prefill.log_path.read_text(errors="replace")


def test_negative_control_skipped_layer_fails_the_transfer(pd_pair, reference):
    """P never pushes the last layer of one room (fault injection): D's pages of that layer are never written,
    P's Done check finds the hole and the request fails on D, well before D's waiting timeout."""
    prefill, decode, port = pd_pair
    _, d = generate_pd(
        base_url(prefill),
        base_url(decode),
        bootstrap(port),
        LONG_PROMPT,
        MAX_NEW_TOKENS,
        room=SKIP_LAYER_ROOM,
    )
    assert not d.ok, d
    assert d.seconds < WAITING_TIMEOUT_S, d
    assert f"layer {NUM_LAYERS - 1} is missing tokens" in prefill.log_path.read_text(errors="replace")
    assert_drained(decode)
    assert_drained(prefill)


def test_transfer_metrics_on_sglang_metrics_endpoint(pd_pair, reference):
    """The backend's metrics (``pd_connector.metrics``' names, ``sglang:`` prefix) on SGLang's own /metrics."""
    prefill, decode, port = pd_pair
    check_transferred(prefill, decode, port, reference)


def test_negative_control_wrong_kv_changes_output(pd_pair, reference):
    """P sends its first page's KV into every page of the room (complete, but wrong: a transfer with holes
    would fail instead): D gets the first token but decodes from KV that is not its prompt's."""
    prefill, decode, port = pd_pair
    prompt = LONG_PROMPT
    p, d = generate_pd(
        base_url(prefill), base_url(decode), bootstrap(port), prompt, MAX_NEW_TOKENS, room=WRONG_KV_ROOM
    )
    assert p.ok and d.ok, (p, d)
    expected = reference[prompt].output_ids
    assert d.output_ids[0] == expected[0]  # the first token comes from P's metadata, not from the KV
    assert d.output_ids != expected, "output did not depend on the transferred KV"
    assert_drained(decode)


def _assert_alone_times_out(server: ManagedServer, port: int, prompt: str, timeout_s: float) -> None:
    """A request sent to one side of the pair only fails, within ``timeout_s`` (plus slack), not later."""
    reply = post(
        base_url(server) + "/generate",
        body(prompt, 4, bootstrap(port), new_room()),
        timeout_s=timeout_s + 60,
    )
    assert not reply.ok, reply
    assert reply.seconds < timeout_s + SLACK_S, reply


def test_prefill_without_decode_partner_times_out(pd_pair):
    prefill, _decode, port = pd_pair
    _assert_alone_times_out(prefill, port, PROMPTS[0], BOOTSTRAP_TIMEOUT_S)
    assert_drained(prefill)


def test_decode_without_prefill_times_out(pd_pair):
    """D bootstraps with P and asks for KV that P never computes: D gives up at its waiting timeout."""
    prefill, decode, port = pd_pair
    _assert_alone_times_out(decode, port, PROMPTS[1], WAITING_TIMEOUT_S)
    assert_drained(decode)
    assert_drained(prefill)


def test_client_abort_frees_memory(pd_pair, reference):
    """The client disconnects from D mid-stream: D aborts the request and frees its pages; both go on serving."""
    prefill, decode, port = pd_pair
    payload = body(PROMPTS[2], 400, bootstrap(port), new_room())
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        p = pool.submit(post, base_url(prefill) + "/generate", payload, 120)
        seen = stream_then_disconnect(base_url(decode), payload, chunks=2, timeout_s=120)
        assert p.result().ok
    assert seen == 2
    assert_drained(decode)
    assert_drained(prefill)
    _, d = generate_pd(base_url(prefill), base_url(decode), bootstrap(port), PROMPTS[0], MAX_NEW_TOKENS)
    assert d.output_ids == reference[PROMPTS[0]].output_ids


def test_through_pd_router_output_equals_aggregated(pd_pair, reference, tiny_model, log_dir, tmp_path):
    """pd-router (flow ``sglang-bootstrap``) fronting the SGLang pair: OpenAI completions in, both legs out
    with the bootstrap fields; the text equals the aggregated server's."""
    prefill, decode, port = pd_pair
    config = write_router_config(
        tmp_path / "router.toml",
        flow="sglang-bootstrap",
        sections={
            "model": {"path": str(tiny_model)},
            # SGLang's D cannot prefill alone: every prompt goes P->D.
            "policy": {"threshold_tokens": 0},
            # SGLang's /health generates a token and takes >= 1 s.
            "health": {"interval_s": 0.5, "timeout_s": 5},
        },
        prefill=[{"url": base_url(prefill), "engine": "sglang", "bootstrap_port": port}],
        decode=[{"url": base_url(decode), "engine": "sglang"}],
    )
    router = router_server(config, log_dir=log_dir, port=free_port(), name="pd-router-sglang")
    with running(router, timeout_s=60):
        for prompt in (PROMPTS[0], LONG_PROMPT):
            payload = {
                "model": str(tiny_model),
                "prompt": prompt,
                "max_tokens": MAX_NEW_TOKENS,
                "temperature": 0,
            }
            request = urllib.request.Request(
                f"{base_url(router)}/v1/completions",
                json.dumps(payload).encode(),
                {"content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as resp:
                assert resp.headers["X-PD-Route"] == "disagg"
                answer = json.load(resp)
            assert answer["choices"][0]["text"] == reference[prompt].body["text"], prompt
    assert_drained(prefill)
    assert_drained(decode)


def test_through_sglang_router_output_equals_aggregated(pd_pair, reference, log_dir):
    """SGLang's own PD router (sglang-router 0.3.2) in front of the pd backend: it adds the bootstrap
    fields and sends both legs; the answer equals the aggregated server's."""
    prefill, decode, port = pd_pair
    router = sglang_router([(base_url(prefill), port)], [base_url(decode)], log_dir=log_dir)
    with running(router, timeout_s=60):
        # The router is healthy before it has checked and added its workers (in the background): wait for
        # its first answer that is not "no worker available".
        answers = []

        def answered() -> bool:
            answers.append(generate(base_url(router), PROMPTS[0], MAX_NEW_TOKENS))
            return answers[-1].status != 503

        wait_until(answered, 90, "sglang-router's first answer that is not 503")
        first = answers[-1]
        assert first.ok, first
        assert first.output_ids == reference[PROMPTS[0]].output_ids, first.body
        for prompt in (PROMPTS[1], LONG_PROMPT):
            reply = generate(base_url(router), prompt, MAX_NEW_TOKENS)
            assert reply.ok, reply
            assert reply.output_ids == reference[prompt].output_ids, (prompt, reply.body)
    assert_drained(prefill)
    assert_drained(decode)


def test_prefill_death_fails_decode_within_heartbeat_timeout(pd_pair):
    """Runs last of the module pair's tests: P is killed while D waits for its KV; D fails the request long
    before its waiting timeout (heartbeats), frees the pages and stays healthy."""
    prefill, decode, port = pd_pair
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        d = pool.submit(
            post, base_url(decode) + "/generate", body(PROMPTS[1], 4, bootstrap(port), new_room()), 120
        )
        # D bootstrapped with P and sent its destinations: the request is in D's transfer queue.
        wait_until(lambda: decode_transfer_queue(decode) == 1, 30, "the request in D's transfer queue")
        killed_at = time.monotonic()
        prefill.kill()
        reply = d.result()
    waited = time.monotonic() - killed_at
    assert not reply.ok, reply
    assert waited < WAITING_TIMEOUT_S, f"D noticed P's death only after {waited:.1f}s"
    assert_drained(decode)


#: The other data planes, each on a P/D pair of its own after the module pair: ``lane -> (transport, D's extra
#: environment)``. P runs UCX with every transport it has; D's ``UCX_TLS`` picks the lane, so the two UCX lanes
#: share one P and only D restarts between them.
LANES = {
    "ucx-sm": ("ucx", {"UCX_TLS": "sm,self"}),
    "ucx-tcp": ("ucx", {"UCX_TLS": "tcp,self"}),
    "cma": ("cma", {}),
}
#: Each lane costs one more SGLang start (~2 min on 2 cores), so CI runs one; ``PD_TEST_SGLANG_LANES=ucx-sm,
#: ucx-tcp,cma`` runs them all (docs/sglang.md says when they last passed). An unknown name fails collection.
RUN_LANES = os.environ.get("PD_TEST_SGLANG_LANES", "ucx-sm").split(",")
if unknown := set(RUN_LANES) - set(LANES):
    raise ValueError(f"PD_TEST_SGLANG_LANES: unknown lanes {sorted(unknown)}, known: {sorted(LANES)}")


@pytest.fixture(scope="module")
def lane_pairs(
    pd_pair, tiny_model: Path, log_dir: Path
) -> Iterator[Callable[[str], tuple[ManagedServer, ...]]]:
    """``pair(lane)`` -> ``(P, D, bootstrap_port)`` serving over ``LANES[lane]``; stops the module pair first
    (never more than two SGLang servers), keeps P when the next lane has the same transport."""
    for server in pd_pair[:2]:
        server.stop()
    live: dict[str, Any] = {}

    def stop(*roles: str) -> None:
        for role in roles:
            server = live.pop(role, None)
            if server is not None:
                server.stop()

    def pair(lane: str) -> tuple[ManagedServer, ...]:
        transport, decode_env = LANES[lane]
        env = {**COMMON_ENV, "PD_SGLANG_TRANSPORT": transport}
        stop("decode")
        if live.get("transport") != transport:
            stop("prefill")
            live["transport"] = transport
            live["port"] = free_port()
            live["prefill"] = sglang_server(
                tiny_model,
                log_dir=log_dir,
                name=f"sglang-prefill-{transport}",
                cpu_core=0,
                disaggregation_mode="prefill",
                bootstrap_port=live["port"],
                extra_args=(*CHUNK, *METRICS),
                env=env,
            )
        live["decode"] = sglang_server(
            tiny_model,
            log_dir=log_dir,
            name=f"sglang-decode-{lane}",
            cpu_core=1,
            disaggregation_mode="decode",
            extra_args=METRICS,
            env={**env, **decode_env},
        )
        prefill, decode = live["prefill"], live["decode"]
        for server in (prefill, decode):
            if not server.alive():
                server.start()
        for server in (prefill, decode):
            server.wait_healthy(420)
        return prefill, decode, live["port"]

    try:
        yield pair
    finally:
        stop("decode", "prefill")


@pytest.mark.parametrize("lane", RUN_LANES)
def test_data_plane_under_sglang(lane_pairs, lane, reference):
    """UCX (shared memory, tcp) and cma move SGLang's KV as tcp does, layer by layer: output as aggregated,
    exact bytes, each layer pushed during each forward pass (on a P that served the prompt before, its cached
    prefix before the forward: the two ucx lanes share one P)."""
    prefill, decode, port = lane_pairs(lane)
    transport = LANES[lane][0]
    for server in (prefill, decode):
        assert f"pd_connector data plane: {transport}" in server.log_path.read_text(errors="replace")
    tokens, pushes = check_transferred(prefill, decode, port, reference)
    assert pushes in (fresh_pushes(tokens), CACHED_PUSHES), pushes
