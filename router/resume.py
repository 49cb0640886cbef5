"""Continuing a stream whose decode worker failed after the client got its first bytes.

Called by ``proxy.py`` once a relayed stream broke (router process, the request's coroutine). The client keeps
its stream: the continuation (``streaming.continuation``: the prompt plus the tokens delivered so far; a chat
as a token-id ``/v1/completions`` request where the ids are known) goes to another decode worker, at most
``retry.max_resumes`` times, and ``streaming.Stitcher`` makes its events read as the rest of the first stream
(a chat's as chat chunks). The continuation goes to D alone, which prefills the prompt and the delivered
tokens itself, or, where D cannot prefill (sglang-bootstrap), P->D like a new request. A stream that cannot be
resumed ends with an OpenAI error event, one whose tokens were all delivered as vLLM would end it.
"""

from __future__ import annotations

import logging

import msgspec

from router.balancer import Worker
from router.comeback import Choice, Comeback, choose
from router.downstream import Downstream
from router.legs import Legs, cancel
from router.relay import ClientStream, relay, write, write_error
from router.requests import Parsed
from router.streaming import DONE, Seam, Stitcher, StreamState, Unresumable, as_completion, continuation
from router.upstream import UpstreamError

# The request's own logger: everything that happens to one request logs under one name, as before the split.
log = logging.getLogger("router.proxy")


async def resume(
    legs: Legs,
    stream: ClientStream,
    parsed: Parsed,
    path: str,
    err: UpstreamError,
    failed: set[Worker],
    comeback: Comeback,
) -> None:
    """Continue a broken stream on other decode workers (waiting for one to come back where none is usable,
    ``comeback``: the request's, shared with its attempts); if impossible, end it with an error event."""
    client, state, strip = stream.client, stream.state, stream.strip
    cfg, balancer, metrics = legs.cfg, legs.balancer, legs.metrics
    alone = cfg.decode_prefills()  # else SGLang's D cannot prefill the continuation itself: it goes P->D

    def pick() -> Choice:
        return choose(
            balancer, cfg.policy.decode_max_active, failed, wants_prefill=not alone, needs_prefill=not alone
        )

    for _ in range(cfg.retry.max_resumes if state is not None else 0):
        assert state is not None
        try:
            body = continuation(parsed, state, cfg.model.max_model_len)
        except Unresumable as e:
            log.warning("not resuming a broken stream after %d tokens: %s", state.tokens, e)
            await _give_up(client, f"{err}; {e}")
            return
        if body is None or state.finished:
            await _finish(client, state, parsed)
            return
        comeback.saw(failed)
        decode, prefill, missing = await comeback.find(balancer, failed, pick)
        if decode is None or missing:
            break
        metrics.resumes.inc()
        seam, leg_path, how = None, path, str(parsed.kind)
        if as_completion(parsed, body):  # a chat continued token-exactly: its events become chat chunks
            assert parsed.text_of_ids is not None and state.ids is not None
            seam, leg_path = Seam(parsed.text_of_ids, state.ids, "".join(state.text)), "/v1/completions"
            how = "chat, token-exact as a completion"
        elif parsed.kind == "chat":
            how = "chat, from its text"
        log.warning(
            "resuming a broken stream on %s after %d tokens (%s): %s", decode.url, state.tokens, how, err
        )
        ids_asked = strip or "return_token_ids" in parsed.body or seam is not None
        extra = {"return_token_ids": True} if ids_asked else {}
        stitcher = Stitcher(state, await parsed.exact_prompt_tokens(), strip, seam)
        tokens = parsed.prompt_tokens + state.tokens
        d_body, _, p_task = await legs.start(leg_path, body, None, tokens, prefill, failed, extra)
        try:
            with balancer.lease(decode):
                try:
                    resp, first = await legs.guarded(p_task, legs.first_event(decode, leg_path, d_body))
                except UpstreamError as e:
                    legs.blame(e, decode, prefill, failed)
                    err = e
                    continue
                try:
                    result = await relay(stream, resp, decode, first, stitcher)
                finally:
                    resp.close()
        finally:
            cancel(p_task)
        if result is None:
            decode.circuit.record_success()
            return
        legs.fail(decode, result, failed)
        err = result
    await _give_up(client, str(err))


async def _give_up(client: Downstream, why: str) -> None:
    """End a broken stream that cannot be resumed with an OpenAI error event saying why."""
    await write_error(client, f"the decode worker failed mid-stream and could not be resumed: {why}")


async def _finish(client: Downstream, state: StreamState, parsed: Parsed) -> None:
    """All tokens were delivered before the worker died: close the stream as vLLM would."""
    opts = parsed.body.get("stream_options")
    if isinstance(opts, dict) and opts.get("include_usage"):
        prompt_tokens = await parsed.exact_prompt_tokens()
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + state.tokens,
            "completion_tokens": state.tokens,
        }
        obj = "text_completion" if parsed.kind == "completions" else "chat.completion.chunk"
        chunk = {
            "id": state.id,
            "object": obj,
            "created": state.created,
            "model": parsed.body["model"],
            "choices": [],
            "usage": usage,
        }
        await write(client, b"data: " + msgspec.json.encode(chunk) + b"\n\n")
    await write(client, DONE)
