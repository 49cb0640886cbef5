"""Fixtures for router unit tests: a small local tokenizer, fake vLLM engines on real HTTP, a router in front.

The fake engines (``test_support.fake_vllm``) are aiohttp servers on loopback speaking vLLM's OpenAI protocol
byte for byte, so the router under test exercises its real HTTP client, SSE relay and failover code.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.web_runner import AppRunner
from tokenizers import Tokenizer, models, pre_tokenizers

from router.app import STATE, RouterState, make_app
from router.balancer import Balancer
from router.config import CircuitConfig, RouterConfig, WorkerConfig, parse_config
from router.front_runner import FrontRunner
from test_support.fake_vllm import FakeEngine, Pairings

MODEL = "fake-model"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_word_tokenizer(root: Path, words: list[str]) -> Path:
    """Write into ``root`` a word-level tokenizer of ``words`` (ids in order; "[UNK]", "<s>" and "</s>" among
    them) with the chat template, and return ``root``."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return root


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer (one token per word or punctuation mark) with a chat template."""
    return write_word_tokenizer(tmp_path_factory.mktemp("tokenizer"), ["[UNK]", "<s>", "</s>"])


class RouterServer(TestServer):
    """aiohttp's test server for the router app, serving through the lean front as ``pd-router`` does."""

    async def _make_runner(self, **kwargs: Any) -> AppRunner:
        return FrontRunner(self.app, **kwargs)


@pytest.fixture(params=["front", "aiohttp"])
def router_server(request: pytest.FixtureRequest) -> type[TestServer]:
    """How the router is served: behind the front (as ``pd-router`` runs), or by aiohttp alone.

    The second is what a connection gets once the front handed it to aiohttp (its first request was not a
    completion), so every router test runs on both.
    """
    return RouterServer if request.param == "front" else TestServer


@dataclass
class Cluster:
    """Fake P and D engines, their servers, and a router client in front of them."""

    prefill: list[FakeEngine]
    decode: list[FakeEngine]
    servers: dict[int, TestServer] = field(default_factory=dict)
    client: TestClient | None = None

    @property
    def router(self) -> TestClient:
        assert self.client is not None
        return self.client

    @property
    def state(self) -> RouterState:
        return self.router.app[STATE]

    def url(self, engine: FakeEngine) -> str:
        return str(self.servers[id(engine)].make_url("")).rstrip("/")

    async def kill(self, engine: FakeEngine) -> None:
        """Stop an engine's server: open connections are dropped and new ones refused."""
        await self.servers[id(engine)].close()


MakeCluster = Callable[..., Any]


@pytest.fixture
async def make_cluster(tokenizer_dir: Path, router_server: type[TestServer]) -> AsyncIterator[MakeCluster]:
    clusters: list[Cluster] = []

    async def make(n_prefill: int = 1, n_decode: int = 2, flow: str = "pd-push", **overrides: Any) -> Cluster:
        pairings = Pairings()  # D answers a P/D leg once P has its partner: tests see both legs
        cluster = Cluster(
            [FakeEngine(model=MODEL, pairings=pairings, role="prefill") for _ in range(n_prefill)],
            [FakeEngine(model=MODEL, pairings=pairings) for _ in range(n_decode)],
        )
        clusters.append(cluster)
        for engine in (*cluster.prefill, *cluster.decode):
            server = TestServer(engine.app())
            await server.start_server()
            cluster.servers[id(engine)] = server
        table: dict[str, Any] = {
            "model": {"path": MODEL, "tokenizer": str(tokenizer_dir), "max_model_len": 4096},
            "flow": flow,
            "prefill": [
                {"url": cluster.url(e), "bootstrap": f"127.0.0.1:{7000 + i}", "bootstrap_port": 7000 + i}
                for i, e in enumerate(cluster.prefill)
            ],
            "decode": [{"url": cluster.url(e)} for e in cluster.decode],
            # sglang-bootstrap sends every request P->D (SGLang's D cannot prefill alone): no threshold there
            "policy": {"threshold_tokens": 0 if flow == "sglang-bootstrap" else 32, "queue_timeout_s": 2.0},
            "retry": {"backoff_base_s": 0.001, "backoff_max_s": 0.01},
            "health": {"interval_s": 0.2, "timeout_s": 5.0},
            "timeouts": {"first_byte_s": 5.0, "idle_s": 5.0, "request_s": 20.0},
            # Tests send the same prompts again and again: KV-aware routing would send the repeats to D alone.
            # Its own tests (test_kv_routing.py) turn it on with kv_routing__enabled=True.
            "kv_routing": {"enabled": False},
        }
        for key, value in overrides.items():
            section, _, name = key.partition("__")
            if name:
                table.setdefault(section, {})[name] = value
            else:
                table[section] = value
        cfg: RouterConfig = parse_config(table)
        app: web.Application = make_app(cfg, random.Random(0))
        cluster.client = TestClient(router_server(app))
        await cluster.client.start_server()
        return cluster

    yield make
    for cluster in clusters:
        if cluster.client is not None:
            await cluster.client.close()
        for server in cluster.servers.values():
            await server.close()


def short_prompt() -> str:
    return "hello world"


def long_prompt() -> str:
    return " ".join(f"word{i}" for i in range(64))


def make_balancer(n_p: int, n_d: int, circuit: CircuitConfig, seed: int, **options: Any) -> Balancer:
    """A ``Balancer`` (no servers) over ``n_p`` prefill workers ``http://p{i}:1`` (side channel ``h:1``) and
    ``n_d`` decode workers ``http://d{i}:1``; ``options`` are the balancer's (``clock``, ``kv``)."""
    b = Balancer(circuit, random.Random(seed), **options)
    for i in range(n_p):
        b.add(WorkerConfig(f"http://p{i}:1", bootstrap="h:1"), "prefill")
    for i in range(n_d):
        b.add(WorkerConfig(f"http://d{i}:1"), "decode")
    return b
