"""What a streamed response has delivered so far, and how a resumed stream is stitched onto it.

The router passes each upstream SSE event to the client byte for byte (vLLM's framing, usage chunk included).
For a resumable request it also decodes each event (a few microseconds with msgspec) to remember the text
and the number of tokens already delivered. If the decode worker fails mid-stream, ``continuation`` builds the
request for another decode worker (completions: prompt + text so far; chat: the partial assistant message,
continued with ``continue_final_message``), and ``Stitcher`` rewrites that worker's events so the client sees
one stream: the original ``id`` and ``created``, no second role chunk, and usage counting both legs.

From vLLM workers the router asks for token ids and hides them again (``strip_token_ids``): token counts are
then exact even when vLLM merges tokens into one event, and a completions stream resumes token-exactly
(prompt ids + delivered ids). Limits (docs/router.md): chat continues at the text level; without ids
(SGLang) tokens are counted one per content event.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from router.requests import Parsed

DONE = b"data: [DONE]\n\n"
_DONE_LINE = b"data: [DONE]"
_PREFIX = b"data: "
_SEP = b"\n\n"


class _Delta(msgspec.Struct):
    content: str | None = None
    role: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # completions: first event


class _Chunk(msgspec.Struct):
    id: str = ""
    created: int = 0
    choices: list[_Choice] = []
    prompt_token_ids: list[int] | None = None  # chat: first event


# vLLM writes these fields as null unless the request asked for them: the router asks (to count tokens
# exactly and resume token-exactly) and puts the null back when the client did not ask. Literal
# replacements (no group template) and a substring test before the rarer pattern keep this cheap per batch.
_IDS = re.compile(rb'"token_ids":\[[0-9,\s]*\]')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":\[[0-9,\s]*\]')


_TOKEN_IDS = re.compile(rb'"token_ids":\[([0-9,\s]*)\]')
_FINISHED = b'"finish_reason":"'


def strip_token_ids(batch: bytes) -> bytes:
    """The events as vLLM would have sent them without ``return_token_ids``."""
    out = _IDS.sub(b'"token_ids":null', batch)
    if b'"prompt_token_ids":[' in out:
        out = _PROMPT_IDS.sub(b'"prompt_token_ids":null', out)
    return out


_decoder = msgspec.json.Decoder(_Chunk)


class StreamState:
    """Tracks one streamed response (resumable requests only)."""

    def __init__(self, need_text: bool = True) -> None:
        # Completions resumed from token ids do not need the text: then events after the first are only
        # scanned for their ids (a regex), not decoded.
        self.need_text = need_text
        self.id = ""
        self.created = 0
        self.text: list[str] = []
        self._tokens = 0
        # Token ids of the prompt and of what was delivered, when the worker sent them (vLLM with
        # return_token_ids); then the continuation is token-exact and the count exact.
        self.prompt_ids: list[int] | None = None
        self._ids: list[int] | None = None
        # The id lists (``b"12,13"``) of events scanned but not converted yet: the relay only collects them
        # (one findall per batch); they become ints when someone reads ``ids`` or ``tokens`` (a resume).
        self._raw_ids: list[bytes] = []
        self.finished = False  # a finish_reason was sent: only usage / [DONE] can follow

    def _settle(self) -> None:
        if self._raw_ids and self._ids is not None:
            found = [int(t) for group in self._raw_ids for t in group.split(b",") if t.strip()]
            self._raw_ids.clear()
            self._ids.extend(found)
            self._tokens += len(found)

    @property
    def ids(self) -> list[int] | None:
        self._settle()
        return self._ids

    @property
    def tokens(self) -> int:
        self._settle()
        return self._tokens

    def observe_batch(self, batch: bytes) -> None:
        """Record the events (``data: ...\\n\\n`` each) of one write to the client."""
        if self._ids is not None and not self.need_text:
            # JSON escapes quotes inside strings, so this pattern only matches real keys.
            self._raw_ids += _TOKEN_IDS.findall(batch)
            if _FINISHED in batch:
                self.finished = True
            return
        for event in batch.split(_SEP):
            if event:
                self.observe(event)

    def observe(self, event: bytes) -> None:
        """Record one event the client has received (with or without its trailing blank line)."""
        if not event.startswith(_PREFIX) or event.rstrip() == _DONE_LINE:
            return
        try:
            chunk = _decoder.decode(event[len(_PREFIX) :])
        except msgspec.DecodeError:
            return
        if not self.id:
            self.id, self.created = chunk.id, chunk.created
        if chunk.prompt_token_ids is not None and self.prompt_ids is None:
            self.prompt_ids = chunk.prompt_token_ids
        for choice in chunk.choices:
            if choice.prompt_token_ids is not None and self.prompt_ids is None:
                self.prompt_ids = choice.prompt_token_ids
            piece = choice.text if choice.delta is None else choice.delta.content
            if choice.token_ids is not None:
                # vLLM may merge several tokens into one event when the client side is slower
                self._settle()
                self._ids = [*(self._ids or ()), *choice.token_ids]
                self._tokens += len(choice.token_ids)
            elif choice.delta is not None and choice.delta.role is not None and not piece:
                continue  # chat's opening role chunk carries no token
            else:
                self._tokens += 1
            if piece:
                self.text.append(piece)
            if choice.finish_reason is not None:
                self.finished = True


class Unresumable(ValueError):
    """The stream cannot be continued exactly where it broke (``continuation``)."""


def continuation(parsed: Parsed, state: StreamState) -> dict[str, Any] | None:
    """The body that continues ``parsed`` on another decode worker, or None when nothing is left to do.

    A chat continues from its text; raises ``Unresumable`` when that text does not carry every token the
    client got: a token that is part of a multi-byte character streams no text until the character is
    complete, so a continuation from the text alone would generate that token again (a wrong answer).
    """
    so_far = "".join(state.text)
    body = dict(parsed.body)  # carries no transfer fields (``Parsed``): the new worker prefills itself
    if parsed.max_tokens is not None:
        left = parsed.max_tokens - state.tokens
        if left <= 0:
            return None
        body["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = left
    if parsed.kind == "completions":
        if state.prompt_ids is not None and state.ids is not None:
            body["prompt"] = state.prompt_ids + state.ids  # token-exact: no re-tokenization at the seam
        else:
            body["prompt"] = body["prompt"] + so_far
        return body
    ids = state.ids
    if ids and parsed.text_of_ids is not None:
        cut = parsed.text_of_ids(ids).count("\ufffd") - so_far.count("\ufffd")
        if cut > 0:
            raise Unresumable(
                f"the stream broke inside a character ({cut} partial character(s) the text does not carry)"
            )
    messages = list(body["messages"])
    if body.get("continue_final_message") and messages:
        last = dict(messages[-1])
        last["content"] = (last.get("content") or "") + so_far
        messages[-1] = last
    else:
        messages.append({"role": "assistant", "content": so_far})
    body["messages"] = messages
    body["add_generation_prompt"] = False
    body["continue_final_message"] = True
    return body


class WorkerErrorEvent(Exception):
    """A continuation worker streamed an OpenAI error event (vLLM's generation error) where tokens were due.

    Raised by ``Stitcher.rewrite_batch`` with ``out``, the batch's events before the error (already observed
    as delivered: the caller must write them), so the error event never reaches the client and the stream can
    be resumed from what it has: D ends a first-token-seeded request that way when its load failed before P's
    token came (docs/wire-contract.md ``## First-token seeding``).
    """

    def __init__(self, out: bytes, message: str) -> None:
        super().__init__(message)
        self.out = out


class Stitcher:
    """Rewrites a continuation worker's events into the original stream."""

    def __init__(self, state: StreamState, prompt_tokens: int, strip_ids: bool) -> None:
        self._state = state
        self._prompt_tokens = prompt_tokens
        self._earlier_tokens = state.tokens
        self._strip_ids = strip_ids
        self._first = True

    def rewrite_batch(self, batch: bytes) -> bytes:
        """``rewrite`` applied to each event of a batch (dropped events vanish); raises ``WorkerErrorEvent``
        at an error event, with the events before it."""
        out: list[bytes] = []
        for event in batch.split(_SEP):
            if not event:
                continue
            message = _error_message(event)
            if message is not None:
                raise WorkerErrorEvent(b"".join(out), message)
            rewritten = self.rewrite(event + _SEP)
            if rewritten is not None:
                out.append(rewritten)
        return b"".join(out)

    def rewrite(self, event: bytes) -> bytes | None:
        """The event to send to the client (None: drop it)."""
        if not event.startswith(_PREFIX) or event == DONE:
            return event
        try:
            chunk = msgspec.json.decode(event[len(_PREFIX) :])
        except msgspec.DecodeError:
            return event
        if not isinstance(chunk, dict):
            return event
        chunk["id"], chunk["created"] = self._state.id, self._state.created
        choices = chunk.get("choices") or []
        if self._first:  # the continuation's prompt ids are not the client's prompt: never show them
            self._first = False
            if "prompt_token_ids" in chunk:
                chunk["prompt_token_ids"] = None
            for c in choices:
                if "prompt_token_ids" in c:
                    c["prompt_token_ids"] = None
        if choices and all(
            isinstance(c.get("delta"), dict) and "role" in c["delta"] and not c["delta"].get("content")
            for c in choices
        ):
            return None  # the second worker's opening role chunk: the client already had one
        usage = chunk.get("usage")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            completion = int(usage["completion_tokens"]) + self._earlier_tokens
            usage.update(
                prompt_tokens=self._prompt_tokens,
                completion_tokens=completion,
                total_tokens=self._prompt_tokens + completion,
            )
        out = _PREFIX + msgspec.json.encode(chunk) + b"\n\n"
        self._state.observe(out)
        return strip_token_ids(out) if self._strip_ids else out


def _error_message(event: bytes) -> str | None:
    """The message of an OpenAI error event (``data: {"error": {...}}``, no choices), None for any other."""
    if not event.startswith(_PREFIX) or b'"error"' not in event:
        return None
    try:
        chunk = msgspec.json.decode(event[len(_PREFIX) :])
    except msgspec.DecodeError:
        return None
    if not isinstance(chunk, dict) or "error" not in chunk or chunk.get("choices"):
        return None
    error = chunk["error"]
    return str(error.get("message") if isinstance(error, dict) else error)
