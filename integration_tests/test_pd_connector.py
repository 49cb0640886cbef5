"""PDConnector on real vLLM CPU servers (tiny model, float32): P pushes KV layer by layer, D decodes.

One P and one D run at a time (P pinned to core 0, D to core 1) and are shared by the module's tests; a test
that needs D without prefix caching or with another ``kv_load_failure_policy``, or that killed a server,
restarts only that one through ``Cluster``. Server starts dominate the wall time, so the tests that kill
servers come last, and the tests that need another D follow the test that killed D. Requests follow
docs/wire-contract.md through ``pd_disagg.pd_client`` (both legs sent concurrently, or vLLM's standard P-then-D flow). The colocated reference is a plain request to P, which runs
without prefix caching, so every reference is computed from scratch.
"""

from __future__ import annotations

import http.client
import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd_disagg import pd_client
from pd_disagg.engines import base_url, router_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port

MAX_MODEL_LEN = 1024
MAX_TOKENS = 12
CHUNK = 64  # P's max-num-batched-tokens: every prompt above it is prefilled in several chunks
# Generous for a loaded 2-core machine: P (64-token chunks) may queue 16 prompts for several seconds.
LEASE_S = 12.0
D_LOAD_TIMEOUT_S = 20.0
VOCAB = 1900  # token ids drawn below the tiny model's vocabulary size
FailurePolicy = Literal["recompute", "fail"]  # D's kv_load_failure_policy


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


# 1 token, around one block (32), several blocks, several chunks, and near max-model-len.
PROMPT_LENGTHS = [1, 31, 32, 33, 100, 257, MAX_MODEL_LEN - MAX_TOKENS - 1]


def body(prompt: list[int], max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }


def decode_params(transfer_id: str, prefill_addr: str) -> dict[str, Any]:
    """D's kv_transfer_params in our push flow (docs/wire-contract.md)."""
    return {"pd_transfer_id": transfer_id, "pd_role": "decode", "pd_prefill_addr": prefill_addr}


def token_ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def metric(url: str, name: str) -> float:
    """Sum of all samples called ``name`` on a server's Prometheus endpoint (0 if absent)."""
    with pd_client.urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate``; return the seconds it took, fail the test with ``what`` on timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def blocks_idle(url: str) -> bool:
    return (
        metric(url, "vllm:kv_cache_usage_perc") == 0
        and metric(url, "vllm:num_requests_running") == 0
        and metric(url, "vllm:num_requests_waiting") == 0
    )


