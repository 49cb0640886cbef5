"""The legs of one attempt: D's body and P's concurrent leg per flow, D's first event, and who is to blame.

Used by ``proxy.py`` (a request's attempts) and ``resume.py`` (a broken stream's continuations), in the router
process, one coroutine per request. Per flow (docs/wire-contract.md): pd-push sends P and D together with one
transfer id; vllm-standard sends P first and D what P returned, trying other P on failure and prefilling on
D when none succeeds; sglang-bootstrap sends both with one bootstrap room, and a failed P leg aborts D's
(``guarded``), since SGLang's decode server cannot prefill alone. In both vLLM flows a streamed request that
``seeding.applies`` to has D continue from P's first token, which the router streams as soon as P's leg
answered (``seeding.PrefillAnswer``), unless P answered as vLLM's NixlConnector, whose D samples its own first
token: the client then gets D's stream alone, as from vLLM's own proxies. In pd-push, D's own stream carries
P's token too when it can (``seeding.decode_streams_first``), and whichever of P's answer and D's first
token event comes first is the client's first token (``opening``): an idle P's answer is a few ms ahead of
D's stream, a busy P's front end far behind it.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from pd_connector import wire
from router.balancer import Balancer, Worker
from router.config import RouterConfig
from router.http1 import Pool, Response
from router.metrics import RouterMetrics
from router.seeding import NotSeedable, PrefillAnswer, answer_may_lead, applies, decode_streams_first
from router.streaming import Stitcher, StreamState, error_message, opens_chat, strip_token_ids
from router.trace import Stamps
from router.upstream import (
    UpstreamError,
    bootstrap_room,
    decode_body,
    open_stream,
    post_json,
    prefill_body,
    read_event,
    returned_id,
    returned_params,
    transfer_id,
)

T = TypeVar("T")


class PrefillFailed(UpstreamError):
    """The P leg failed and the D leg cannot go on without it (sglang-bootstrap); D is not to blame."""


class Legs:
    """Builds and sends the legs of one attempt; shares the router's settings, workers, pool and metrics."""

    def __init__(
        self,
        cfg: RouterConfig,
        balancer: Balancer,
        upstream: Pool,
        metrics: RouterMetrics,
        rng: random.Random,
    ) -> None:
        self.cfg = cfg
        self.balancer = balancer
        self.upstream = upstream
        self.metrics = metrics
        self.rng = rng

    def fail(self, worker: Worker, e: UpstreamError, failed: set[Worker]) -> None:
        self.metrics.worker_errors.labels(worker.role, worker.url, e.kind).inc()
        if e.worker_fault:
            worker.circuit.record_failure()
            failed.add(worker)

    def blame(self, e: UpstreamError, decode: Worker, prefill: Worker | None, failed: set[Worker]) -> None:
        """Record a failed attempt against the worker that caused it (its P leg was already counted)."""
        if isinstance(e, PrefillFailed):
            if prefill is not None:
                failed.add(prefill)
        else:
            self.fail(decode, e, failed)

    def seeds(self, body: dict[str, Any]) -> bool:
        """Whether a P/D attempt for ``body`` has D continue from P's first token (both vLLM flows)."""
        return self.cfg.flow != "sglang-bootstrap" and applies(body, self.cfg.flow == "pd-push")

    def decode_streams_first(self, body: dict[str, Any]) -> bool:
        """Whether a P/D attempt for ``body`` has D's own stream carry P's first token too (pd-push, seeded,
        no logprobs)."""
        return self.cfg.flow == "pd-push" and self.seeds(body) and decode_streams_first(body)

    def races(self, body: dict[str, Any]) -> bool:
        """Whether P's answer and D's stream race to bring P's token to the client (``opening``): where D's
        stream carries it, but for stop strings (``seeding.answer_may_lead``), where D's stream alone does."""
        return self.decode_streams_first(body) and answer_may_lead(body)

    async def start(
        self,
        path: str,
        body: dict[str, Any],
        raw: bytes | None,
        tokens: int,
        prefill: Worker | None,
        failed: set[Worker],
        extra: dict[str, Any],
        stamps: Stamps | None = None,
    ) -> tuple[bytes, bool, asyncio.Task[bytes] | None]:
        """D's body for ``body`` (plus ``extra`` fields), whether it is the local path, and the P leg: running
        concurrently (pd-push, sglang-bootstrap), or already answered (vllm-standard, when D is seeded).

        ``raw``: ``body``'s bytes when the client sent exactly these (forwarded as they are on the local
        path); ``tokens``: the prompt length P's lease counts; ``stamps``: the request's trace (P->D only).
        A seeded P leg gets ``extra`` too (the token ids the router tracks come from P's answer first).
        """
        local = raw if raw is not None and not extra else msgspec.json.encode({**body, **extra})
        if prefill is None:
            return local, True, None
        flow = self.cfg.flow
        seed = self.seeds(body)
        transfer, room = transfer_id(), bootstrap_room(self.rng)
        p_body = prefill_body({**body, **extra} if seed else body, flow, transfer, prefill, room)
        if stamps is not None:
            stamps.transfer_id = transfer
            stamps.mark("prefill_sent")
        if flow == "vllm-standard":
            for candidate in self._prefill_candidates(prefill, failed):
                try:
                    data = await self._post_prefill(candidate, path, p_body, tokens)
                    params = returned_params(data, candidate)
                    if stamps is not None:  # the engines know this transfer by P's id
                        stamps.transfer_id = returned_id(params)
                        stamps.mark("prefill_returned")
                except UpstreamError as e:
                    self.fail(candidate, e, failed)
                    continue
                seeded = seed and isinstance(params, wire.PrefillReturned)  # NIXL's D cannot be seeded
                d_body = decode_body(body, flow, transfer, candidate, room, params, seeded)
                answered = asyncio.create_task(_answered(data)) if seeded else None
                return msgspec.json.encode({**d_body, **extra}), False, answered
            return local, True, None  # no prefill worker succeeded: D prefills locally
        task = asyncio.create_task(self._post_prefill(prefill, path, p_body, tokens))
        task.add_done_callback(_consume)
        if stamps is not None:
            task.add_done_callback(functools.partial(_returned, stamps))
        stream_first = self.decode_streams_first(body)
        d_body = decode_body(body, flow, transfer, prefill, room, seed=seed, stream_first=stream_first)
        return msgspec.json.encode({**d_body, **extra}), False, task

    def _prefill_candidates(self, first: Worker, failed: set[Worker]) -> list[Worker]:
        others = [w for w in self.balancer.prefill.usable() if w is not first and w not in failed]
        return [first, *others[: self.cfg.retry.max_attempts - 1]]

    async def _post_prefill(self, prefill: Worker, path: str, body: bytes, tokens: int) -> bytes:
        with self.balancer.lease(prefill, tokens):
            try:
                data = await post_json(self.upstream, prefill, path, body)
            except UpstreamError as e:
                self.metrics.prefill_failures.labels(self.cfg.flow).inc()
                if e.worker_fault:
                    prefill.circuit.record_failure()
                self.metrics.worker_errors.labels(prefill.role, prefill.url, e.kind).inc()
                raise
        prefill.circuit.record_success()
        return data

    async def guarded(self, p_task: asyncio.Task[bytes] | None, leg: Awaitable[Any]) -> Any:
        """Await a D leg; in sglang-bootstrap a failed P leg aborts it (SGLang's D cannot prefill alone)."""
        if p_task is None or self.cfg.flow != "sglang-bootstrap":
            return await leg
        d_task = asyncio.ensure_future(leg)
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task.done() and p_task.exception() is not None and not d_task.done():
                d_task.cancel()
                raise PrefillFailed("prefill", "prefill leg failed; SGLang decode cannot continue without it")
            return await d_task
        finally:
            if not d_task.done():
                d_task.cancel()

    async def opening(
        self,
        worker: Worker,
        path: str,
        body: bytes,
        p_task: asyncio.Task[bytes] | None,
        request: dict[str, Any],
        state: StreamState | None,
        strip: bool,
        stamps: Stamps | None = None,
    ) -> tuple[Response, bytes, bytes | asyncio.Task[bytes], Stitcher | None]:
        """D's stream, and what the client gets first: ``(resp, lead, first, stitcher)``.

        Unseeded (``request``, the client's body, not ``seeds``): D's first event (``first_event``).
        Seeded with D's stream carrying P's token too (``decode_streams_first``), whichever comes first is the
        client's first token (with stop strings D's alone counts, ``races``): D's events up to its first past
        a chat's role chunk (relayed as they are; an error there, D having ended the request because P's
        token never reached it, fails the attempt as P's, ``PrefillFailed``), or P's answer, as below, with
        ``first`` the task that reads D's first token events (the relay awaits it once ``lead`` went out) and
        a ``stitcher`` that cuts P's token out of them. Otherwise seeded: D's stream is opened and, once P's
        leg answered, ``lead`` holds P's first token as stream events (ending the stream when that token
        finished the request) and ``stitcher`` makes D's events read as their continuation; ``state`` (when
        the stream is resumable) has recorded the token. A P leg that failed before the client's first
        token, or answered what cannot be streamed, fails the attempt as P's fault (``PrefillFailed``):
        whether D got P's token is unknown then, so the attempt is retried (nothing reached the client yet)
        rather than relayed, on another P or on D alone.
        """
        if p_task is None or not self.seeds(request):
            opened, first = await self.first_event(worker, path, body, stamps)
            return opened, b"", first, None
        d_first: asyncio.Task[tuple[bytes, bytes]] | None = None
        answer = _prefill_answer(p_task)

        async def either(resp: Response) -> bytes | None:
            """P's answer, or None when D's first token events came first (or, with no race, came at all).
            D's stream is open: a P leg that ended before that ended before D's first token event too. A P
            leg that failed first fails the attempt (``answer``), race or not."""
            nonlocal d_first
            d_first = asyncio.ensure_future(_first_token_events(worker, stamps)(resp))
            if not p_task.done():
                await asyncio.wait({p_task, d_first}, return_when=asyncio.FIRST_COMPLETED)
            if not races and not d_first.done() and not _failed(p_task):
                await d_first  # P answered, but its answer may not lead: D's stream alone brings the token
            if d_first.done():
                d_first.result()  # its failure is this attempt's
                return None
            return await answer(resp)

        streams = self.decode_streams_first(request)
        races = streams and answer_may_lead(request)
        source = f"{worker.url} or its prefill"
        try:
            resp, data = await self._open(worker, path, body, stamps, source, either if streams else answer)
        except BaseException:
            if d_first is not None:
                d_first.cancel()
            raise
        if data is None:
            assert d_first is not None
            role, event = d_first.result()
            message = error_message(event)
            if message is not None or not event.endswith(b"\n\n"):
                resp.close()
                why = f"streamed an error ({message})" if message is not None else "closed the stream"
                raise PrefillFailed("error_event", f"{worker.url} {why} before P's first token")
            return resp, b"", role + event, None
        try:
            chat = "messages" in request
            opts = request.get("stream_options")
            usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            limit = request.get("max_completion_tokens", request.get("max_tokens"))
            p_answer = PrefillAnswer.parse(data)
            events, _ = p_answer.first_events(chat, limit if isinstance(limit, int) else None, usage)
            prompt = p_answer.prompt_tokens()
            skip = p_answer.first_token(chat) if d_first is not None else None
        except NotSeedable as e:
            if d_first is not None:
                d_first.cancel()
            resp.close()
            raise PrefillFailed("protocol", str(e)) from None
        if stamps is not None:
            stamps.mark("decode_first_event")  # the first event the client gets: P's token
        state = state or StreamState(need_text=chat)
        state.observe_batch(events)
        lead = strip_token_ids(events) if strip else events
        stitcher = Stitcher(state, prompt, strip, skip=skip)
        if d_first is None:
            return resp, lead, b"", stitcher
        return (
            resp,
            lead,
            asyncio.ensure_future(_events(d_first, worker, self.cfg.timeouts.first_byte_s)),
            stitcher,
        )

    async def first_event(
        self, worker: Worker, path: str, body: bytes, stamps: Stamps | None = None
    ) -> tuple[Response, bytes]:
        """Open D's stream and read its first event within ``timeouts.first_byte_s``."""

        async def first_of(resp: Response) -> bytes:
            first = await read_event(resp, worker)
            if stamps is not None:
                stamps.mark("decode_first_event")
            return first

        resp, first = await self._open(worker, path, body, stamps, worker.url, first_of)
        if not first.endswith(b"\n\n"):
            resp.close()
            raise UpstreamError("protocol", f"{worker.url} closed the stream before the first event")
        return resp, first

    async def _open(
        self,
        worker: Worker,
        path: str,
        body: bytes,
        stamps: Stamps | None,
        source: str,
        then: Callable[[Response], Awaitable[T]],
    ) -> tuple[Response, T]:
        """Open D's stream and await ``then(resp)`` (what the client gets first), both within
        ``timeouts.first_byte_s`` (``source`` names what timed out); the stream is closed on any failure."""
        resp: Response | None = None
        try:
            async with asyncio.timeout(self.cfg.timeouts.first_byte_s):
                if stamps is not None:
                    stamps.mark("decode_sent")
                resp = await open_stream(self.upstream, worker, path, body)
                return resp, await then(resp)
        except TimeoutError:
            if resp is not None:
                resp.close()
            raise UpstreamError("timeout", f"no first token from {source}") from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise


