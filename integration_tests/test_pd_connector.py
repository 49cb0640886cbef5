"""PDConnector on real vLLM CPU servers (tiny model, float32): P pushes KV layer by layer, D decodes.

Engines run with vLLM's defaults (prefix caching on) unless a test is about a setting, with a shared secret
and D's allow-list naming P, as a deployment would. Every P/D test also proves the transfer happened
(``pd_checks.Transfers``: exact bytes on both sides, one completed load per request, nothing failed, refused or
recomputed), because a failed load is recomputed and gives the same tokens.

One P (core 0) and one D (core 1), over the tcp data plane (ucx and cma run in test_topologies.py and
test_tensor_parallel.py), are shared by the module's tests through ``Cluster``; each test names the
configuration it needs (``ensure``), which restarts only what differs, so no test depends on what another did.
Tests that need the same configuration are adjacent, and those that kill or restart servers come last (server
starts dominate the wall time). The colocated reference is a plain request to P: P's prefix cache holds only
KV P computed itself, so a reference hit is still a colocated answer.
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from integration_tests.pd_checks import (
    FAILURES,
    REFUSED,
    Transfers,
    blocks_idle,
    blocks_to_load,
    decode_hit_after_seen,
    metric,
    wait_until,
)
from pd_connector import wire
from pd_disagg import pd_client
from pd_disagg.engines import base_url, router_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port

MAX_MODEL_LEN = 1024
MAX_TOKENS = 12
CHUNK = 64  # P's max-num-batched-tokens: every prompt above it is prefilled in several chunks
# Generous for a loaded 2-core machine: P (64-token chunks) may queue 16 prompts for several seconds.
LEASE_S = 12.0
D_LOAD_TIMEOUT_S = 20.0
SECRET = "integration-secret"
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


def token_ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


@dataclass(frozen=True)
class DecodeConfig:
    """What a test needs of D; the defaults are vLLM's (prefix caching on) and the examples' (recompute)."""

    prefix_caching: bool = True
    failure_policy: FailurePolicy = "recompute"


class Cluster:
    """The module's P and D servers; restarts one of them when it died or a test needs another D."""

    def __init__(self, start: Callable[..., list[ManagedServer]], model: Path, log_dir: Path) -> None:
        self._start = start
        self.model = model
        self._log_dir = log_dir
        self.side_channel_port = free_port()
        #: A prefill address D may dial where nothing listens (a P that is down).
        self.down_addr = f"127.0.0.1:{free_port()}"
        self.prefill: ManagedServer | None = None
        self.decode: ManagedServer | None = None
        self.decode_config: DecodeConfig | None = None
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
            name="pd-prefill",
            dtype="float32",
            cpu_core=0,
            max_model_len=MAX_MODEL_LEN,
            extra_args=["--served-model-name", "tiny", "--max-num-batched-tokens", str(CHUNK)],
            kv_transfer_config={
                "kv_connector": "PDConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {
                    "transport": "tcp",
                    "side_channel_port": self.side_channel_port,
                    "lease_s": LEASE_S,
                    "load_timeout_s": 20.0,
                    "secret": SECRET,
                    "test_allow_corruption": True,
                },
            },
        )

    def _decode_server(self, config: DecodeConfig) -> ManagedServer:
        return vllm_server(
            self.model,
            log_dir=self._log_dir,
            name=f"pd-decode-{'cache' if config.prefix_caching else 'nocache'}-{config.failure_policy}",
            dtype="float32",
            cpu_core=1,
            max_model_len=MAX_MODEL_LEN,
            extra_args=["--served-model-name", "tiny"]
            + ([] if config.prefix_caching else ["--no-enable-prefix-caching"]),
            kv_transfer_config={
                "kv_connector": "PDConnector",
                "kv_role": "kv_consumer",
                "kv_load_failure_policy": config.failure_policy,
                "kv_connector_extra_config": {
                    "transport": "tcp",
                    "load_timeout_s": D_LOAD_TIMEOUT_S,
                    "secret": SECRET,
                    "allowed_prefill_addrs": [self.bootstrap, self.down_addr],
                },
            },
        )

    def stop(self) -> None:
        """Stop both servers (a later ``ensure`` starts them again)."""
        for server in (self.prefill, self.decode):
            if server is not None:
                server.stop()

    def ensure(self, decode: DecodeConfig | None = None) -> Cluster:
        """P and D running, D configured as ``decode`` (default: ``DecodeConfig()``); starts what is missing
        or dead and restarts D if its configuration differs, in parallel."""
        want = decode or DecodeConfig()
        to_start = []
        if self.prefill is None or not self.prefill.alive():
            if self.prefill is not None:
                self.prefill.stop()
            self.prefill = self._prefill_server()
            to_start.append(self.prefill)
        if self.decode is None or not self.decode.alive() or self.decode_config != want:
            if self.decode is not None:
                self.decode.stop()
            self.decode, self.decode_config = self._decode_server(want), want
            to_start.append(self.decode)
        if to_start:
            self._start(*to_start)
        return self

    def reference(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        """Colocated greedy output, memoised: a plain request to P (which then holds the prompt in its cache)."""
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
            self.p_url, self.d_url, self.bootstrap, body(prompt, max_tokens), corrupt=corrupt
        )
        assert isinstance(p_answer, dict), f"P leg failed: {p_answer!r}"
        return token_ids(answer)

    def transfers(self) -> Transfers:
        return Transfers(self.p_url, self.d_url)


