"""pd-router (a real process) in front of real vLLM CPU servers on the tiny model.

Two decode servers (one per core, float32) behind the router. Proven here: a server's greedy tokens equal
transformers' own (the engine itself, before anything of ours is in the path), the threshold path (a short
prompt goes to a decode server only and its greedy output equals calling that server directly), the official ``openai``
client through the router, and a decode server SIGKILLed mid-stream with the other one continuing the
stream. The kill test runs last in this module because it leaves one decode server dead. The P/D path through
the router with real PDConnector servers is proven in ``test_topologies.py`` (two P, two D, both vLLM flows)
and ``test_examples.py`` (the shipped example files).
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from integration_tests import decode_pair
from pd_disagg.engines import base_url
from pd_disagg.servers import ManagedServer

MAX_MODEL_LEN = 1024
THRESHOLD = 64
SHORT = "def add(a, b):"


@pytest.fixture(scope="module")
def decode_servers(start_servers, tiny_model: Path, log_dir: Path) -> list[ManagedServer]:
    return start_servers(*decode_pair.decode_servers(tiny_model, log_dir, "router", MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def router_proc(
    start_servers, tmp_path_factory, tiny_model: Path, log_dir: Path, decode_servers
) -> ManagedServer:
    config = tmp_path_factory.mktemp("router") / "router.toml"
    policy = {"threshold_tokens": THRESHOLD}
    (server,) = start_servers(
        decode_pair.decode_router(config, tiny_model, log_dir, MAX_MODEL_LEN, decode_servers, policy)
    )
    return server


@pytest.fixture(scope="module")
def router(router_proc: ManagedServer) -> str:
    return base_url(router_proc)


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.read()


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


async def test_greedy_tokens_match_transformers(decode_servers, tiny_model: Path) -> None:
    """The engine alone (no router, no connector) against transformers' greedy generation, float32 on both
    sides: every P/D and router test compares against this server's answers, so they must be the model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for prompt in ("def hello(world):", "import os\nimport sys\n\nclass Foo:", "The quick brown fox " * 20):
        body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 24, "temperature": 0}
        status, out = await _post(
            base_url(decode_servers[0]), "/v1/completions", body | {"return_token_ids": True}
        )
        assert status == 200, out
        served = json.loads(out)["choices"][0]["token_ids"]
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            reference = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :]
        assert served == reference.tolist(), f"prompt {prompt[:30]!r}"
        assert len(served) == 24


async def test_short_prompt_threshold_path_equals_decode_directly(
    router: str, decode_servers, tiny_model
) -> None:
    body = {
        "model": str(tiny_model),
        "prompt": SHORT,
        "max_tokens": 16,
        "temperature": 0,
        "return_token_ids": True,
    }
    status, via_router = await _post(router, "/v1/completions", body)
    assert status == 200, via_router
    direct = [json.loads((await _post(base_url(d), "/v1/completions", body))[1]) for d in decode_servers]
    routed = json.loads(via_router)
    assert (
        routed["choices"][0]["token_ids"]
        == direct[0]["choices"][0]["token_ids"]
        == direct[1]["choices"][0]["token_ids"]
    )
    assert len(routed["choices"][0]["token_ids"]) == 16
    assert 'reason="short",route="local"' in await _metrics(router)


