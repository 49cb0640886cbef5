"""A fake vLLM OpenAI server for router unit tests and the router benchmark: real HTTP, vLLM's exact framing.

It answers ``/health``, ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (streamed and not)
with the JSON and SSE bytes a vLLM 0.32 server sends (field order, ``data: ...\\n\\n`` events, the final
``system_fingerprint``, the usage chunk for ``stream_options.include_usage``, ``data: [DONE]``), checked
against a real server on the tiny model. Generation is deterministic and depends only on the text so far:
the next token is `` w<n>`` where n counts the words in prompt + output, so a stream continued elsewhere from
prompt + partial output produces exactly what an uninterrupted one would (what the router's failover needs).

Knobs on ``FakeEngine`` let tests make it slow, fail with a status, die mid-stream, or report unhealthy; it
records every request body (decoded and as the bytes received) and every leg the client abandoned. Asked to
prefill for a remote decode (vLLM's standard flow), it answers ``kv_transfer_params`` as PDConnector does
(``pd_connector.wire.PrefillReturned``), or ``kv_answer`` when a test sets one. A cluster's fakes may share
``Pairings``: a decode engine then answers a P/D leg only once a prefill engine has taken its partner (same
transfer id or SGLang room; a failing one takes none), as a real D waits for P's KV, so tests see both legs
of a pair whatever order they arrive in (a D that waits ``load_timeout_s`` in vain answers anyway, as a real
one recomputes). A decode leg asked to continue from P's first token (``pd_seed_first_token``) whose P took
it streams the tokens after that one, as a seeded PDConnector D does (its API server never sees the first),
or, asked to stream that token too (``pd_stream_first_token``), every token, P's first.
Runs in-process (aiohttp test server) or as a process:
``python -m test_support.fake_vllm --port 8100`` (the benchmark's upstream).

For the router benchmark (``stamps={}``) it records, per streamed request, when the request arrived and when
its first and its ``[DONE]`` event were handed to the socket, on CLOCK_MONOTONIC (``time.monotonic_ns``,
one clock for all processes of a Linux host), keyed by the prompt's last word (routers forward the prompt
unchanged); with the load generator's own stamps of the same requests they give each request's transit
through whatever sits in between (``benchmarks/router.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from pd_connector import wire

FINGERPRINT = "vllm-0.32.0-c2432dea"
_ids = itertools.count()


def next_token(text: str) -> str:
    return f" w{len(text.split())}"


def generate(text: str, n: int) -> list[str]:
    out = []
    for _ in range(n):
        tok = next_token(text)
        out.append(tok)
        text += tok
    return out


def _transfer_id(params: Any) -> Any:
    return params.get("pd_transfer_id") if isinstance(params, dict) else None


def _pairing_key(body: dict[str, Any]) -> Any:
    """What pairs a P/D leg with its partner: our transfer id, or SGLang's bootstrap room; None: unpaired."""
    transfer = _transfer_id(body.get(wire.KV_TRANSFER_PARAMS))
    return body.get("bootstrap_room") if transfer is None else transfer


class Pairings:
    """The P/D legs a cluster's prefill engines received, for its decode engines to wait on."""

    def __init__(self, load_timeout_s: float = 1.0) -> None:
        self.load_timeout_s = load_timeout_s
        self._received: set[Any] = set()
        self._changed = asyncio.Event()

    def received(self, key: Any) -> None:
        self._received.add(key)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, key: Any) -> bool:
        """Until a prefill engine received the leg ``key`` (True), or ``load_timeout_s`` passed (False: D
        recomputes)."""
        try:
            async with asyncio.timeout(self.load_timeout_s):
                while key not in self._received:
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True