@pytest.fixture(scope="module")
def cluster(start_servers, tiny_model: Path, log_dir: Path) -> Iterator[Cluster]:
    yield Cluster(start_servers, tiny_model, log_dir)


@pytest.fixture
def pd(cluster: Cluster) -> Cluster:
    """P and D as deployed by default: prefix caching on both, D recomputes failed loads."""
    return cluster.ensure()


def test_disaggregated_equals_colocated(pd: Cluster) -> None:
    """Every prompt size, chunked on P. P computed each prompt before (the reference), so its prefix cache
    covers the prompt and D has none of it: P must push its cached blocks too. The second round hits D's
    cache and loads only the tail. Each round moves exactly the blocks D asked for, and nothing is recomputed."""
    prompts = [tokens(n, seed=n) for n in PROMPT_LENGTHS]
    references = [pd.reference(p) for p in prompts]
    for round_, cached in enumerate((False, True)):
        transfers = pd.transfers()
        for prompt, reference in zip(prompts, references, strict=True):
            assert pd.disaggregated(prompt) == reference, f"{len(prompt)} tokens, round {round_}"
        hits = [decode_hit_after_seen(len(p)) if cached else 0 for p in prompts]
        blocks = sum(blocks_to_load(len(p), h) for p, h in zip(prompts, hits, strict=True))
        transfers.check(len(prompts), blocks=blocks)
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "blocks freed")


def test_prefill_prefix_cache_hit_reaches_a_decode_without_it(pd: Cluster) -> None:
    """P holds the first 320 tokens of the prompt (sent to P alone before), D holds nothing: D must receive
    all of it, P's cached part included, and decode the colocated tokens (a hole once made D decode garbage)."""
    prompt = tokens(700, seed=20_000)
    pd.reference(prompt[:320])
    hits = metric(pd.p_url, "vllm:prefix_cache_hits_total")
    transfers = pd.transfers()
    answer = pd.disaggregated(prompt)
    assert metric(pd.p_url, "vllm:prefix_cache_hits_total") - hits >= 320, "P's prefill hit its cache"
    transfers.check(1, blocks=blocks_to_load(len(prompt)))
    assert answer == pd.reference(prompt)


def test_vllm_standard_flow(pd: Cluster) -> None:
    """vLLM's own proxy flow: P first (max_tokens=1), then D with the kv_transfer_params P returned."""
    for n in (40, 300):
        prompt = tokens(n, seed=1000 + n)
        reference = pd.reference(prompt)
        transfers = pd.transfers()
        assert token_ids(pd_client.vllm_standard(pd.p_url, pd.d_url, body(prompt))) == reference
        transfers.check(1, blocks=blocks_to_load(n))


def test_sixteen_concurrent_requests(pd: Cluster) -> None:
    prompts = [tokens(60 + 37 * i, seed=2000 + i) for i in range(16)]
    references = [pd.reference(p) for p in prompts]
    transfers = pd.transfers()
    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(pd.disaggregated, prompts))
    assert outputs == references
    transfers.check(16, blocks=sum(blocks_to_load(len(p)) for p in prompts))
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "blocks freed")


