"""A streamed chat whose decode server is SIGKILLed mid-stream, resumed token-exactly on the other one.

pd-router (a real process) in front of two real vLLM CPU decode servers on the tiny model (short prompts stay
on D, so no P is needed). The router continues the broken chat as a ``/v1/completions`` request whose prompt
is the chat's prompt ids (the template applied, as the first D reported them) plus the ids delivered, and
rewrites that worker's events as the chat's own chunks (``router/streaming.py``: ``continuation``, ``Seam``).
Proven: the client's stream is one chat stream (one id, ``chat.completion.chunk`` throughout, one role chunk,
one ``[DONE]``) whose token ids and text equal the surviving server's greedy answer to the same chat, asked
directly: nothing lost, nothing repeated, no character garbled at the seam.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from tokenizers import Tokenizer

from integration_tests import decode_pair
from pd_disagg.engines import base_url
from pd_disagg.servers import ManagedServer
from router.requests import parse
from router.streaming import Seam, Stitcher, StreamState, as_completion, continuation
from router.tokenize import PromptTokenizer

MAX_MODEL_LEN = 1024
#: Long enough that D is still generating when the client kills it (at ~4 ms a token here, 400 tokens were
#: once all generated before the kill landed, and the stream ended without a resume).
MAX_TOKENS = 900


@pytest.fixture(scope="module")
def decodes(start_servers, tiny_model: Path, log_dir: Path) -> list[ManagedServer]:
    return start_servers(*decode_pair.decode_servers(tiny_model, log_dir, "chat-resume", MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def router(start_servers, tmp_path_factory, tiny_model: Path, log_dir: Path, decodes) -> ManagedServer:
    config = tmp_path_factory.mktemp("chat-resume") / "router.toml"
    (server,) = start_servers(decode_pair.decode_router(config, tiny_model, log_dir, MAX_MODEL_LEN, decodes))
    return server


async def _sse(url: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def test_a_seam_inside_a_character_reads_as_the_uninterrupted_chat(
    decodes: list[ManagedServer], tiny_model: Path
) -> None:
    """Deterministic, no kill: a chat stream cut after ``k`` tokens, where token ``k`` is part of a multi-byte
    character (its bytes streamed no text), is continued on the other server as ``continuation`` builds it,
    and its events rewritten as ``Stitcher`` does with a ``Seam``. The stream so far plus the rewritten events
    equal the uninterrupted greedy chat, ids and text. vLLM's own text at that seam is shown to be wrong (it
    re-sends decoded prompt text), which is why the router decodes the seam's character itself."""
    tokenizer = PromptTokenizer(tiny_model)
    d0, d1 = (base_url(d) for d in decodes)
    answer = None
    for topic in ("the river and the city", "music and light", "a letter to the market", "winter evening"):
        body: dict[str, Any] = {
            "model": str(tiny_model),
            "messages": [{"role": "user", "content": f"Write a story about {topic}."}],
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        async with aiohttp.ClientSession() as s, s.post(d0 + "/v1/chat/completions", json=body) as r:
            answer = (await r.json())["choices"][0]
        ids = answer["token_ids"]
        cuts = [k for k in range(1, len(ids) - 4) if tokenizer.text(ids[:k]).endswith("\ufffd")]
        if cuts:
            break
    else:
        pytest.fail("no greedy answer of these prompts has a multi-byte character: the test shows nothing")
    k = cuts[0]
    raw = msgspec.json.encode({**body, "stream": True})
    parsed = await parse("chat", raw, tokenizer, (str(tiny_model),), MAX_MODEL_LEN, 0)
    state = StreamState(need_text=True)
    state.observe_batch(await _sse(d0 + "/v1/chat/completions", {**body, "stream": True, "max_tokens": k}))
    assert state.ids == ids[:k] and state.prompt_ids is not None
    cont = continuation(parsed, state)
    assert cont is not None and as_completion(parsed, cont) and cont["max_tokens"] == 48 - k
    assert state.ids is not None
    stitcher = Stitcher(state, 0, False, Seam(tokenizer.text, state.ids, "".join(state.text)))
    events = await _sse(d1 + "/v1/completions", cont)
    first_text = json.loads(events.split(b"\n\n")[0][6:])["choices"][0]["text"]
    out = stitcher.rewrite_batch(events)
    chunks = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert state.ids == ids  # ids and text: those of the uninterrupted chat
    assert "".join(state.text) == answer["message"]["content"]
    got = chunks[0]["choices"][0]["delta"]
    print(f"seam after {k} tokens: vLLM streamed {first_text[:60]!r}..., the client got {got!r}")


async def test_a_chat_whose_decode_is_killed_resumes_token_exactly_on_the_other(
    router: ManagedServer, decodes: list[ManagedServer], tiny_model: Path
) -> None:
    url = base_url(router)
    body: dict[str, Any] = {
        "model": str(tiny_model),
        "messages": [{"role": "user", "content": "Write a story about the river and the city."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    by_url = {base_url(d): d for d in decodes}
    ids: list[int] = []
    text = ""
    chunks: list[dict[str, Any]] = []
    done = 0
    killed: ManagedServer | None = None
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as s,
        s.post(url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done += 1
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            chunks.append(chunk)
            for choice in chunk["choices"]:
                ids += choice.get("token_ids") or []
                text += choice["delta"].get("content") or ""
            if killed is None and ids:
                async with s.get(url + "/admin/workers") as w:
                    workers = (await w.json())["workers"]
                busy = [x["url"] for x in workers if x["role"] == "decode" and x["active"]]
                assert len(busy) == 1, "the stream ended before the kill: make it longer"
                killed = by_url[busy[0]]
                killed.kill(signal.SIGKILL)
    assert killed is not None
    survivor = next(d for d in decodes if d is not killed)
    pattern = r"resuming a broken stream on \S+ after (\d+) tokens \(chat, token-exact as a completion\)"
    resumed = re.findall(pattern, router.log_path.read_text())
    assert len(resumed) == 1, resumed
    assert done == 1 and {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert sum(1 for c in chunks for ch in c["choices"] if "role" in ch["delta"]) == 1

    direct = {k: v for k, v in body.items() if k != "stream"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(base_url(survivor) + "/v1/chat/completions", json=direct) as r,
    ):
        assert r.status == 200
        want = (await r.json())["choices"][0]
    assert ids == want["token_ids"]  # nothing lost, nothing repeated
    assert len(ids) == MAX_TOKENS
    assert text == want["message"]["content"]  # the text too, the seam's character included
    # Where the seam fell: inside a character (its bytes streamed no text before the kill) or not.
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    seam = int(resumed[0])
    inside = tokenizer.decode(ids[:seam]).endswith("\ufffd")
    print(f"resumed after {seam} tokens, seam inside a character: {inside}")