def _first_token_events(
    worker: Worker, stamps: Stamps | None
) -> Callable[[Response], Awaitable[tuple[bytes, bytes]]]:
    """What a stream D leads is read up to before the client gets anything: its first event past a chat's
    opening role chunk (``(role chunk or b"", event)``), so that an error in its place (D ended the request:
    P's token never reached it) fails the attempt instead of reaching the client."""

    async def first(resp: Response) -> tuple[bytes, bytes]:
        role, event = b"", await read_event(resp, worker)
        if opens_chat(event):
            role, event = event, await read_event(resp, worker)
        if stamps is not None:
            stamps.mark("decode_first_event")
        return role, event

    return first


async def _events(d_first: asyncio.Task[tuple[bytes, bytes]], worker: Worker, timeout_s: float) -> bytes:
    """D's first token events, read by ``d_first``, once P's answer was the client's first token; within
    ``timeout_s``, and complete (the relay resumes the stream after P's token otherwise)."""
    try:
        role, event = await asyncio.wait_for(d_first, timeout_s)
    except TimeoutError:
        raise UpstreamError("timeout", f"no first token event from {worker.url} after P's answer") from None
    if not event.endswith(b"\n\n"):
        raise UpstreamError("protocol", f"{worker.url} closed the stream before its first token event")
    return role + event