def test_identical_prompts_at_once_share_prefills_cache(pd: Cluster) -> None:
    """Six copies of one long prompt at once: P's chunked prefills of the later copies hit blocks the first
    one cached, D's loads do not; every copy gets the colocated tokens and a complete transfer."""
    prompt = tokens(600, seed=21_000)
    transfers = pd.transfers()
    with ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(pd.disaggregated, [prompt] * 6))
    assert outputs == [pd.reference(prompt)] * 6
    transfers.check(6)


@pytest.mark.parametrize("shape", ["n=2", "prompt list"])
def test_several_sequences_share_one_transfer_id_safely(pd: Cluster, shape: str) -> None:
    """``n > 1`` and prompt lists reach the engines as several requests with the same kv_transfer_params:
    the first transfers, the others are refused on P and on D (counted) and run locally, so every choice
    gets its colocated tokens and no block is held. (pd-router sends such requests down the local path.) n=2
    samples with top_k=1: vLLM refuses n > 1 for greedy requests, and a seed kills vLLM 0.32's CPU sampler."""
    prompt = tokens(330, seed=22_000 + len(shape))
    if shape == "n=2":
        request = {**body(prompt), "n": 2, "temperature": 1.0, "top_k": 1}
        expected = [pd.reference(prompt)] * 2
    else:
        other = tokens(200, seed=22_100)
        request = body([prompt, other])  # type: ignore[arg-type]
        expected = [pd.reference(prompt), pd.reference(other)]
    before = pd.transfers().before
    answer, p_answer = pd_client.disaggregated(pd.p_url, pd.d_url, pd.bootstrap, request)
    assert isinstance(p_answer, dict), p_answer
    assert [list(c["token_ids"]) for c in sorted(answer["choices"], key=lambda c: c["index"])] == expected
    wait_until(lambda: pd.transfers().before.loaded == before.loaded + 1, 15, "one completed load")
    now = pd.transfers().before
    assert (now.failures, now.refused) == (before.failures, before.refused + 2), (
        "the copies refused, none failed"
    )
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "no block held")


def test_decode_metrics_show_external_transfer(pd: Cluster) -> None:
    """D counts the prompt as external (P2P) cache hits, and the connector's histograms saw the transfer."""
    d_hits = metric(pd.d_url, "vllm:external_prefix_cache_hits_total")
    loads = metric(pd.d_url, "vllm:pd_connector_load_seconds_count")
    prompt = tokens(500, seed=3000)
    reference = pd.reference(prompt)
    transfers = pd.transfers()
    assert pd.disaggregated(prompt) == reference
    transfers.check(1, blocks=blocks_to_load(len(prompt)))
    assert metric(pd.d_url, "vllm:external_prefix_cache_hits_total") - d_hits >= len(prompt) - 1
    assert metric(pd.d_url, "vllm:pd_connector_load_seconds_count") == loads + 1


ROUTER_THRESHOLD = 64  # prompts of at least this many tokens take the P->D path through pd-router


@pytest.fixture(scope="module")
def router(start_servers, cluster: Cluster, tmp_path_factory, log_dir: Path) -> str:
    """pd-router (a real process) in front of the module's P and D, in our push flow (docs/wire-contract.md)."""
    cluster.ensure()
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


