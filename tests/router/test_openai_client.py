"""The official ``openai`` client against the router (fake engines behind it)."""

from __future__ import annotations

import openai
import pytest

from test_support.fake_vllm import generate
from tests.router.conftest import MODEL, long_prompt


@pytest.fixture
async def client_and_cluster(make_cluster):
    c = await make_cluster(n_prefill=1, n_decode=2, server__api_keys=["sk-test"])
    client = openai.AsyncOpenAI(base_url=str(c.router.make_url("/v1")), api_key="sk-test", max_retries=0)
    yield client, c
    await client.close()


@pytest.mark.parametrize("prompt", ["hello world", long_prompt()])
async def test_completions(client_and_cluster, prompt: str) -> None:
    client, _ = client_and_cluster
    resp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert resp.choices[0].text == "".join(generate(prompt, 4))
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        usage = chunk.usage or usage
    assert text == "".join(generate(prompt, 4))
    assert usage is not None and usage.completion_tokens == 4


@pytest.mark.parametrize("content", ["hi there", long_prompt()])
async def test_chat(client_and_cluster, content: str) -> None:
    client, _ = client_and_cluster
    messages = [{"role": "user", "content": content}]
    expected = "".join(generate(content + " ", 5))
    resp = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == expected and usage is not None and usage.completion_tokens == 5


async def test_models_and_typed_errors(client_and_cluster) -> None:
    client, c = client_and_cluster
    assert [m.id async for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    bad_key = openai.AsyncOpenAI(base_url=str(c.router.make_url("/v1")), api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad_key.completions.create(model=MODEL, prompt="x", max_tokens=1)
    await bad_key.close()


async def test_stream_survives_decode_death(client_and_cluster) -> None:
    client, c = client_and_cluster
    c.decode[0].die_after_tokens = 2
    c.state.balancer.decode.workers[1].active = 5  # D0 first
    stream = await client.completions.create(model=MODEL, prompt="a b c", max_tokens=8, stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == "".join(generate("a b c", 8))