async def test_streamed_framing_matches_vllm(router: str, decode_servers, tiny_model) -> None:
    """Same opening and closing events and fields as vLLM itself (vLLM may merge tokens into one event under
    load, so the content is compared joined; the router asks for token ids to resume exactly and must hide
    them)."""
    body = {
        "model": str(tiny_model),
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, via_router = await _post(router, "/v1/chat/completions", body)
    _, direct = await _post(base_url(decode_servers[0]), "/v1/chat/completions", body)

    def events(raw: bytes) -> list[Any]:
        out: list[Any] = []
        for event in raw.split(b"\n\n")[:-1]:
            assert event.startswith(b"data: ")
            payload = event[6:]
            out.append(payload if payload == b"[DONE]" else {**json.loads(payload), "id": 0, "created": 0})
        return out

    def content(evs: list[Any]) -> str:
        return "".join(c["delta"].get("content") or "" for e in evs[:-1] for c in e["choices"])

    def fields(evs: list[Any]) -> tuple[set[str], set[str]]:
        """The chunks' fields and their choices' fields: which of vLLM's chunk shapes a stream shows
        depends on how many tokens vLLM merged into one event (all of them into the finish chunk, at
        times), so the router's fields are compared with vLLM's, not its shapes."""
        chunks = [e for e in evs if isinstance(e, dict)]
        return {k for e in chunks for k in e}, {k for e in chunks for c in e["choices"] for k in c}

    ours, theirs = events(via_router), events(direct)
    assert via_router.endswith(b"\n\ndata: [DONE]\n\n") and b'"token_ids":[' not in via_router
    assert ours[0] == theirs[0]  # role chunk
    assert ours[-2:] == theirs[-2:]  # usage chunk, [DONE]
    assert content(ours) == content(theirs)
    (ours_top, ours_choice), (their_top, their_choice) = fields(ours), fields(theirs)
    assert ours_top <= their_top and ours_choice <= their_choice, (
        ours_top,
        ours_choice,
        their_top,
        their_choice,
    )


async def test_openai_client_through_router(router: str, decode_servers, tiny_model) -> None:
    model = str(tiny_model)
    via = openai.AsyncOpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
    direct = openai.AsyncOpenAI(base_url=base_url(decode_servers[1]) + "/v1", api_key="unused", max_retries=0)
    try:
        for client in (via, direct):
            assert [m.id async for m in client.models.list()] == [model]
        long_prompt = "import os\n" * 40  # above the threshold; no prefill pool yet -> D prefills locally
        for prompt in (SHORT, long_prompt):
            a = await via.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            b = await direct.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            assert a.choices[0].text == b.choices[0].text
            stream = await via.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            assert "".join([c.choices[0].text async for c in stream if c.choices]) == b.choices[0].text
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a function."}]
        ca = await via.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        cb = await direct.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0
        )
        assert ca.choices[0].message.content == cb.choices[0].message.content
        chat_stream = await via.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in chat_stream if c.choices])
        assert text == cb.choices[0].message.content
        with pytest.raises(openai.BadRequestError):
            await via.completions.create(model=model, prompt="x " * 2000, max_tokens=4)
    finally:
        await via.close()
        await direct.close()


async def test_decode_killed_mid_stream_other_decode_continues(
    router: str, router_proc: ManagedServer, decode_servers, tiny_model
) -> None:
    """SIGKILL the decode server that serves a stream; the client's stream goes on without loss or repeats.

    The router resumes completions token-exactly (prompt ids + delivered ids), so with greedy sampling the
    stream equals an uninterrupted run on the surviving server.
    """
    model, prompt, max_tokens = str(tiny_model), "class Stack:\n    def push(self, item):", 400
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    by_url = {base_url(d): d for d in decode_servers}
    ids: list[int] = []
    event_ids: set[str] = set()
    killed: ManagedServer | None = None
    timeout = aiohttp.ClientTimeout(total=180)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(router + "/v1/completions", json=body) as r,
    ):
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            event_ids.add(chunk["id"])
            ids += chunk["choices"][0]["token_ids"]
            if killed is None and len(ids) >= 3:
                async with s.get(router + "/admin/workers") as w:
                    busy = [
                        x["url"] for x in (await w.json())["workers"] if x["role"] == "decode" and x["active"]
                    ]
                assert len(busy) == 1, "the stream ended before the kill: make it longer"
                killed = by_url[busy[0]]
                killed.kill(signal.SIGKILL)
    assert killed is not None
    survivor = next(d for d in decode_servers if d is not killed)
    assert "pd_router_decode_resumes_total 1.0" in await _metrics(router)
    assert re.search(r"resuming a broken stream on \S+ after \d+ tokens", router_proc.log_path.read_text())
    assert len(event_ids) == 1  # one stream id throughout
    direct = {k: v for k, v in body.items() if k != "stream"}
    _, out = await _post(base_url(survivor), "/v1/completions", direct)
    assert ids == json.loads(out)["choices"][0]["token_ids"]  # nothing lost, nothing repeated
    assert len(ids) == max_tokens