def _post(url: str, path: str, payload: Any, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """POST ``payload`` (JSON, or raw bytes); returns (status, X-PD-Route header, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        conn.request("POST", path, data, {"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.getheader("X-PD-Route") or "", resp.read()
    finally:
        conn.close()


def _through_router(router: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """POST a completion to pd-router; returns (the path it took, the JSON answer)."""
    status, route, raw = _post(router, "/v1/completions", payload)
    answer = json.loads(raw)
    assert status == 200, answer
    return route, answer


def test_router_sends_long_prompts_p_to_d_and_short_ones_to_d(pd: Cluster, router: str) -> None:
    """Through pd-router: a long prompt is disaggregated (its KV pushed by P), a short one prefills on D
    (nothing moves); both give the colocated greedy tokens."""
    long_prompt, short_prompt = tokens(ROUTER_THRESHOLD + 150, seed=5150), tokens(ROUTER_THRESHOLD // 2, 5032)
    transfers = pd.transfers()
    route, answer = _through_router(router, body(long_prompt))
    assert (route, token_ids(answer)) == ("disagg", pd.reference(long_prompt))
    transfers.check(1, blocks=blocks_to_load(len(long_prompt)))
    sent = metric(pd.p_url, "vllm:pd_connector_bytes_sent_total")
    route, answer = _through_router(router, body(short_prompt))
    assert (route, token_ids(answer)) == ("local", pd.reference(short_prompt))
    assert metric(pd.p_url, "vllm:pd_connector_bytes_sent_total") == sent, "the local path moves no KV"


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
def test_router_streams_disaggregated_completions(pd: Cluster, router: str, n: int) -> None:
    """A streamed long prompt through pd-router: P->D, the colocated tokens, a final chunk and [DONE].

    (A 390-token prompt once got no [DONE] here.) Tokens are not required to arrive one per event: vLLM's
    front end merges the deltas it has not sent yet, which happens on this two-core machine because vLLM's
    CPU workers spin-wait for about a second after each step and starve the front-end processes.
    """
    prompt = tokens(n, seed=6000 + n)
    reference = pd.reference(prompt)
    transfers = pd.transfers()
    route, events = _stream_through_router(router, "/v1/completions", body(prompt, stream=True))
    assert route == "disagg"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert streamed == reference
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    transfers.check(1, blocks=blocks_to_load(n))


def test_router_streams_disaggregated_chat(pd: Cluster, router: str) -> None:
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
    colocated = pd_client.post_json(pd.p_url + "/v1/chat/completions", payload)
    transfers = pd.transfers()
    route, events = _stream_through_router(
        router,
        "/v1/chat/completions",
        {**payload, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert route == "disagg"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    prompt_tokens = colocated["usage"]["prompt_tokens"]
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_tokens >= ROUTER_THRESHOLD
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0].get("role") == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == colocated["choices"][0]["message"]["content"]
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    transfers.check(1, blocks=blocks_to_load(prompt_tokens))


def test_router_seeds_decode_with_prefills_sampled_first_token(pd: Cluster, router: str) -> None:
    """A sampled streamed request (temperature 0.8, fixed seed, logprobs) through pd-router, P->D.

    The client's first token is P's: P alone, asked the same request for one token, samples the same one
    (vLLM seeds a fresh generator per request, so the same prompt and seed give the same first draw). D then
    continues from that token instead of sampling a first token of its own: its tokens equal those of a
    colocated request whose prompt is the prompt plus P's token, with the same seed. That is what vLLM's
    per-request generator makes comparable: D's generator is fresh when it samples the second token, as the
    colocated one is when it samples the first token after prompt + P's token (the CPU sampler draws one seed
    per sampling step from it), so both use the generator's first draw. (It is not the colocated stream of
    the prompt alone, whose second token comes from the generator's second draw.) The first token keeps its
    logprobs (from P's answer), the usage counts every token, and the transfer happened (exact bytes, one
    load, nothing failed or recomputed: an unseeded or recomputing D would sample its own first token).

    The prompt fits in one of P's prefill steps (``CHUNK`` tokens), and the colocated reference (one token
    longer) hits P's prefix cache for all but its last token: vLLM 0.32's CPU model runner kills the engine
    on a seeded request whose prefill is chunked ("RuntimeError: CPU Generator does not use offset", when it
    rewinds the generator after discarding a partial chunk's sample).
    """
    prompt = tokens(CHUNK, seed=7100)
    assert len(prompt) >= ROUTER_THRESHOLD  # P->D through the router
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "logprobs": 2}
    request = body(prompt, **sampling)
    first = pd_client.post_json(pd.p_url + "/v1/completions", {**request, "max_tokens": 1})
    p_token = token_ids(first)[0]
    transfers = pd.transfers()
    route, events = _stream_through_router(
        router,
        "/v1/completions",
        {**request, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert route == "disagg"
    transfers.check(1, blocks=blocks_to_load(len(prompt)))
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    choices = [choice for c in chunks for choice in c["choices"]]
    streamed = [t for choice in choices for t in choice.get("token_ids") or []]
    assert streamed[0] == p_token, "the client's first token is the one P sampled"
    assert choices[0]["token_ids"] == [p_token]
    lp = choices[0]["logprobs"]
    assert lp["tokens"] and isinstance(lp["token_logprobs"][0], float) and len(lp["top_logprobs"][0]) >= 2
    assert all(choice["logprobs"] is not None for choice in choices if choice.get("token_ids"))
    continued = pd_client.post_json(
        pd.p_url + "/v1/completions", body([*prompt, p_token], MAX_TOKENS - 1, **sampling)
    )
    assert streamed[1:] == token_ids(continued), "D continued from P's token, as prompt + token would"
    assert len(streamed) == MAX_TOKENS and chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt)
    assert len({c["id"] for c in chunks}) == 1, "one stream: P's id on D's events too"


class _Listener:
    """A TCP listener a client names as a "prefill address": counts every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[_Listener]:
    trap = _Listener()
    yield trap
    trap.close()


def _client_transfer_fields(trap: str) -> list[dict[str, Any]]:
    """kv_transfer_params a hostile client may send: every role, a peer of its choosing, malformed shapes."""
    tid = uuid.uuid4().hex
    return [
        wire.encode(wire.StandardPrefill()),
        wire.encode(wire.PushPrefill(tid)),
        wire.encode(wire.PushDecode(tid, trap)),
        wire.encode(wire.PrefillReturned(tid, trap)),
        {"pd_role": "decode", "pd_transfer_id": ["x"], "pd_prefill_addr": trap},
        {"pd_role": "boss", "pd_prefill_addr": trap},
        {"do_remote_prefill": True, "pd_transfer_id": tid},
    ]


#: Malformed completions and the status pd-router answers (engines answer some other 4xx to a few of them).
BAD_BODIES: list[tuple[Any, int]] = [
    (b"{not json", 400),
    (b"[" * 5000 + b"]" * 5000, 400),
    (b'"a string"', 400),
    ({"model": "tiny", "prompt": 5}, 400),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400),
    ({"model": "nope", "prompt": "x"}, 404),
]


