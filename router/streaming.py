"""What a streamed response has delivered so far, and how a resumed stream is stitched onto it.

The router passes each upstream SSE event to the client byte for byte (vLLM's framing, usage chunk included).
For a resumable request it also decodes each event (a few microseconds with msgspec) to remember the text
and the number of tokens already delivered. If the decode worker fails mid-stream, ``continuation`` builds the
request for another decode worker, and ``Stitcher`` rewrites that worker's events so the client sees one
stream: the original ``id`` and ``created``, no second role chunk, and usage counting both legs.

From vLLM workers the router asks for token ids and hides them again (``strip_token_ids``): token counts are
then exact even when vLLM merges tokens into one event, and the continuation is token-exact: a completion
continues as prompt ids + delivered ids; a chat as a ``/v1/completions`` request of its prompt ids (the
template applied) + delivered ids, whose events ``Stitcher`` turns back into chat chunks, with ``Seam``
decoding a character the seam cut in two. Without ids (SGLang) a completion continues from its text and a chat
from its text as the final assistant message (``continue_final_message``); tokens are then counted one per
content event (docs/router.md, Limits).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from router.requests import Parsed

DONE = b"data: [DONE]\n\n"
_DONE_LINE = b"data: [DONE]"
log = logging.getLogger("router.streaming")

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


#: Chat fields a completion does not take: dropped from a chat continued as a completion.
_CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "tool_choice",
    "parallel_tool_calls",
    "max_completion_tokens",
    "echo",
    "add_special_tokens",
)
#: Chat fields that shape the chat answer beyond its content (tool calls parsed from the text, logprobs in
#: chat's own format): a chat asking for one is continued from its text, never as a completion.
_CHAT_OUTPUT = ("tools", "functions", "logprobs", "top_logprobs")


def continuation(parsed: Parsed, state: StreamState, context: int | None = None) -> dict[str, Any] | None:
    """The body that continues ``parsed`` on another decode worker, or None when nothing is left to do.

    Completions continue from prompt ids + delivered ids where the worker sent them. A chat whose prompt ids
    (the template applied: the worker's own ``prompt_token_ids``, else the router's rendering) and delivered
    ids are known continues token-exactly as a ``/v1/completions`` request with that token-id prompt
    (``as_completion`` says so; ``Stitcher`` with a ``Seam`` turns its events back into chat chunks). Any
    other chat continues from its text as the final assistant message; raises ``Unresumable`` when that text
    does not carry every token the client got: a token that is part of a multi-byte character streams no
    text until the character is complete, so a continuation from the text alone would generate that token
    again (a wrong answer). ``context``: the model's context length, the limit of a chat without one of its
    own continued as a completion (a completion's default is 16 tokens; a chat's, the rest of the context).
    """
    so_far = "".join(state.text)
    body = dict(parsed.body)  # carries no transfer fields (``Parsed``): the new worker prefills itself
    left = None
    if parsed.max_tokens is not None:
        left = parsed.max_tokens - state.tokens
        if left <= 0:
            return None
        body["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = left
    if parsed.kind == "completions":
        prompt = body["prompt"]
        if state.ids is not None and (state.prompt_ids is not None or isinstance(prompt, list)):
            # token-exact: no re-tokenization at the seam (a token-id prompt is its own ids)
            body["prompt"] = (state.prompt_ids if state.prompt_ids is not None else prompt) + state.ids
        elif isinstance(prompt, str):
            body["prompt"] = prompt + so_far
        else:
            raise Unresumable("a token-id prompt continues from token ids, and the worker streamed none")
        return body
    ids = state.ids
    prompt_ids = state.prompt_ids if state.prompt_ids is not None else parsed.prompt_ids
    exact = ids is not None and prompt_ids is not None and (left is not None or context is not None)
    if exact and not any(body.get(f) for f in _CHAT_OUTPUT):
        assert ids is not None and prompt_ids is not None
        for name in (*_CHAT_FIELDS, *_CHAT_OUTPUT):
            body.pop(name, None)
        body["prompt"] = prompt_ids + ids
        body["max_tokens"] = left if left is not None else max(1, (context or 0) - len(body["prompt"]))
        return body
    if ids and parsed.text_of_ids is not None:
        cut = _partial_characters(parsed.text_of_ids, ids, so_far)
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


def _partial_characters(text_of: Callable[[list[int]], str], ids: list[int], delivered_text: str) -> int:
    """How many characters the delivered ``ids`` end inside of: their bytes decode to U+FFFD, which the
    text the client got (``delivered_text``) does not carry (a partial character streams no text)."""
    return text_of(ids).count("\ufffd") - delivered_text.count("\ufffd")


def as_completion(parsed: Parsed, body: dict[str, Any]) -> bool:
    """Whether ``continuation`` made a chat's continuation a token-id ``/v1/completions`` request."""
    return parsed.kind == "chat" and "prompt" in body


