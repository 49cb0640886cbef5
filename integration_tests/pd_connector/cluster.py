"""The P/D cluster the integration_tests/pd_connector/ files share, and the requests they send it.

One P (core 0) and one D (core 1) real vLLM CPU servers (tiny model, float32) with PDConnector over the tcp
data plane (ucx and cma run in test_topologies.py and test_tensor_parallel.py), with a shared secret and D's
allow-list naming P, as a deployment would. ``Cluster.ensure`` starts what is missing or dead and restarts D
when a test needs another D configuration, so no test depends on what another did. The fixtures in this
package's conftest.py hold one ``Cluster`` for the whole package. The colocated reference is a plain request
to P: P's prefix cache holds only KV P computed itself, so a reference hit is still a colocated answer.
"""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from integration_tests.pd_checks import Transfers
from pd_disagg import pd_client
from pd_disagg.engines import base_url, vllm_server
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
ROUTER_THRESHOLD = 64  # prompts of at least this many tokens take the P->D path through pd-router


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
    """The package's P and D servers; restarts one of them when it died or a test needs another D."""

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


#: D without prefix caching and with ``kv_load_failure_policy: fail`` (test_with_fail_policy.py).
STRICT_DECODE = DecodeConfig(prefix_caching=False, failure_policy="fail")


def post(
    url: str, path: str, payload: Any, headers: dict[str, str] | None = None, timeout_s: float = 120
) -> tuple[int, str, bytes]:
    """POST ``payload`` (JSON, or raw bytes); returns (status, X-PD-Route header, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        conn.request("POST", path, data, {"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.getheader("X-PD-Route") or "", resp.read()
    finally:
        conn.close()


def through_router(router: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """POST a completion to pd-router; returns (the path it took, the JSON answer)."""
    status, route, raw = post(router, "/v1/completions", payload)
    answer = json.loads(raw)
    assert status == 200, answer
    return route, answer


def stream_through_router(
    router: str, path: str, payload: dict[str, Any]
) -> tuple[str, list[dict[str, Any]]]:
    """Stream a request through pd-router; returns (the path it took, every SSE chunk before [DONE], parsed)."""
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
        return resp.getheader("X-PD-Route") or "", [
            json.loads(e.removeprefix(b"data: ")) for e in events[:-1]
        ]
    finally:
        conn.close()