def test_bad_input_through_the_router(pd: Cluster, router: str, listener: _Listener) -> None:
    """Malformed requests get an OpenAI-style 4xx; client transfer fields (on both paths) make no server
    connect anywhere and hold no block; both engines still serve P->D afterwards."""
    for payload, status in BAD_BODIES:
        got, _, raw = _post(router, "/v1/completions", payload)
        assert got == status, (payload[:40] if isinstance(payload, bytes) else payload, raw)
        assert set(json.loads(raw)["error"]) >= {"message", "type", "code"}
    got, _, raw = _post(router, "/v1/completions", b"{}", {"content-type": "text/plain"})
    assert 400 <= got < 500 and "error" in json.loads(raw), raw
    for params in _client_transfer_fields(listener.addr):
        for n in (ROUTER_THRESHOLD // 2, ROUTER_THRESHOLD + 40):
            prompt = tokens(n, seed=7100 + n)
            extra: dict[str, Any] = {
                "kv_transfer_params": params,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_room": 7,
            }
            route, answer = _through_router(router, body(prompt, **extra))
            assert token_ids(answer) == pd.reference(prompt), (params, route)
    assert listener.connections == 0, "a client-chosen address was dialled"
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "no block held")
    prompt = tokens(300, seed=7199)
    transfers = pd.transfers()
    assert _through_router(router, body(prompt))[1]["choices"][0]["token_ids"] == pd.reference(prompt)
    transfers.check(1, blocks=blocks_to_load(len(prompt)))


def test_client_transfer_fields_sent_straight_to_the_engines(pd: Cluster, listener: _Listener) -> None:
    """The same fields sent to P's and D's own API servers (another proxy, or none): a role the engine does
    not play, a prefill address outside D's allow-list, malformed params are refused (counted) and the
    request runs locally; nothing dials the client's listener; D holds no block; P (whose decode params once
    crashed its engine) and D both keep serving P->D. Malformed HTTP gets a 4xx from each engine too."""
    for url in (pd.p_url, pd.d_url):
        for payload, _ in BAD_BODIES:
            status, _, raw = _post(url, "/v1/completions", payload)
            assert 400 <= status < 500, (url, raw[:200])
        status, _, raw = _post(url, "/v1/completions", b"{}", {"content-type": "text/plain"})
        assert 400 <= status < 500, (url, raw[:200])
    refused = metric(pd.p_url, REFUSED) + metric(pd.d_url, REFUSED)
    cases = _client_transfer_fields(listener.addr)
    prefill_roles = cases[:2]  # P takes these: it prefills and holds blocks for at most its lease
    for i, params in enumerate(cases):
        prompt = tokens(90, seed=7300 + i)
        for url in (pd.d_url, pd.p_url):
            if url == pd.p_url and params in prefill_roles:
                continue
            answer = pd_client.post_json(url + "/v1/completions", body(prompt, kv_transfer_params=params))
            assert token_ids(answer) == pd.reference(prompt), (url, params)
    assert listener.connections == 0, "a client-chosen address was dialled"
    wait_until(lambda: blocks_idle(pd.d_url), 10, "D holds no block for a client's transfer fields")
    wait_until(lambda: blocks_idle(pd.p_url), 10, "P holds no block for decode parameters")
    wait_until(
        lambda: metric(pd.p_url, REFUSED) + metric(pd.d_url, REFUSED) >= refused + 2 * len(cases) - 2,
        15,
        "every refusal counted",
    )
    prompt = tokens(200, seed=7399)
    transfers = pd.transfers()
    assert pd.disaggregated(prompt) == pd.reference(prompt)
    transfers.check(1, blocks=blocks_to_load(len(prompt)))


