"""HTTP legs from the router to engine workers, and the request bodies each P/D flow sends.

Runs in the router process on its shared keep-alive connection pool (``http1.Pool``). A leg either returns the
upstream's answer or raises ``UpstreamError`` saying whether another worker may be tried (``retryable``) and
whether the worker itself is to blame (``worker_fault``, which feeds its circuit breaker). An upstream 4xx is
the client's mistake: it is passed through unchanged and never retried. Bodies follow docs/wire-contract.md:
``pd-push`` (our connector: transfer id to both legs, sent concurrently), ``vllm-standard`` (P first with
``do_remote_decode``, then D with what P returned: PDConnector's or NixlConnector's answer, re-encoded) and
``sglang-bootstrap`` (bootstrap host/port/room to both).
"""

from __future__ import annotations

import asyncio
import functools
import random
import uuid
from typing import Any
from urllib.parse import urlsplit

import msgspec

from pd_connector import wire
from router.balancer import Worker
from router.config import Flow
from router.http1 import HttpError, Pool, Response


class UpstreamError(Exception):
    def __init__(self, kind: str, message: str, status: int = 0, body: bytes = b"") -> None:
        super().__init__(message)
        self.kind = kind  # connect | timeout | status | protocol | error_event
        self.status = status
        self.body = body

    @property
    def client_error(self) -> bool:
        """An upstream 4xx: the request itself is bad; pass it to the client as is."""
        return self.kind == "status" and 400 <= self.status < 500 and self.status != 429

    @property
    def retryable(self) -> bool:
        return not self.client_error

    @property
    def worker_fault(self) -> bool:
        return not self.client_error and self.status != 429


class ErrorEvent(UpstreamError):
    """A worker's stream carried an OpenAI error event where the next tokens were due (``relay``): the stream
    is resumed from what the client has. Not held against the worker, which keeps serving: vLLM ends a
    first-token-seeded request that way when its KV load failed on P's side (docs/wire-contract.md)."""

    def __init__(self, message: str) -> None:
        super().__init__("error_event", message)

    @property
    def worker_fault(self) -> bool:
        return False


@functools.lru_cache(maxsize=1024)
def _target(url: str, path: str, api_key: str | None) -> tuple[tuple[str, int, bool], bytes]:
    """Pool key and request head up to Content-Length of a JSON POST (cached: the same few per worker).

    The worker's API key, if any, goes only to that worker.
    """
    key = Pool.key(url)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = f"POST {path} HTTP/1.1\r\nHost: {key[0]}:{key[1]}\r\nContent-Type: application/json\r\n{auth}"
    return key, head.encode("latin-1")


def wrap_error(e: HttpError, worker: Worker) -> UpstreamError:
    """A transport or protocol failure of a leg to ``worker`` as the ``UpstreamError`` retries act on."""
    if e.kind == "timeout":
        return UpstreamError("timeout", f"{worker.role} worker {worker.url} timed out")
    if e.kind == "connect":
        return UpstreamError("connect", f"cannot connect to {worker.role} worker {worker.url}")
    return UpstreamError("protocol", f"{worker.role} worker {worker.url} failed: {e}")


@functools.lru_cache(maxsize=1024)
def _health_target(url: str) -> tuple[tuple[str, int, bool], bytes]:
    key = Pool.key(url)
    return key, f"GET /health HTTP/1.1\r\nHost: {key[0]}:{key[1]}\r\n\r\n".encode("latin-1")


async def check_health(pool: Pool, url: str, timeout_s: float) -> bool:
    """One ``GET {url}/health`` (vLLM and SGLang both answer 200 when ready), called by the health checker.

    It goes over the legs' own keep-alive pool on purpose: a health round every ``health.interval_s`` keeps
    a connection to each worker in use, so the first request after a quiet spell finds a live one instead
    of paying for a new connection (about 1 ms on loopback, measured in docs/performance-history.md
    ``## router``).
    """
    key, head = _health_target(url)
    resp: Response | None = None
    try:
        async with asyncio.timeout(timeout_s):
            resp = await pool.request(key, head, b"")
            await resp.read()  # to the end: the connection goes back to the pool
        return resp.status == 200
    except (TimeoutError, HttpError):
        return False
    finally:
        if resp is not None:
            resp.close()  # nothing to do after a complete read; otherwise the connection is dropped


async def _send(pool: Pool, worker: Worker, path: str, body: bytes) -> Response:
    key, head = _target(worker.url, path, worker.cfg.api_key)
    try:
        return await pool.request(key, head + b"Content-Length: %d\r\n\r\n" % len(body), body)
    except HttpError as e:
        raise wrap_error(e, worker) from None


async def _status_error(resp: Response, worker: Worker) -> UpstreamError:
    """A non-200 answer as ``UpstreamError``, with its body (passed to the client for a 4xx)."""
    try:
        data = await resp.read()
    except HttpError:
        data = b""
    finally:
        resp.close()
    return UpstreamError(
        "status", f"{worker.role} worker {worker.url} answered {resp.status}", resp.status, data
    )


async def post_json(pool: Pool, worker: Worker, path: str, body: bytes) -> bytes:
    """A non-streamed leg: the whole response body, or ``UpstreamError``."""
    resp = await _send(pool, worker, path, body)
    if resp.status != 200:
        raise await _status_error(resp, worker)
    try:
        return await resp.read()
    except HttpError as e:
        raise wrap_error(e, worker) from None
    finally:
        resp.close()