#: Token ids before the seam decoded with the ones after it, so a tokenizer that drops a leading space at the
#: start of a decode (SentencePiece's Metaspace) gives the seam's text as the engine would.
_CONTEXT_IDS = 6
#: At most this many delivered ids are the bytes of one character (UTF-8: 4 bytes; one id per byte at worst).
_MAX_PARTIAL_IDS = 4


class Seam:
    """Where a chat continued as a completion joins the first stream, for its text.

    The delivered ids may end inside a multi-byte character (its bytes streamed no text yet). The new worker
    gets those ids as the end of its prompt, and vLLM's detokenizer, primed with the prompt, does not stream
    the character they start as the client needs it (it re-sends decoded prompt text instead). So until the
    character is complete the router decodes the text itself: ``text_of`` (the router's tokenizer, as vLLM
    decodes) over the ids since the seam, with a few ids before as context; after it, the worker's text.
    """

    def __init__(self, text_of: Callable[[list[int]], str], ids: list[int], delivered_text: str) -> None:
        self._text_of = text_of
        partial = _partial_characters(text_of, ids, delivered_text)
        k = 0
        if partial > 0:  # the fewest trailing ids whose removal leaves only text the client has
            k = next(
                (
                    n
                    for n in range(1, min(len(ids), _MAX_PARTIAL_IDS * partial) + 1)
                    if text_of(ids[:-n]).count("\ufffd") == delivered_text.count("\ufffd")
                ),
                0,
            )
        self.pending: list[int] | None = ids[len(ids) - k :] if k else None
        self._context = ids[max(0, len(ids) - k - _CONTEXT_IDS) : len(ids) - k]

    def text(self, new_ids: list[int], worker_text: str) -> str:
        """The text to stream for an event of ``new_ids`` whose worker text is ``worker_text``."""
        if self.pending is None:
            return worker_text
        self.pending += new_ids
        before = self._text_of(self._context)
        full = self._text_of(self._context + self.pending)
        if full.endswith("\ufffd") or not full.startswith(before):
            return ""  # still inside the character (or no clean cut yet): nothing to stream
        self.pending = None
        return full[len(before) :]


def _as_chat_chunk(chunk: dict[str, Any], seam: Seam) -> None:
    """Rewrite a completions chunk (``text_completion``) in place as vLLM's ``chat.completion.chunk``."""
    chunk["object"] = "chat.completion.chunk"
    choices = []
    for c in chunk.get("choices") or []:
        ids = c.get("token_ids")
        text = seam.text(ids if isinstance(ids, list) else [], c.get("text") or "")
        choice: dict[str, Any] = {"index": c.get("index", 0), "delta": {"content": text}}
        choice["logprobs"] = c.get("logprobs")
        choice["finish_reason"] = c.get("finish_reason")
        if c.get("finish_reason") is not None:
            choice["stop_reason"] = c.get("stop_reason")
        choice["token_ids"] = ids
        choices.append(choice)
    chunk["choices"] = choices


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