def test_corrupted_transfer_changes_output(pd: Cluster) -> None:
    """Negative control: P zeroes the KV it pushes (test-only flag) and D's output changes, so D really
    decodes from the transferred bytes. (P and D keep the zeroed blocks cached: these prompts serve only here,
    and the reference is taken first.)"""
    for n in (100, 257, 600):
        prompt = tokens(n, seed=9000 + n)
        reference = pd.reference(prompt)
        transfers = pd.transfers()
        assert pd.disaggregated(prompt, corrupt=True) != reference, f"{n} tokens"
        transfers.check(1)


def _abandon(url: str, path: str, payload: dict[str, Any], after_s: float) -> None:
    """Send a request and drop the connection after ``after_s`` (a client disconnect vLLM must abort)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps(payload), {"content-type": "application/json"})
    time.sleep(after_s)  # the fault's moment: a random point of the request's life, not a synchronisation
    conn.close()


def test_random_aborts_release_all_blocks(pd: Cluster) -> None:
    """Client disconnects at random points on either or both legs: both servers return to no blocks used."""
    rng = random.Random(7)
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "idle before aborts")

    def one(i: int) -> None:
        prompt = tokens(rng.randrange(200, 900), seed=4000 + i)
        transfer_id = uuid.uuid4().hex
        legs = rng.choice(["prefill", "decode", "both"])
        p_body = pd_client.prefill_body(body(prompt), wire.PushPrefill(transfer_id))
        d_body = pd_client.decode_body(body(prompt, max_tokens=200, stream=True), transfer_id, pd.bootstrap)
        delay = rng.uniform(0.0, 0.6)
        with ThreadPoolExecutor(2) as pool:
            if legs in ("prefill", "both"):
                p_done = pool.submit(_abandon, pd.p_url, "/v1/completions", p_body, delay)
            else:
                p_done = pool.submit(pd_client.post_json, pd.p_url + "/v1/completions", p_body)
            d_done = pool.submit(
                _abandon, pd.d_url, "/v1/completions", d_body, delay if legs != "prefill" else delay + 0.5
            )
            p_done.result()
            d_done.result()

    for i in range(8):
        one(i)
    # Aborted P legs free at once; a P whose D vanished waits at most the lease.
    wait_until(lambda: blocks_idle(pd.p_url), LEASE_S + 20, "P blocks back to baseline")
    wait_until(lambda: blocks_idle(pd.d_url), D_LOAD_TIMEOUT_S + 20, "D blocks back to baseline")
    prompt = tokens(150, seed=4999)
    transfers = pd.transfers()
    assert pd.disaggregated(prompt) == pd.reference(prompt), "servers still serve correctly"
    transfers.check(1, blocks=blocks_to_load(len(prompt)))


def test_lease_expiry_frees_prefill_blocks(pd: Cluster) -> None:
    """A prefill whose D never shows up holds its blocks only for the lease, then frees them."""
    wait_until(lambda: blocks_idle(pd.p_url), LEASE_S + 20, "P idle before the test")
    expired = metric(pd.p_url, "vllm:pd_connector_expired_leases_total")
    prompt = tokens(400, seed=5000)
    answer = pd_client.post_json(
        pd.p_url + "/v1/completions", pd_client.prefill_body(body(prompt), wire.PushPrefill(uuid.uuid4().hex))
    )
    assert answer["kv_transfer_params"]["pd_prefill_addr"] == pd.bootstrap
    assert metric(pd.p_url, "vllm:kv_cache_usage_perc") > 0, "blocks held for the missing D"
    took = wait_until(lambda: blocks_idle(pd.p_url), LEASE_S + 15, "lease expiry")
    assert took >= LEASE_S - 1.5
    # Connector stats reach /metrics with the engine's next output: an idle engine needs one more request.
    pd.reference(tokens(3, seed=5001))
    wait_until(
        lambda: metric(pd.p_url, "vllm:pd_connector_expired_leases_total") >= expired + 1,
        10,
        "expired-lease counter",
    )


def test_decode_times_out_when_prefill_never_delivers(pd: Cluster) -> None:
    """D waits for a transfer P never heard of: after its load timeout (or P's lease on the orphaned
    destinations, whichever is shorter) it recomputes (policy recompute), answers correctly, frees its blocks."""
    prompt = tokens(300, seed=7000)
    reference = pd.reference(prompt)
    failures = metric(pd.d_url, FAILURES)
    start = time.monotonic()
    answer = pd_client.post_json(
        pd.d_url + "/v1/completions", pd_client.decode_body(body(prompt), uuid.uuid4().hex, pd.bootstrap)
    )
    took = time.monotonic() - start
    assert token_ids(answer) == reference
    # Whichever ends first: D's load timeout, or P's lease on destinations it was never offered.
    assert min(D_LOAD_TIMEOUT_S, LEASE_S) - 0.5 <= took <= D_LOAD_TIMEOUT_S + 20
    wait_until(lambda: metric(pd.d_url, FAILURES) == failures + 1, 10, "the failure counted")
    wait_until(lambda: blocks_idle(pd.d_url), 10, "D blocks freed")


def _connections_to(port: int) -> int:
    """Established TCP connections whose local end is ``port`` on this host (accepted or still queued)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                count += fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port
    return count