@dataclass
class FakeEngine:
    """State and failure knobs of one fake server (tests set them between requests)."""

    model: str = "fake-model"
    max_model_len: int = 4096
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    default_max_tokens: int = 16
    healthy: bool = True
    fail_status: int = 0  # answer every generation request with this status
    # Close the connection abruptly after this many streamed tokens, or before a non-streamed answer (once).
    die_after_tokens: int = -1
    requests: list[dict[str, Any]] = field(default_factory=list)
    raw_requests: list[bytes] = field(default_factory=list)
    # The side channel a prefill answer names (vllm-standard), and an answer to send instead of ours.
    side_channel: str = "127.0.0.1:7600"
    kv_answer: dict[str, Any] | None = None
    # P: answer, but the KV and first token never reach D (P died right after answering, the link broke).
    lose_kv: bool = False
    # Shared with the cluster's other fakes; ``role`` says whether this one reports legs or waits for them.
    pairings: Pairings | None = None
    role: str = "decode"
    abandoned: int = 0  # legs whose client closed the connection before the end
    finished: int = 0
    # Bench only: prompt's last word -> (arrived, first event, [DONE]) in monotonic ns; None = not recorded.
    stamps: dict[str, tuple[int, int, int]] | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    def take_stamps(self) -> dict[str, tuple[int, int, int]]:
        """The stamps recorded since the last call (then forgotten): ``{key: (arrived, first, done)}``."""
        if self.stamps is None:
            return {}
        data, self.stamps = self.stamps, {}
        return data

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        data = {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": now,
                    "owned_by": "vllm",
                    "root": self.model,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                }
            ],
        }
        return web.json_response(data, dumps=lambda o: msgspec.json.encode(o).decode())

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    @staticmethod
    def _error(status: int, message: str, param: str | None = None) -> web.Response:
        body = {"error": {"message": message, "type": "BadRequestError", "param": param, "code": status}}
        return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrived = time.monotonic_ns()  # the handler runs once the request's head was parsed
        raw = await request.read()
        body = msgspec.json.decode(raw)
        self.raw_requests.append(raw)
        self.requests.append(body)
        if self.fail_status:
            return self._error(self.fail_status, "injected failure")
        if body.get("model") != self.model:
            return self._error(404, f"The model `{body.get('model')}` does not exist.", "model")
        n_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.default_max_tokens
        if not isinstance(n_tokens, int) or n_tokens < 1:
            return self._error(400, f"max_tokens must be at least 1, got {n_tokens}.", "max_tokens")
        if chat:
            text = "".join(str(m.get("content") or "") + " " for m in body["messages"])
            if body.get("continue_final_message"):
                text = text[:-1]
        else:
            text = body["prompt"] if isinstance(body["prompt"], str) else " ".join(map(str, body["prompt"]))
        prompt_tokens = len(text.split())
        tokens = generate(text, n_tokens)
        pairings = self.pairings
        pair = _pairing_key(body) if pairings is not None else None
        if pairings is not None and pair is not None and self.role == "prefill" and not self.lose_kv:
            pairings.received(pair)  # a P that failed above, or loses its KV, sent none: its D waits in vain
        try:
            if pairings is not None and pair is not None and self.role != "prefill":
                loaded = await pairings.wait(pair)
                kv = body.get(wire.KV_TRANSFER_PARAMS)
                if isinstance(kv, dict) and kv.get("pd_seed_first_token"):
                    if not loaded:  # no token to continue from: PDConnector ends the request with an error
                        return await self._generation_error(request, bool(body.get("stream")))
                    # P's first token came with its KV and counts as D's first output: continue after it
                    # (a one-token request still samples one, as vLLM checks max_tokens after sampling),
                    # unless D's stream carries it too (then it is every token P and D made, P's first)
                    if not kv.get("pd_stream_first_token"):
                        tokens = generate(text, max(n_tokens, 2))[1:]
            if self.first_token_delay_s:
                await asyncio.sleep(self.first_token_delay_s)
        except asyncio.CancelledError:  # the client (router) closed the connection: vLLM aborts here
            self.abandoned += 1
            raise
        kv = body.get(wire.KV_TRANSFER_PARAMS)
        returned = None
        if kv and kv.get("do_remote_decode"):  # P in vLLM's standard flow: its request id is the transfer id
            ours = wire.encode(wire.PrefillReturned(f"fake-{next(_ids)}", self.side_channel))
            returned = ours if self.kv_answer is None else self.kv_answer
            transfer = _transfer_id(returned)
            if self.pairings is not None and transfer is not None:
                self.pairings.received(transfer)
        if not body.get("stream"):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s * n_tokens)
            if self.die_after_tokens >= 0:  # the process "dies" before answering
                self.die_after_tokens = -1
                assert request.transport is not None
                request.transport.close()
                return web.Response()
            self.finished += 1
            ids = [token_id(t) for t in tokens] if body.get("return_token_ids") else None
            return _unary(self.model, chat, "".join(tokens), prompt_tokens, len(tokens), returned, ids)
        key = text.split()[-1] if self.stamps is not None and text.split() else None
        return await self._stream(request, body, chat, tokens, prompt_tokens, (key, arrived))

    @staticmethod
    async def _generation_error(request: web.Request, stream: bool) -> web.StreamResponse:
        """vLLM's answer to a request its engine ended with an error: HTTP 500, or, streamed, HTTP 200 with the
        error object as the only event before ``[DONE]``."""
        error = {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
        if not stream:
            return web.json_response({"error": error}, status=500)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write(_event({"error": error}) + b"data: [DONE]\n\n")
        return resp

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        tokens: list[str],
        prompt_tokens: int,
        stamp: tuple[str | None, int],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(_ids):016x}"
        created = int(time.time())
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.model,
        }
        # return_token_ids: the prompt's ids are its word positions, a token's id is the number in " w<n>"
        with_ids = bool(body.get("return_token_ids"))
        prompt_ids = list(range(prompt_tokens)) if with_ids else None
        first_ns = 0
        try:
            if chat:
                first = {
                    **head,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": prompt_ids,
                    "prompt_text": None,
                }
                first_ns = time.monotonic_ns()
                await resp.write(_event(first))
            for i, tok in enumerate(tokens):
                if i == self.die_after_tokens:
                    self.die_after_tokens = -1
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                ids = (
                    ([token_id(tok)], prompt_ids if i == 0 and not chat else None)
                    if with_ids
                    else (None, None)
                )
                event = _event(_chunk(head, chat, tok, i == len(tokens) - 1, *ids))
                first_ns = first_ns or time.monotonic_ns()
                await resp.write(event)
            opts = body.get("stream_options") or {}
            if opts.get("include_usage"):
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "total_tokens": prompt_tokens + len(tokens),
                    "completion_tokens": len(tokens),
                }
                await resp.write(
                    _event({**head, "choices": [], "usage": usage, "system_fingerprint": FINGERPRINT})
                )
            done_ns = time.monotonic_ns()
            await resp.write(b"data: [DONE]\n\n")
            self.finished += 1
            key, arrived = stamp
            if key is not None and self.stamps is not None:
                self.stamps[key] = (arrived, first_ns, done_ns)
        except (asyncio.CancelledError, ConnectionError):
            self.abandoned += 1
            raise
        return resp


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def token_id(tok: str) -> int:
    return int(tok[2:])


