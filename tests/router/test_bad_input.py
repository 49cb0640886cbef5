"""Bad client input gets an OpenAI-style 4xx, never a 500; API keys are enforced and never logged."""

from __future__ import annotations

import logging

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.requests import MAX_JSON_DEPTH
from tests.router.conftest import MODEL, long_prompt


async def _error(resp, status: int, param: str | None = None) -> str:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"model": "fake-model", "prompt": "a", "max_tokens": "5"}', 400, "max_tokens"),
        (b'{"model": "fake-model", "prompt": 7}', 400, "prompt"),
        (b'{"model": "fake-model", "prompt": "a", "stream": "yes"}', 400, "stream"),
        (b'{"model": "fake-model", "prompt": "a", "max_tokens": true}', 400, "max_tokens"),
        (b'{"model": "nope", "prompt": "a"}', 404, "model"),
        (b'{"prompt": "a"}', 400, "model"),
        (b'{"model": "fake-model", "prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"model": "fake-model", "prompt": "a", "max_tokens": -3}', 400, "max_tokens"),
        (b'{"model": "fake-model", "prompt": ""}', 400, "prompt"),
        (b'{"model": "fake-model", "prompt": [[1, "x"]]}', 400, "prompt"),
        (b'{"model": "fake-model", "prompt": "a", "n": 0}', 400, "n"),
    ],
)
async def test_bad_completion_requests(make_cluster, body: bytes, status: int, param: str | None) -> None:
    c = await make_cluster(n_decode=1)
    resp = await c.router.post("/v1/completions", data=body, headers={"content-type": "application/json"})
    await _error(resp, status, param)
    assert c.decode[0].requests == []  # nothing reached an engine


def _nested(depth: int) -> bytes:
    """A completion body whose ``x`` field makes it ``depth`` levels deep (the body itself is one)."""
    levels = depth - 1
    return b'{"model": "fake-model", "prompt": "a", "max_tokens": 1, "x": %b%b}' % (
        b"[" * levels,
        b"]" * levels,
    )


async def _still_serves(c) -> None:
    r = await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert r.status == 200


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5000 + b"]" * 5000,  # deeper than msgspec can decode within Python's recursion limit
        b"[" * 5000,
        _nested(5000),
        _nested(950),  # decodes, but would not re-encode for a leg deeper in the stack
        _nested(MAX_JSON_DEPTH + 1),
        b'{"model": "fake-model", "prompt": "a", "x": %b}' % (b'{"a":' * 300 + b"1" + b"}" * 300),
    ],
)
async def test_deeply_nested_bodies_get_400(make_cluster, body: bytes) -> None:
    c = await make_cluster(n_decode=1)
    resp = await c.router.post("/v1/completions", data=body, headers={"content-type": "application/json"})
    assert "nested" in await _error(resp, 400)
    assert c.decode[0].requests == []
    await _still_serves(c)


@pytest.mark.parametrize("prompt", ["a", long_prompt()])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_body_nested_to_the_limit_is_served(make_cluster, prompt: str, stream: bool) -> None:
    """Local and P/D legs, with a transfer field to drop: every re-encoding of the body succeeds."""
    c = await make_cluster(n_decode=1)
    body = msgspec.json.decode(_nested(MAX_JSON_DEPTH))
    body.update(prompt=prompt, stream=stream, kv_transfer_params={"do_remote_decode": True})
    r = await c.router.post("/v1/completions", json=body)
    assert r.status == 200, await r.text()
    await r.read()
    assert c.decode[0].requests[-1]["x"] == body["x"]


async def test_admin_api_refuses_deep_bodies_too(make_cluster) -> None:
    c = await make_cluster(n_decode=1)
    resp = await c.router.post(
        "/admin/workers", data=b"[" * 5000, headers={"content-type": "application/json"}
    )
    await _error(resp, 400)


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonl",
        None,
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_body_not_declared_json_gets_415(make_cluster, path: str, content_type: str | None) -> None:
    """As vLLM's own server: only application/json, and no Content-Type at all is refused too."""
    c = await make_cluster(n_decode=1)
    body = {"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    headers = {} if content_type is None else {"Content-Type": content_type}
    resp = await c.router.post(
        path, data=msgspec.json.encode(body), headers=headers, skip_auto_headers=["Content-Type"]
    )
    assert "application/json" in await _error(resp, 415)
    assert (await resp.json())["error"]["type"] == "UnsupportedMediaTypeError"
    assert c.decode[0].requests == []
    await _still_serves(c)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
async def test_json_media_type_parameters_and_case_are_accepted(make_cluster, content_type: str) -> None:
    c = await make_cluster(n_decode=1)
    body = msgspec.json.encode({"model": MODEL, "prompt": "a", "max_tokens": 1})
    resp = await c.router.post("/v1/completions", data=body, headers={"Content-Type": content_type})
    assert resp.status == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"content": "hi"}]}, "role"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_tokens",
        ),
    ],
)
async def test_bad_chat_requests(make_cluster, body, param) -> None:
    c = await make_cluster(n_decode=1)
    await _error(await c.router.post("/v1/chat/completions", json=body), 400, param)


