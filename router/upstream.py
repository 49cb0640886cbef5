"""HTTP legs from the router to engine workers, and the request bodies each P/D flow sends.

Runs in the router process on its shared ``aiohttp.ClientSession`` (keep-alive pool). A leg either returns the
upstream's answer or raises ``UpstreamError`` saying whether another worker may be tried (``retryable``) and
whether the worker itself is to blame (``worker_fault``, which feeds its circuit breaker). An upstream 4xx is
the client's mistake: it is passed through unchanged and never retried. Bodies follow /work/wt/CONTRACT.md:
``pd-push`` (our connector: transfer id to both legs, sent concurrently), ``vllm-standard`` (P first with
``do_remote_decode``, then D with what P returned) and ``sglang-bootstrap`` (bootstrap host/port/room to
both).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from router.balancer import Worker
from router.config import Flow

_JSON = {"content-type": "application/json"}


class UpstreamError(Exception):
    def __init__(self, kind: str, message: str, status: int = 0, body: bytes = b"") -> None:
        super().__init__(message)
        self.kind = kind  # connect | timeout | status | protocol
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


def headers_for(worker: Worker) -> dict[str, str]:
    if worker.cfg.api_key:
        return {**_JSON, "authorization": f"Bearer {worker.cfg.api_key}"}
    return _JSON


def _wrap(e: BaseException, worker: Worker) -> UpstreamError:
    if isinstance(e, asyncio.TimeoutError):
        return UpstreamError("timeout", f"{worker.role} worker {worker.url} timed out")
    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamError("connect", f"cannot connect to {worker.role} worker {worker.url}")
    return UpstreamError("protocol", f"{worker.role} worker {worker.url} failed: {type(e).__name__}")


async def post_json(
    session: aiohttp.ClientSession, worker: Worker, path: str, body: bytes, timeout: aiohttp.ClientTimeout
) -> tuple[int, bytes]:
    """A non-streamed leg: the whole response body, or ``UpstreamError``."""
    try:
        async with session.post(
            worker.url + path, data=body, headers=headers_for(worker), timeout=timeout
        ) as r:
            data = await r.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise _wrap(e, worker) from None
    if r.status != 200:
        raise UpstreamError(
            "status", f"{worker.role} worker {worker.url} answered {r.status}", r.status, data
        )
    return r.status, data


async def open_stream(
    session: aiohttp.ClientSession, worker: Worker, path: str, body: bytes, timeout: aiohttp.ClientTimeout
) -> aiohttp.ClientResponse:
    """Start a streamed leg; returns the response once its headers said 200 (caller must ``release()``)."""
    try:
        resp = await session.post(worker.url + path, data=body, headers=headers_for(worker), timeout=timeout)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise _wrap(e, worker) from None
    if resp.status != 200:
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            data = b""
        finally:
            resp.release()
        raise UpstreamError(
            "status", f"{worker.role} worker {worker.url} answered {resp.status}", resp.status, data
        )
    return resp


async def read_event(resp: aiohttp.ClientResponse, worker: Worker) -> bytes:
    """The next SSE event (``data: ...\\n\\n``, separator included), or b"" at a clean end of stream."""
    try:
        return await resp.content.readuntil(b"\n\n")
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        raise _wrap(e, worker) from None


async def read_some(resp: aiohttp.ClientResponse, worker: Worker) -> bytes:
    """Whatever bytes of the stream have arrived (waits for at least one), or b"" at its end."""
    try:
        return await resp.content.readany()
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise _wrap(e, worker) from None


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
        out["kv_transfer_params"] = {"pd_transfer_id": transfer, "pd_role": "prefill"}
    elif flow == "vllm-standard":
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
    else:
        out.update(sglang_fields(prefill, room))
    return msgspec.json.encode(out)


def decode_body(
    body: dict[str, Any], flow: Flow, transfer: str, prefill: Worker, room: int, returned: Any = None
) -> dict[str, Any]:
    """What D gets on the disaggregated path (``returned``: P's kv_transfer_params in vllm-standard)."""
    out = dict(body)
    if flow == "pd-push":
        out["kv_transfer_params"] = {
            "pd_transfer_id": transfer,
            "pd_role": "decode",
            "pd_prefill_addr": prefill.cfg.bootstrap,
        }
    elif flow == "vllm-standard":
        out["kv_transfer_params"] = returned
    else:
        out.update(sglang_fields(prefill, room))
    return out


def sglang_fields(prefill: Worker, room: int) -> dict[str, Any]:
    host = (
        prefill.cfg.bootstrap.rsplit(":", 1)[0] if prefill.cfg.bootstrap else urlsplit(prefill.url).hostname
    )
    return {"bootstrap_host": host, "bootstrap_port": prefill.cfg.bootstrap_port, "bootstrap_room": room}


def bootstrap_room(rng: random.Random) -> int:
    return rng.getrandbits(63)


def returned_params(data: bytes) -> Any:
    """``kv_transfer_params`` from P's JSON answer (vllm-standard), or raise ``UpstreamError``."""
    try:
        params = msgspec.json.decode(data).get("kv_transfer_params")
    except (msgspec.DecodeError, AttributeError):
        raise UpstreamError("protocol", "prefill answer is not a JSON object") from None
    if params is None:
        raise UpstreamError("protocol", "prefill answer carries no kv_transfer_params")
    return params