def test_prefill_killed_during_a_transfer_then_restarted(cluster: Cluster) -> None:
    """P frozen (SIGSTOP) with both legs sent, then killed: D, waiting for KV or about to dial P, recomputes
    within its timeout; with P gone, a new transfer fails at connect time and D recomputes at once; a P
    restarted on the same side channel serves D again. (A write cut off halfway is the unit tests' case:
    tests/pd_connector/test_control_plane.py kills a prefill process mid-transfer. The reference comes from
    the restarted P.)"""
    pd = cluster.ensure()
    assert pd.prefill is not None
    prompt = tokens(MAX_MODEL_LEN - MAX_TOKENS - 1, seed=8000)
    failures = metric(pd.d_url, FAILURES)
    tid = uuid.uuid4().hex
    p_port = int(pd.p_url.rsplit(":", 1)[1])
    queued = _connections_to(p_port)
    pd.prefill.kill(signal.SIGSTOP)
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        d_leg = pool.submit(
            pd_client.post_json,
            pd.d_url + "/v1/completions",
            pd_client.decode_body(body(prompt), tid, pd.bootstrap),
        )
        p_leg = pool.submit(
            pd_client.post_json,
            pd.p_url + "/v1/completions",
            pd_client.prefill_body(body(prompt), wire.PushPrefill(tid)),
        )
        wait_until(lambda: _connections_to(p_port) > queued, 30, "the P leg queued at the frozen P")
        pd.prefill.kill()
        with pytest.raises(OSError):
            p_leg.result(timeout=60)
        answer = d_leg.result(timeout=120)
    assert time.monotonic() - start < D_LOAD_TIMEOUT_S + 30
    start = time.monotonic()
    again, _ = pd_client.disaggregated(pd.p_url, pd.d_url, pd.bootstrap, body(prompt), timeout_s=60)
    assert time.monotonic() - start < D_LOAD_TIMEOUT_S + 10
    wait_until(lambda: blocks_idle(pd.d_url), 15, "D blocks freed")
    wait_until(lambda: metric(pd.d_url, FAILURES) == failures + 2, 10, "both failed loads counted")
    cluster.ensure()  # P restarts on the same side-channel port; D reconnects to it
    reference = pd.reference(prompt)
    assert token_ids(answer) == token_ids(again) == reference, "both recomputed answers are colocated ones"
    fresh = tokens(300, seed=10000)
    transfers = pd.transfers()
    assert pd.disaggregated(fresh) == pd.reference(fresh)
    transfers.check(1, blocks=blocks_to_load(len(fresh)))