def _chunk(
    head: dict[str, Any],
    chat: bool,
    tok: str,
    last: bool,
    ids: list[int] | None,
    prompt_ids: list[int] | None,
) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": tok},
            "logprobs": None,
            "finish_reason": "length" if last else None,
        }
        if last:
            choice["stop_reason"] = None
        choice["token_ids"] = ids
        return {**head, "choices": [choice]}
    choice = {
        "index": 0,
        "text": tok,
        "logprobs": None,
        "finish_reason": "length" if last else None,
        "stop_reason": None,
        "prompt_token_ids": prompt_ids,
        "token_ids": ids,
    }
    out = {**head, "choices": [choice]}
    if last:
        out["system_fingerprint"] = FINGERPRINT
    return out


def _unary(
    model: str, chat: bool, text: str, prompt_tokens: int, n: int, kv: Any, ids: list[int] | None = None
) -> web.Response:
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + n,
        "completion_tokens": n,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    # return_token_ids: as in a stream, the prompt's ids are its word positions
    prompt_ids = list(range(prompt_tokens)) if ids is not None else None
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(_ids):016x}"
    head = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    # vLLM's field order: the choice's own fields, then the shared ones; the answer's prompt fields sit on the
    # choice of a completion and on the answer of a chat completion.
    prompt_fields: dict[str, Any] = {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
    own: dict[str, Any]
    if chat:
        message = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        own, choice_extra, answer_extra = {"message": message}, {}, {**prompt_fields, "prompt_text": None}
    else:
        own, choice_extra, answer_extra = {"text": text}, prompt_fields, {}
    choice = {
        "index": 0,
        **own,
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": ids,
        **choice_extra,
        "routed_experts": None,
    }
    out = {
        **head,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage,
        **answer_extra,
        "kv_transfer_params": kv,
        "ec_transfer_params": None,
        "metrics": None,
    }
    return web.Response(body=msgspec.json.encode(out), content_type="application/json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fake vLLM OpenAI server (router tests and benchmark)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    engine = FakeEngine(model=args.model, token_delay_s=args.token_delay_ms / 1e3)
    web.run_app(engine.app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