class Cluster:
    """The module's P and D servers; restarts one of them when it died or D needs another configuration."""

    def __init__(
        self,
        start: Callable[..., list[ManagedServer]],
        model: Path,
        log_dir: Path,
        transport: str = "tcp",
    ) -> None:
        self._start = start
        self.model = model
        self._log_dir = log_dir
        self.transport = transport  # PDConnector's data plane on both servers
        self.side_channel_port = free_port()
        self.prefill: ManagedServer | None = None
        self.decode: ManagedServer | None = None
        self.decode_prefix_caching: bool | None = None
        self.decode_failure_policy: FailurePolicy | None = None
        self._references: dict[tuple[int, ...], list[int]] = {}

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.side_channel_port}"

    @property
    def p_url(self) -> str:
        assert self.prefill is not None
        return base_url(self.prefill)

    @property
    def d_url(self) -> str:
        assert self.decode is not None
        return base_url(self.decode)

    def _prefill_server(self) -> ManagedServer:
        return vllm_server(
            self.model,
            log_dir=self._log_dir,
            name=f"pd-prefill-{self.transport}",
            dtype="float32",
            cpu_core=0,
            max_model_len=MAX_MODEL_LEN,
            extra_args=[
                "--served-model-name",
                "tiny",
                "--max-num-batched-tokens",
                str(CHUNK),
                "--no-enable-prefix-caching",
            ],
            kv_transfer_config={
                "kv_connector": "PDConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {
                    "transport": self.transport,
                    "side_channel_port": self.side_channel_port,
                    "lease_s": LEASE_S,
                    "load_timeout_s": 20.0,
                    "test_allow_corruption": True,
                },
            },
        )

    def _decode_server(self, prefix_caching: bool, failure_policy: FailurePolicy) -> ManagedServer:
        return vllm_server(
            self.model,
            log_dir=self._log_dir,
            name=f"pd-decode-{self.transport}-{'cache' if prefix_caching else 'nocache'}-{failure_policy}",
            dtype="float32",
            cpu_core=1,
            max_model_len=MAX_MODEL_LEN,
            extra_args=["--served-model-name", "tiny"]
            + ([] if prefix_caching else ["--no-enable-prefix-caching"]),
            kv_transfer_config={
                "kv_connector": "PDConnector",
                "kv_role": "kv_consumer",
                "kv_load_failure_policy": failure_policy,
                "kv_connector_extra_config": {
                    "transport": self.transport,
                    "load_timeout_s": D_LOAD_TIMEOUT_S,
                },
            },
        )

    def stop(self) -> None:
        """Stop both servers (a later ``ensure`` starts them again)."""
        for server in (self.prefill, self.decode):
            if server is not None:
                server.stop()

    def ensure(
        self, *, prefix_caching: bool | None = None, failure_policy: FailurePolicy | None = None
    ) -> Cluster:
        """Start whatever is missing or dead (in parallel); restart D if its prefix caching or
        ``kv_load_failure_policy`` must change. Unnamed settings stay as last started (at first: prefix
        caching on, policy recompute)."""
        want_cache = self.decode_prefix_caching if prefix_caching is None else prefix_caching
        want_cache = True if want_cache is None else want_cache
        want_policy = failure_policy or self.decode_failure_policy or "recompute"
        to_start = []
        if self.prefill is None or not self.prefill.alive():
            if self.prefill is not None:
                self.prefill.stop()
            self.prefill = self._prefill_server()
            to_start.append(self.prefill)
        if (
            self.decode is None
            or not self.decode.alive()
            or (self.decode_prefix_caching, self.decode_failure_policy) != (want_cache, want_policy)
        ):
            if self.decode is not None:
                self.decode.stop()
            self.decode = self._decode_server(want_cache, want_policy)
            self.decode_prefix_caching, self.decode_failure_policy = want_cache, want_policy
            to_start.append(self.decode)
        if to_start:
            self._start(*to_start)
        return self

    def reference(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        """Colocated greedy output, memoised: a plain request to P, which never caches prefixes."""
        key = (*prompt, -max_tokens)
        if key not in self._references:
            self._references[key] = token_ids(
                pd_client.post_json(self.p_url + "/v1/completions", body(prompt, max_tokens))
            )
        return self._references[key]

    def disaggregated(
        self, prompt: list[int], max_tokens: int = MAX_TOKENS, corrupt: bool = False
    ) -> list[int]:
        answer, p_answer = pd_client.disaggregated(
            self.p_url,
            self.d_url,
            self.bootstrap,
            body(prompt, max_tokens),
            prefill_extra={"pd_test_corrupt": True} if corrupt else None,
        )
        assert isinstance(p_answer, dict), f"P leg failed: {p_answer!r}"
        return token_ids(answer)


@pytest.fixture(scope="module")
def cluster(start_servers, tiny_model: Path, log_dir: Path) -> Iterator[Cluster]:
    yield Cluster(start_servers, tiny_model, log_dir)


@pytest.fixture
def honest(cluster: Cluster) -> Cluster:
    """P and D running (D as configured last; prefix caching on at first start)."""
    return cluster.ensure()


def test_disaggregated_equals_colocated(honest: Cluster) -> None:
    """Every prompt size, chunked on P; the second round hits D's prefix cache and loads only the tail."""
    cluster = honest.ensure(prefix_caching=True)
    hits_before = metric(cluster.d_url, "vllm:prefix_cache_hits_total")
    for round_ in range(2):
        for n in PROMPT_LENGTHS:
            prompt = tokens(n, seed=n)
            assert cluster.disaggregated(prompt) == cluster.reference(prompt), f"{n} tokens, round {round_}"
    assert metric(cluster.d_url, "vllm:prefix_cache_hits_total") > hits_before, "round 2 must hit D's cache"
    assert (
        wait_until(lambda: blocks_idle(cluster.p_url) and blocks_idle(cluster.d_url), 15, "blocks freed") >= 0
    )


def test_vllm_standard_flow(honest: Cluster) -> None:
    """vLLM's own proxy flow: P first (max_tokens=1), then D with the kv_transfer_params P returned."""
    for n in (40, 300):
        prompt = tokens(n, seed=1000 + n)
        answer = pd_client.vllm_standard(honest.p_url, honest.d_url, body(prompt))
        assert token_ids(answer) == honest.reference(prompt)


ROUTER_THRESHOLD = 64  # prompts of at least this many tokens take the P->D path through pd-router


@pytest.fixture(scope="module")
def router(start_servers, cluster: Cluster, tmp_path_factory, log_dir: Path) -> str:
    """pd-router (a real process) in front of the module's P and D, in our push flow (docs/wire-contract.md)."""
    cluster.ensure(prefix_caching=True)
    config = write_router_config(
        tmp_path_factory.mktemp("pd-router") / "router.toml",
        flow="pd-push",
        sections={
            "model": {"path": str(cluster.model), "served_names": ["tiny"], "max_model_len": MAX_MODEL_LEN},
            "policy": {"threshold_tokens": ROUTER_THRESHOLD},
            "health": {"interval_s": 0.5},
        },
        prefill=[{"url": cluster.p_url, "bootstrap": cluster.bootstrap}],
        decode=[{"url": cluster.d_url}],
    )
    (server,) = start_servers(router_server(config, log_dir=log_dir, port=free_port(), name="pd-router"))
    return base_url(server)


def _through_router(router: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """POST a completion to pd-router; returns (the path it took, the JSON answer)."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(payload), {"content-type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert resp.status == 200, answer
        return resp.getheader("X-PD-Route") or "", answer
    finally:
        conn.close()


def test_router_sends_long_prompts_p_to_d_and_short_ones_to_d(honest: Cluster, router: str) -> None:
    """Through pd-router: long prompts are disaggregated (KV pushed by P's connector), short ones prefill on
    D; both give the colocated greedy tokens."""
    hits_before = metric(honest.d_url, "vllm:external_prefix_cache_hits_total")
    for n, path in ((ROUTER_THRESHOLD + 150, "disagg"), (ROUTER_THRESHOLD // 2, "local")):
        prompt = tokens(n, seed=5000 + n)
        route, answer = _through_router(router, body(prompt))
        assert route == path, f"{n} tokens went {route!r}"
        assert token_ids(answer) == honest.reference(prompt), f"{n} tokens via {route}"
    wait_until(
        lambda: metric(honest.d_url, "vllm:external_prefix_cache_hits_total") - hits_before >= 128,
        15,
        "D's external (transferred) prompt tokens in /metrics",
    )


def _stream_through_router(router: str, path: str, payload: dict[str, Any]) -> tuple[str, list[bytes]]:
    """Stream a request through pd-router; returns (the path it took, every SSE event up to [DONE])."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, json.dumps(payload), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events, buf = [], b""
        while not events or events[-1] != b"data: [DONE]":
            chunk = resp.read1(65536)
            assert chunk, f"stream ended without [DONE] after {len(events)} events"
            buf += chunk
            *done, buf = buf.split(b"\n\n")
            events.extend(done)
        return resp.getheader("X-PD-Route") or "", events
    finally:
        conn.close()


@pytest.mark.parametrize("n", [ROUTER_THRESHOLD + 326, ROUTER_THRESHOLD + 7])
def test_router_streams_disaggregated_completions(honest: Cluster, router: str, n: int) -> None:
    """A streamed long prompt through pd-router: P->D, the colocated tokens, a final chunk and [DONE].

    (A 390-token prompt once got no [DONE] here.) Tokens are not required to arrive one per event: vLLM's
    front end merges the deltas it has not sent yet, which happens on this two-core machine because vLLM's
    CPU workers spin-wait for about a second after each step and starve the front-end processes.
    """
    prompt = tokens(n, seed=6000 + n)
    route, events = _stream_through_router(router, "/v1/completions", body(prompt, stream=True))
    assert route == "disagg"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert streamed == honest.reference(prompt)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_router_streams_disaggregated_chat(honest: Cluster, router: str) -> None:
    """A streamed chat request long enough for P->D: the streamed deltas add up to the colocated (plain,
    unstreamed request to P) greedy text, and the stream ends with usage and [DONE], as vLLM's own does.

    How many events the text arrives in is vLLM's business, not the router's: its front end merges deltas it
    has not sent yet, which on this two-core machine happens whenever the CPU workers starve it (a CI run
    once got 12 tokens in 2 events). That the router relays each upstream event as it comes is tested
    against a paced upstream in tests/router/test_relay.py.
    """
    payload = {
        "model": "tiny",
        "messages": [{"role": "user", "content": " ".join(f"word{i}" for i in range(120))}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    colocated = pd_client.post_json(honest.p_url + "/v1/chat/completions", payload)
    route, events = _stream_through_router(
        router,
        "/v1/chat/completions",
        {**payload, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert route == "disagg"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert chunks[-1]["usage"]["prompt_tokens"] == colocated["usage"]["prompt_tokens"] >= ROUTER_THRESHOLD
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0].get("role") == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == colocated["choices"][0]["message"]["content"]
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"


def test_sixteen_concurrent_requests(honest: Cluster) -> None:
    prompts = [tokens(60 + 37 * i, seed=2000 + i) for i in range(16)]
    references = [honest.reference(p) for p in prompts]
    failures = metric(honest.d_url, "vllm:pd_connector_failures_total")
    received = metric(honest.d_url, "vllm:pd_connector_transfers_received_total")
    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(honest.disaggregated, prompts))
    assert outputs == references
    wait_until(
        lambda: metric(honest.d_url, "vllm:pd_connector_transfers_received_total") >= received + 16,
        15,
        "all 16 prompts loaded from P (none recomputed)",
    )
    assert metric(honest.d_url, "vllm:pd_connector_failures_total") == failures
    wait_until(lambda: blocks_idle(honest.p_url) and blocks_idle(honest.d_url), 15, "blocks freed")


def test_decode_metrics_show_external_transfer(honest: Cluster) -> None:
    """D counts the prompt as external (P2P) cache hits, and the connector's own byte counters agree."""
    d_hits = metric(honest.d_url, "vllm:external_prefix_cache_hits_total")
    failures = metric(honest.d_url, "vllm:pd_connector_failures_total")
    d_bytes = metric(honest.d_url, "vllm:pd_connector_bytes_received_total")
    p_bytes = metric(honest.p_url, "vllm:pd_connector_bytes_sent_total")
    prompt = tokens(500, seed=3000)
    assert honest.disaggregated(prompt) == honest.reference(prompt)

    def counted() -> bool:
        return (
            metric(honest.d_url, "vllm:external_prefix_cache_hits_total") - d_hits >= len(prompt) - 32
            and metric(honest.d_url, "vllm:pd_connector_bytes_received_total") > d_bytes
            and metric(honest.p_url, "vllm:pd_connector_bytes_sent_total") > p_bytes
        )

    wait_until(counted, 15, "external hits and transferred bytes in /metrics")
    # Tiny model, float32: 4 layers x 2 KV heads x (64 K + 64 V) x 4 B per token; whole blocks at least.
    received = metric(honest.d_url, "vllm:pd_connector_bytes_received_total") - d_bytes
    assert received >= (len(prompt) // 32) * 32 * 4 * 2 * 128 * 4
    assert metric(honest.d_url, "vllm:pd_connector_failures_total") == failures


def _abandon(url: str, path: str, payload: dict[str, Any], after_s: float) -> None:
    """Send a request and drop the connection after ``after_s`` (a client disconnect vLLM must abort)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps(payload), {"content-type": "application/json"})
    time.sleep(after_s)
    conn.close()


def test_corrupted_transfer_changes_output(honest: Cluster) -> None:
    """Negative control: P zeroes the KV it pushes (test-only flag) and D's output changes, so D really
    decodes from the transferred bytes. (D caches what it received: these prompts are used only here.)"""
    for n in (100, 257, 600):
        prompt = tokens(n, seed=9000 + n)
        assert honest.disaggregated(prompt, corrupt=True) != honest.reference(prompt), f"{n} tokens"


def test_random_aborts_release_all_blocks(honest: Cluster) -> None:
    """Client disconnects at random points on either or both legs: both servers return to no blocks used."""
    rng = random.Random(7)
    wait_until(lambda: blocks_idle(honest.p_url) and blocks_idle(honest.d_url), 15, "idle before aborts")

    def one(i: int) -> None:
        prompt = tokens(rng.randrange(200, 900), seed=4000 + i)
        transfer_id = uuid.uuid4().hex
        legs = rng.choice(["prefill", "decode", "both"])
        p_body = pd_client.prefill_body(body(prompt), {"pd_transfer_id": transfer_id, "pd_role": "prefill"})
        d_body = body(
            prompt,
            max_tokens=200,
            stream=True,
            kv_transfer_params=decode_params(transfer_id, honest.bootstrap),
        )
        delay = rng.uniform(0.0, 0.6)
        with ThreadPoolExecutor(2) as pool:
            if legs in ("prefill", "both"):
                p_done = pool.submit(_abandon, honest.p_url, "/v1/completions", p_body, delay)
            else:
                p_done = pool.submit(pd_client.post_json, honest.p_url + "/v1/completions", p_body)
            d_done = pool.submit(
                _abandon, honest.d_url, "/v1/completions", d_body, delay if legs != "prefill" else delay + 0.5
            )
            p_done.result()
            d_done.result()

    for i in range(8):
        one(i)
    # Aborted P legs free at once; a P whose D vanished waits at most the lease.
    wait_until(lambda: blocks_idle(honest.p_url), LEASE_S + 20, "P blocks back to baseline")
    wait_until(lambda: blocks_idle(honest.d_url), D_LOAD_TIMEOUT_S + 20, "D blocks back to baseline")
    prompt = tokens(150, seed=4999)
    assert honest.disaggregated(prompt) == honest.reference(prompt), "servers still serve correctly"


def test_lease_expiry_frees_prefill_blocks(honest: Cluster) -> None:
    """A prefill whose D never shows up holds its blocks only for the lease, then frees them."""
    expired = metric(honest.p_url, "vllm:pd_connector_expired_leases_total")
    prompt = tokens(400, seed=5000)
    answer = pd_client.post_json(
        honest.p_url + "/v1/completions",
        pd_client.prefill_body(body(prompt), {"pd_transfer_id": uuid.uuid4().hex, "pd_role": "prefill"}),
    )
    assert answer["kv_transfer_params"]["pd_prefill_addr"] == honest.bootstrap
    assert metric(honest.p_url, "vllm:kv_cache_usage_perc") > 0, "blocks held for the missing D"
    took = wait_until(lambda: blocks_idle(honest.p_url), LEASE_S + 15, "lease expiry")
    assert took >= LEASE_S - 1.5
    # Connector stats reach /metrics with the engine's next output: an idle engine needs one more request.
    honest.reference(tokens(3, seed=5001))
    wait_until(
        lambda: metric(honest.p_url, "vllm:pd_connector_expired_leases_total") >= expired + 1,
        10,
        "expired-lease counter",
    )


def test_decode_times_out_when_prefill_never_delivers(honest: Cluster) -> None:
    """D waits for a transfer P never heard of: after its load timeout (or P's lease on the orphaned
    destinations, whichever is shorter) it recomputes (policy recompute) and answers correctly."""
    honest.ensure(failure_policy="recompute")
    prompt = tokens(300, seed=7000)
    reference = honest.reference(prompt)
    failures = metric(honest.d_url, "vllm:pd_connector_failures_total")
    start = time.monotonic()
    answer = pd_client.post_json(
        honest.d_url + "/v1/completions",
        body(
            prompt,
            kv_transfer_params=decode_params(uuid.uuid4().hex, honest.bootstrap),
        ),
    )
    took = time.monotonic() - start
    assert token_ids(answer) == reference
    # Whichever ends first: D's load timeout, or P's lease on destinations it was never offered.
    assert min(D_LOAD_TIMEOUT_S, LEASE_S) - 0.5 <= took <= D_LOAD_TIMEOUT_S + 20
    wait_until(
        lambda: metric(honest.d_url, "vllm:pd_connector_failures_total") > failures, 10, "failure count"
    )


def test_killing_prefill_mid_transfer_makes_decode_recompute(honest: Cluster) -> None:
    cluster = honest.ensure(failure_policy="recompute")
    prompt = tokens(MAX_MODEL_LEN - MAX_TOKENS - 1, seed=8000)
    reference = cluster.reference(prompt)
    assert cluster.prefill is not None
    failures = metric(cluster.d_url, "vllm:pd_connector_failures_total")
    start = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            pd_client.disaggregated, cluster.p_url, cluster.d_url, cluster.bootstrap, body(prompt)
        )
        time.sleep(0.05)
        cluster.prefill.kill()
        answer, p_answer = pending.result(timeout=120)
    assert isinstance(p_answer, BaseException), "P was killed during its prefill"
    assert token_ids(answer) == reference
    assert time.monotonic() - start < D_LOAD_TIMEOUT_S + 30
    # With P gone for good, a new transfer fails at connect time and D recomputes at once.
    start = time.monotonic()
    answer, _ = pd_client.disaggregated(
        cluster.p_url, cluster.d_url, cluster.bootstrap, body(prompt), timeout_s=60
    )
    assert token_ids(answer) == reference
    assert time.monotonic() - start < D_LOAD_TIMEOUT_S + 10
    wait_until(lambda: blocks_idle(cluster.d_url), 15, "D blocks freed")
    assert metric(cluster.d_url, "vllm:pd_connector_failures_total") > failures


def test_restarted_prefill_serves_again(cluster: Cluster) -> None:
    """After P died (previous test) and came back on the same side-channel port, D reconnects to it."""
    cluster.ensure()
    prompt = tokens(300, seed=10000)
    received = metric(cluster.d_url, "vllm:pd_connector_bytes_received_total")
    assert cluster.disaggregated(prompt) == cluster.reference(prompt)
    wait_until(
        lambda: metric(cluster.d_url, "vllm:pd_connector_bytes_received_total") > received,
        15,
        "KV received from the restarted P",
    )


def test_killing_decode_mid_transfer_leaves_prefill_healthy(honest: Cluster) -> None:
    cluster = honest
    prompt = tokens(MAX_MODEL_LEN - MAX_TOKENS - 1, seed=6000)
    reference = cluster.reference(prompt)
    assert cluster.decode is not None
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            pd_client.disaggregated, cluster.p_url, cluster.d_url, cluster.bootstrap, body(prompt)
        )
        time.sleep(0.05)
        cluster.decode.kill()
        with pytest.raises(OSError):
            pending.result(timeout=120)
    # D died before it connected (P's lease frees the blocks) or while receiving (the broken connection does).
    wait_until(lambda: blocks_idle(cluster.p_url), LEASE_S + 20, "P blocks released after D died")
    assert token_ids(pd_client.post_json(cluster.p_url + "/v1/completions", body(prompt))) == reference


def _post_status(url: str, payload: dict[str, Any], timeout_s: float) -> tuple[int, list[bytes]]:
    """POST a completion; return (HTTP status, the body split in SSE events, or the whole body as one)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(payload), {"content-type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        events = [e for e in raw.split(b"\n\n") if e] if payload.get("stream") else [raw]
        return resp.status, events
    finally:
        conn.close()


#: What vLLM 0.32 returns for a request finished with FinishReason.ERROR (GenerationError): no tokens.
VLLM_GENERATION_ERROR = {
    "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
}


def test_fail_policy_ends_request_with_error(cluster: Cluster) -> None:
    """D with ``kv_load_failure_policy: fail``: a load that never arrives ends the request with vLLM's
    generation error (HTTP 500, or a streamed error event then [DONE]) within the load timeout, never a hang
    or tokens computed without the KV; D frees the blocks and keeps serving disaggregated requests.

    D was killed by the previous test, so starting it with this policy costs no extra restart; it also
    serves the next test (where every transfer must succeed, a failed load would now be an error)."""
    cluster.ensure(prefix_caching=False, failure_policy="fail")
    failures = metric(cluster.d_url, "vllm:pd_connector_failures_total")
    # 1) A transfer P never runs: D's destinations wait out P's lease (or D's load timeout) and fail.
    start = time.monotonic()
    status, events = _post_status(
        cluster.d_url,
        body(tokens(300, seed=11000), kv_transfer_params=decode_params(uuid.uuid4().hex, cluster.bootstrap)),
        timeout_s=D_LOAD_TIMEOUT_S + 20,
    )
    took = time.monotonic() - start
    assert status == 500, events
    assert json.loads(events[0]) == VLLM_GENERATION_ERROR
    assert min(D_LOAD_TIMEOUT_S, LEASE_S) - 0.5 <= took <= D_LOAD_TIMEOUT_S + 20
    # 2) Streamed, from a P address nobody listens on: the connect fails and the error comes at once.
    start = time.monotonic()
    status, events = _post_status(
        cluster.d_url,
        body(
            tokens(200, seed=11001),
            stream=True,
            kv_transfer_params=decode_params(uuid.uuid4().hex, f"127.0.0.1:{free_port()}"),
        ),
        timeout_s=D_LOAD_TIMEOUT_S + 20,
    )
    assert status == 200, events
    assert events[-1] == b"data: [DONE]", events
    assert [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]] == [VLLM_GENERATION_ERROR], (
        "an error event and no tokens"
    )
    assert time.monotonic() - start < D_LOAD_TIMEOUT_S, "a refused connection fails before the timeout"
    wait_until(lambda: blocks_idle(cluster.d_url), 15, "D blocks freed after the failed loads")
    prompt = tokens(300, seed=11002)
    assert cluster.disaggregated(prompt) == cluster.reference(prompt), "D still serves with a healthy P"
    wait_until(
        lambda: metric(cluster.d_url, "vllm:pd_connector_failures_total") >= failures + 2,
        10,
        "both failures counted",
    )


def test_disaggregated_equals_colocated_without_decode_prefix_cache(cluster: Cluster) -> None:
    """On the D the previous test started (policy fail): every load must succeed, none is recomputed."""
    cluster.ensure(prefix_caching=False)
    for n in PROMPT_LENGTHS:
        prompt = tokens(n, seed=n)
        assert cluster.disaggregated(prompt) == cluster.reference(prompt), f"{n} tokens"


@pytest.mark.parametrize("transport", ["cma", "ucx"])
def test_same_host_transport_between_vllm_workers(
    start_servers, cluster: Cluster, tiny_model: Path, log_dir: Path, transport: str
) -> None:
    """The same-host data planes inside real vLLM workers, whose threads run Python while layers are in
    flight: ``cma`` (P's worker writes into D's KV cache with process_vm_writev; sibling processes of one user,
    no shared parent) and ``ucx`` (UCX shared memory, copied by ucxx's progress thread). Runs last: the
    module's TCP pair is stopped first, and each pair after its case, so no more than two engine servers run
    at a time."""
    cluster.stop()
    pair = Cluster(start_servers, tiny_model, log_dir, transport=transport).ensure()
    try:
        for n in (33, 257, MAX_MODEL_LEN - MAX_TOKENS - 1):
            prompt = tokens(n, seed=12000 + n)
            assert pair.disaggregated(prompt) == pair.reference(prompt), f"{n} tokens over {transport}"
        for server in (pair.prefill, pair.decode):
            assert server is not None and f"data plane {transport}" in server.log_tail(400), server
        assert metric(pair.d_url, "vllm:pd_connector_failures_total") == 0
        wait_until(
            lambda: blocks_idle(pair.p_url) and blocks_idle(pair.d_url),
            15,
            f"blocks freed after {transport} loads",
        )
    finally:
        pair.stop()