async def open_stream(pool: Pool, worker: Worker, path: str, body: bytes) -> Response:
    """Start a streamed leg; returns the response once its headers said 200 (caller must ``close()``)."""
    resp = await _send(pool, worker, path, body)
    if resp.status != 200:
        raise await _status_error(resp, worker)
    return resp


async def read_event(resp: Response, worker: Worker) -> bytes:
    """The next SSE event (``data: ...\\n\\n``, separator included), or what is left at the end of the stream."""
    try:
        return await resp.read_until(b"\n\n")
    except HttpError as e:
        raise wrap_error(e, worker) from None


# ---- request bodies per flow -------------------------------------------------------------------------------


def transfer_id() -> str:
    return uuid.uuid4().hex


def prefill_body(body: dict[str, Any], flow: Flow, transfer: str, prefill: Worker, room: int) -> bytes:
    """What P gets: the client's request reduced to a one-token, non-streamed prefill."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    if flow == "pd-push":
        out[wire.KV_TRANSFER_PARAMS] = wire.encode(wire.PushPrefill(transfer))
    elif flow == "vllm-standard":
        out[wire.KV_TRANSFER_PARAMS] = wire.encode(wire.StandardPrefill())
    else:
        out.update(sglang_fields(prefill, room))
    return msgspec.json.encode(out)


#: What P may answer in vllm-standard: PDConnector's params, or vLLM's NixlConnector's.
Returned = wire.PrefillReturned | wire.NixlReturned


def decode_body(
    body: dict[str, Any],
    flow: Flow,
    transfer: str,
    prefill: Worker,
    room: int,
    returned: Returned | None = None,
    seed: bool = False,
    stream_first: bool = False,
) -> dict[str, Any]:
    """What D gets on the disaggregated path (``returned``: what P answered in vllm-standard; ``seed``: continue
    from P's first token, ``router.seeding``, which only PDConnector's D can; ``stream_first`` (pd-push, with
    ``seed``): D's stream carries that token first)."""
    out = dict(body)
    if flow == "pd-push":
        push = wire.PushDecode(
            transfer, prefill.cfg.bootstrap, pd_seed_first_token=seed, pd_stream_first_token=stream_first
        )
        out[wire.KV_TRANSFER_PARAMS] = wire.encode(push)
    elif flow == "vllm-standard":
        assert returned is not None
        if isinstance(returned, wire.PrefillReturned):
            returned = msgspec.structs.replace(returned, pd_seed_first_token=seed)
        else:
            assert not seed, "NixlConnector's D cannot continue from P's first token"
        out[wire.KV_TRANSFER_PARAMS] = wire.encode(returned)
    else:
        out.update(sglang_fields(prefill, room))
    return out


def prefill_host(prefill: Worker) -> str:
    """The host a prefill worker's engine is reached at: its configured ``bootstrap``'s host, else its URL's."""
    if prefill.cfg.bootstrap:
        return prefill.cfg.bootstrap.rsplit(":", 1)[0]
    return urlsplit(prefill.url).hostname or ""


def sglang_fields(prefill: Worker, room: int) -> dict[str, Any]:
    return {
        "bootstrap_host": prefill_host(prefill),
        "bootstrap_port": prefill.cfg.bootstrap_port,
        "bootstrap_room": room,
    }


def bootstrap_room(rng: random.Random) -> int:
    return rng.getrandbits(63)


def returned_params(data: bytes, prefill: Worker) -> Returned:
    """What ``prefill`` answered in ``kv_transfer_params`` (vllm-standard), or raise ``UpstreamError``.

    Two answers are accepted, each parsed into its Struct, which the caller re-encodes, so D gets the fields
    the contract names and nothing else P (or whatever answers as P) put there: our connector's
    (``wire.PrefillReturned``) and vLLM's NixlConnector's (``wire.NixlReturned``, told apart by its
    ``remote_engine_id``, which PDConnector leaves null). D's NixlConnector dials the ``remote_host`` it is
    given and has no allow-list of its own, so that host must be the prefill worker's (``prefill_host``);
    its port is P's to choose.
    """
    try:
        raw = msgspec.json.decode(data).get(wire.KV_TRANSFER_PARAMS)
    except (msgspec.DecodeError, AttributeError):
        raise UpstreamError("protocol", "prefill answer is not a JSON object") from None
    if isinstance(raw, dict) and raw.get("remote_engine_id") is not None:
        return _nixl_returned(raw, prefill)
    try:
        params = wire.parse_params(raw)
    except wire.BadParams as e:
        raise UpstreamError("protocol", f"prefill answer: {e}") from None
    if not isinstance(params, wire.PrefillReturned):
        raise UpstreamError("protocol", "prefill answer carries no kv_transfer_params for a remote prefill")
    return params


def _nixl_returned(raw: dict[str, Any], prefill: Worker) -> wire.NixlReturned:
    try:
        params = msgspec.convert(raw, wire.NixlReturned, strict=True)
    except msgspec.ValidationError as e:
        raise UpstreamError("protocol", f"prefill answer (NixlConnector): {e}") from None
    if _bare(params.remote_host) != _bare(prefill_host(prefill)):
        raise UpstreamError(
            "protocol",
            f"prefill answer (NixlConnector): remote_host is not {prefill.url}'s host {prefill_host(prefill)}",
        )
    return params


def _bare(host: str) -> str:
    """A host compared as the URL parser spells it: IPv6 without brackets, lower case."""
    return host.strip("[]").lower()


def returned_id(params: Returned) -> str:
    """The id the engines know a vllm-standard transfer by: P's request id, in either connector's answer."""
    return params.pd_transfer_id if isinstance(params, wire.PrefillReturned) else params.remote_request_id