def _prefill_answer(p_task: asyncio.Task[bytes]) -> Callable[[Response], Awaitable[bytes]]:
    """What a seeded attempt waits for once D's stream is open: P's answer (its first token)."""

    async def answer(_resp: Response) -> bytes:
        try:
            return await p_task
        except UpstreamError as e:  # counted by the P leg
            # P may have finished its prefill and sent D its token all the same (only its answer was lost):
            # D's stream could then start after a token the client never gets.
            raise PrefillFailed(e.kind, f"prefill leg failed before its first token: {e}") from None

    return answer


def _failed(task: asyncio.Task[bytes]) -> bool:
    """A finished P leg that brought no answer."""
    return task.cancelled() or task.exception() is not None


async def _answered(data: bytes) -> bytes:
    """P's answer as a finished leg (vllm-standard answered before D was sent)."""
    return data


def _returned(stamps: Stamps, task: asyncio.Task[bytes]) -> None:
    """A concurrent P leg answered (not when it failed or its attempt ended first)."""
    if not task.cancelled() and task.exception() is None:
        stamps.mark("prefill_returned")


def _consume(task: asyncio.Task[bytes]) -> None:
    """Retrieve a P leg's exception so asyncio does not log it as unhandled (it is already counted)."""
    if not task.cancelled():
        task.exception()


def cancel(task: asyncio.Task[bytes] | None) -> None:
    """Stop a P leg that is still running (its attempt ended)."""
    if task is not None and not task.done():
        task.cancel()