class FirstToken(NamedTuple):
    """A token the client already has (P's, from P's answer) at the start of a worker's stream: its ids
    (None when unknown) and its text."""

    ids: list[int] | None
    text: str


class Stitcher:
    """Rewrites a continuation worker's events into the original stream."""

    def __init__(
        self,
        state: StreamState,
        prompt_tokens: int,
        strip_ids: bool,
        seam: Seam | None = None,
        skip: FirstToken | None = None,
    ) -> None:
        """``seam``: the worker streams a completion that continues a chat (``as_completion``); its events are
        rewritten as chat chunks. ``skip``: the worker's stream starts with this token, which the client got
        already (first-token seeding, D streaming P's token after P's answer reached the client): it is cut
        out of the worker's first token event, and the worker's usage counts it already."""
        self._state = state
        self._seam = seam
        self._skip = skip
        self._prompt_tokens = prompt_tokens
        self._earlier_tokens = state.tokens - (1 if skip is not None else 0)
        self._strip_ids = strip_ids
        self._first = True

    def rewrite_batch(self, batch: bytes) -> bytes:
        """``rewrite`` applied to each event of a batch (dropped events vanish); raises ``WorkerErrorEvent``
        at an error event, with the events before it."""
        out: list[bytes] = []
        for event in batch.split(_SEP):
            if not event:
                continue
            message = error_message(event)
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
        if self._seam is not None:
            _as_chat_chunk(chunk, self._seam)
        choices = chunk.get("choices") or []
        if self._first:  # the continuation's prompt ids are not the client's prompt: never show them
            self._first = False
            if "prompt_token_ids" in chunk:
                chunk["prompt_token_ids"] = None
            for c in choices:
                if "prompt_token_ids" in c:
                    c["prompt_token_ids"] = None
        if _opens_chat(choices):
            return None  # the second worker's opening role chunk: the client already had one
        if self._skip is not None and choices and _cut(choices[0], self._skip) and "usage" not in chunk:
            self._skip = None
            return None  # nothing left of the worker's first token event
        if choices:
            self._skip = None
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


def _cut(choice: dict[str, Any], token: FirstToken) -> bool:
    """Cut ``token`` out of the front of a chunk's ``choice`` (its first id, its text where the text starts
    with the token's); True when nothing is left (no ids, no text, no finish reason)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids:
        n = len(token.ids) if token.ids else 1
        if token.ids is not None and ids[:n] != token.ids:
            log.warning("a first token's ids %s are not at the start of the worker's %s", token.ids, ids)
        else:
            choice["token_ids"] = ids[n:]
    holder, key = (choice["delta"], "content") if isinstance(choice.get("delta"), dict) else (choice, "text")
    text = holder.get(key)
    if isinstance(text, str) and text.startswith(token.text):
        holder[key] = text[len(token.text) :]
    elif token.text:
        log.warning("a first token's text %r is not at the start of the worker's %r", token.text, text)
    return not choice.get("token_ids") and not holder.get(key) and choice.get("finish_reason") is None


def _opens_chat(choices: Any) -> bool:
    """Whether a chunk's ``choices`` are a chat stream's opening role chunk (a role, no content)."""
    return bool(choices) and all(
        isinstance(c, dict)
        and isinstance(c.get("delta"), dict)
        and "role" in c["delta"]
        and not c["delta"].get("content")
        for c in choices
    )


def opens_chat(event: bytes) -> bool:
    """Whether ``event`` is a chat stream's opening role chunk, which vLLM sends before the first token's
    event (or an error event, when the engine ended the request with an error)."""
    if not event.startswith(_PREFIX):
        return False
    try:
        chunk = msgspec.json.decode(event[len(_PREFIX) :])
    except msgspec.DecodeError:
        return False
    return isinstance(chunk, dict) and _opens_chat(chunk.get("choices"))


def error_message(event: bytes) -> str | None:
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