def test_decode_killed_during_a_transfer_leaves_prefill_healthy(cluster: Cluster) -> None:
    """D frozen with its leg queued while P prefills and holds the blocks for it, then killed: P frees them
    within its lease (the destinations never came) and keeps serving."""
    pd = cluster.ensure()
    assert pd.decode is not None
    prompt = tokens(MAX_MODEL_LEN - MAX_TOKENS - 1, seed=6000)
    tid = uuid.uuid4().hex
    pd.decode.kill(signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        d_leg = pool.submit(
            pd_client.post_json,
            pd.d_url + "/v1/completions",
            pd_client.decode_body(body(prompt), tid, pd.bootstrap),
        )
        p_answer = pd_client.post_json(
            pd.p_url + "/v1/completions", pd_client.prefill_body(body(prompt), wire.PushPrefill(tid))
        )
        assert p_answer["kv_transfer_params"]["pd_transfer_id"] == tid, "P prefilled and holds the blocks"
        pd.decode.kill()
        with pytest.raises(OSError):
            d_leg.result(timeout=60)
    wait_until(lambda: blocks_idle(pd.p_url), LEASE_S + 20, "P blocks released after D died")
    assert token_ids(pd_client.post_json(pd.p_url + "/v1/completions", body(prompt))) == pd.reference(prompt)


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
#: D without prefix caching and with ``kv_load_failure_policy: fail``: both settings are under test below.
STRICT_DECODE = DecodeConfig(prefix_caching=False, failure_policy="fail")


def test_fail_policy_ends_request_with_error(cluster: Cluster) -> None:
    """D with ``kv_load_failure_policy: fail``: a load that never arrives ends the request with vLLM's
    generation error (HTTP 500, or a streamed error event then [DONE]) within the load timeout, never a hang
    or tokens computed without the KV; D frees the blocks and keeps serving disaggregated requests."""
    pd = cluster.ensure(STRICT_DECODE)
    failures = metric(pd.d_url, FAILURES)
    # 1) A transfer P never runs: D's destinations wait out P's lease (or D's load timeout) and fail.
    start = time.monotonic()
    status, events = _post_status(
        pd.d_url,
        pd_client.decode_body(body(tokens(300, seed=11000)), uuid.uuid4().hex, pd.bootstrap),
        timeout_s=D_LOAD_TIMEOUT_S + 20,
    )
    took = time.monotonic() - start
    assert status == 500, events
    assert json.loads(events[0]) == VLLM_GENERATION_ERROR
    assert min(D_LOAD_TIMEOUT_S, LEASE_S) - 0.5 <= took <= D_LOAD_TIMEOUT_S + 20
    # 2) Streamed, from an allowed prefill address nobody listens on: the connect fails, the error comes at once.
    start = time.monotonic()
    status, events = _post_status(
        pd.d_url,
        pd_client.decode_body(body(tokens(200, seed=11001), stream=True), uuid.uuid4().hex, pd.down_addr),
        timeout_s=D_LOAD_TIMEOUT_S + 20,
    )
    assert status == 200, events
    assert events[-1] == b"data: [DONE]", events
    assert [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]] == [VLLM_GENERATION_ERROR], (
        "an error event and no tokens"
    )
    assert time.monotonic() - start < D_LOAD_TIMEOUT_S, "a refused connection fails before the timeout"
    wait_until(lambda: blocks_idle(pd.d_url), 15, "D blocks freed after the failed loads")
    wait_until(lambda: metric(pd.d_url, FAILURES) == failures + 2, 10, "both failures counted")
    prompt = tokens(300, seed=11002)
    transfers = pd.transfers()
    assert pd.disaggregated(prompt) == pd.reference(prompt), "D still serves with a healthy P"
    transfers.check(1, blocks=blocks_to_load(len(prompt)))


def test_disaggregated_equals_colocated_without_decode_prefix_cache(cluster: Cluster) -> None:
    """D without prefix caching loads every block every time; under policy ``fail`` a failed load would be an
    error, and the transfer check proves none was recomputed."""
    pd = cluster.ensure(STRICT_DECODE)
    prompts = [tokens(n, seed=n) for n in PROMPT_LENGTHS]
    references = [pd.reference(p) for p in prompts]
    for round_ in range(2):
        transfers = pd.transfers()
        for prompt, reference in zip(prompts, references, strict=True):
            assert pd.disaggregated(prompt) == reference, f"{len(prompt)} tokens, round {round_}"
        transfers.check(len(prompts), blocks=sum(blocks_to_load(len(p)) for p in prompts))