async def test_prompt_longer_than_context(make_cluster) -> None:
    c = await make_cluster(n_decode=1, model__max_model_len=50)
    long = " ".join(["w"] * 60)
    msg = await _error(
        await c.router.post("/v1/completions", json={"model": MODEL, "prompt": long}), 400, "input_tokens"
    )
    assert "maximum context length is 50" in msg
    # fits alone but not with max_tokens
    await _error(
        await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 48}),
        400,
    )
    assert (
        await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 47})
    ).status == 200


async def test_body_too_large(make_cluster) -> None:
    c = await make_cluster(n_decode=1, server__max_body_bytes=1000)
    resp = await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 2000})
    assert "exceeds 1000 bytes" in await _error(resp, 413)


async def test_unknown_path_and_method(make_cluster) -> None:
    c = await make_cluster(n_decode=1)
    await _error(await c.router.get("/v1/nothing"), 404)
    await _error(await c.router.get("/v1/completions"), 405)


async def test_upstream_4xx_is_passed_through_not_retried(make_cluster) -> None:
    c = await make_cluster(n_decode=2)
    for d in c.decode:
        d.fail_status = 400
    resp = await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert await _error(resp, 400) == "injected failure"
    assert sum(len(d.requests) for d in c.decode) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.dictionaries(
        st.sampled_from(
            ["model", "prompt", "messages", "max_tokens", "stream", "n", "max_completion_tokens"]
        ),
        st.recursive(
            st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=5),
            lambda inner: (
                st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
            ),
            max_leaves=6,
        ),
    ),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
)
async def test_fuzzed_bodies_never_500(make_cluster, body, path) -> None:
    # one cluster per example would be slow: reuse via a cache on the fixture function
    c = _CACHE.get("c") or await make_cluster(n_decode=1)
    _CACHE["c"] = c
    resp = await c.router.post(path, json=body)
    assert resp.status < 500, await resp.text()
    if resp.status >= 400:
        await _error(resp, resp.status)


_CACHE: dict = {}


@pytest.fixture(autouse=True)
def _reset_cache():
    _CACHE.clear()
    yield
    _CACHE.clear()


async def test_api_keys_enforced_and_never_logged(make_cluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    c = await make_cluster(n_decode=1, server__api_keys=["sk-router-secret"])
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    await _error(await c.router.post("/v1/completions", json=body), 401)
    bad = await c.router.post(
        "/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong-guess"}
    )
    await _error(bad, 401)
    ok = await c.router.post(
        "/v1/completions", json=body, headers={"Authorization": "Bearer sk-router-secret"}
    )
    assert ok.status == 200
    assert (await c.router.get("/health")).status == 200  # probes need no key
    assert (await c.router.get("/admin/workers")).status == 403  # no admin key set: closed to clients
    client_key = {"Authorization": "Bearer sk-router-secret"}
    added = {"role": "decode", "worker": {"url": "http://127.0.0.1:9"}}
    await _error(await c.router.post("/admin/workers", json=added, headers=client_key), 403)
    c.decode[0].fail_status = 503  # failures are logged: still without keys
    await c.router.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-router-secret"})
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "attempt" in logged
    assert "sk-router-secret" not in logged and "sk-wrong-guess" not in logged


async def test_the_admin_api_takes_admin_keys_never_client_keys(make_cluster) -> None:
    """A client key must not add a worker (it would choose where requests and their KV go)."""
    c = await make_cluster(n_decode=1, server__api_keys=["sk-client"], server__admin_keys=["sk-admin"])
    added = {"role": "decode", "worker": {"url": "http://127.0.0.1:9"}}
    for key in ("", "sk-client", "sk-wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        await _error(await c.router.post("/admin/workers", json=added, headers=headers), 401)
        await _error(await c.router.get("/admin/workers", headers=headers), 401)
    admin = {"Authorization": "Bearer sk-admin"}
    listed = await c.router.get("/admin/workers", headers=admin)
    assert listed.status == 200 and len(await listed.json()) == 1
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    await _error(await c.router.post("/v1/completions", json=body, headers=admin), 401)  # not a client key
    ok = await c.router.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-client"})
    assert ok.status == 200
