"""Validate a client's completions / chat body and measure its prompt, before anything goes upstream.

Called by the request handlers in the router process. The body is kept as the client's dict (it is forwarded
unchanged on the direct path, so unknown sampling fields reach the engine untouched); only the fields the
router relies on are type-checked, through a msgspec Struct, so a wrong type yields a 400 that names the field
(``param``) instead of a crash.

The one exception to "unchanged": the P/D transfer fields (``pd_connector.wire.TRANSFER_FIELDS``) are dropped
here, before anything else reads the body. They tell an engine to hold blocks, dial a peer or push KV, so only
the router may set them (docs/architecture.md, trust model); every later path (local, P/D legs, a resumed
stream) builds on the cleaned body. A body without them keeps its raw bytes, which the local path forwards.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import msgspec

from pd_connector.wire import TRANSFER_FIELDS
from router.errors import ApiError, bad_request
from router.tokenize import PromptTokenizer

Kind = Literal["completions", "chat"]


class _Common(msgspec.Struct):
    model: str
    stream: bool = False
    max_tokens: int | None = None
    n: int = 1


class _Completion(_Common):
    # str | list[str] | list[int] | list[list[int]]: msgspec unions allow one array type, checked below.
    prompt: str | list[Any] = ""


class _Message(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Chat(_Common):
    messages: list[_Message] = []
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class Parsed(msgspec.Struct):
    """A validated request: the client's body plus what routing needs.

    ``body`` and ``raw`` never carry a transfer field (``dropped`` names those the client sent).
    """

    kind: Kind
    body: dict[str, Any]
    raw: bytes
    # Exact, or (when ``recount`` is set) an upper bound proven below the disaggregation threshold.
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    # A single choice from one prompt (text, token ids or chat): a broken decode stream can be continued on
    # another worker.
    resumable: bool
    recount: Callable[[], Awaitable[int]] | None = None
    # The token ids the engine will see, for KV-aware routing: one prompt counted exactly (None for a prompt
    # list, or a prompt routed on its length bound, whose ids were never taken).
    prompt_ids: list[int] | None = None
    dropped: frozenset[str] = frozenset()
    # The parameter that makes the engine run several sequences (``n``, a prompt list, ``use_beam_search``),
    # None for one. P/D legs carry one transfer id, which several sequences cannot share (docs/router.md).
    fan_out: str | None = None
    # Chat: token ids -> text, to check that the text streamed so far carries every delivered token before a
    # broken stream is continued by text (``streaming.continuation``).
    text_of_ids: Callable[[list[int]], str] | None = None

    async def exact_prompt_tokens(self) -> int:
        """The prompt's real token count (what a resumed stream reports in its usage)."""
        return self.prompt_tokens if self.recount is None else await self.recount()


_PATH = re.compile(r"at `\$\.?([A-Za-z_][\w]*)")
_MISSING = re.compile(r"missing required field `(\w+)`")


def _param(err: msgspec.ValidationError) -> str | None:
    """The offending field: a missing one by name, else the top-level key of the error's path."""
    m = _MISSING.search(str(err)) or _PATH.search(str(err))
    return m.group(1) if m else None


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    """Content parts joined the way vLLM does for string-content chat templates."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(str(p.get("text", "")) for p in content if p.get("type") == "text")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompt(s) of a completions request, each a string or a list of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return [prompt]
    if _is_ids(prompt):
        return [prompt]
    if prompt and all((isinstance(p, str) and p) or _is_ids(p) for p in prompt):
        return list(prompt)
    raise bad_request(
        "prompt must be a non-empty string, list of strings, list of token ids or list of token id lists",
        "prompt",
    )


def _fan_out(n: int, prompts: int, body: dict[str, Any]) -> str | None:
    """Which parameter makes this request several engine sequences (each a request of its own in vLLM)."""
    if n > 1:
        return "n"
    if prompts > 1:
        return "prompt"
    # vLLM's beam search runs each beam step as a new request without the client's kv_transfer_params.
    if body.get("use_beam_search"):
        return "use_beam_search"
    return None


#: How deeply a request body may nest arrays and objects. msgspec decodes and encodes recursively, within
#: Python's recursion limit (1000) less the stack in use, so without a fixed bound a body nested ~950 deep
#: would decode here and then fail to encode deeper in the stack (a P/D leg): a 500 instead of a 400.
MAX_JSON_DEPTH = 256


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests arrays/objects more than ``limit`` levels (level by level: no recursion)."""
    level = [value]
    for _ in range(limit):
        level = [
            child
            for v in level
            for child in (v.values() if isinstance(v, dict) else v)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def check_media_type(content_type: str) -> None:
    """Refuse a completion body not declared as JSON (``content_type``: the header, "" when absent).

    As vLLM's ``validate_json_request``: the media type, parameters aside, must be ``application/json``, and
    a request without Content-Type is refused too, so what the router accepts its workers accept.
    """
    if content_type.partition(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "Unsupported Media Type: Only 'application/json' is allowed")


def decode_json(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``, or a 400 (not JSON, not an object, nested deeper than MAX_JSON_DEPTH)."""
    too_deep = f"request body is nested more than {MAX_JSON_DEPTH} levels deep"
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # deeper than the interpreter allows, which is deeper than the limit
        raise bad_request(too_deep) from None
    # Cheap first: a body with fewer brackets than the limit cannot nest deeper than it.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(body, MAX_JSON_DEPTH):
        raise bad_request(too_deep)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def _fits(longest: int, max_tokens: int | None, max_model_len: int) -> bool:
    return longest < max_model_len if max_tokens is None else longest + max_tokens <= max_model_len


async def _ids(
    prompts: Sequence[str | list[int]], tokenizer: PromptTokenizer, special: bool
) -> list[list[int]]:
    return [await tokenizer.ids_async(p, special) if isinstance(p, str) else p for p in prompts]


def _bounds(
    prompts: Sequence[str | list[int]], tokenizer: PromptTokenizer, special: bool, below: int
) -> list[int] | None:
    """Upper bounds of the prompts' token counts whose sum is below ``below``, or None when they cannot show
    that (no bound for this tokenizer, or the prompts are not short)."""
    bounds: list[int] = []
    total = 0
    for p in prompts:
        if isinstance(p, str) and len(p) >= below:  # a bound is at least the character count: no need to try
            return None
        bound = tokenizer.upper_bound(p, special) if isinstance(p, str) else len(p)
        if bound is None:
            return None
        total += bound
        if total >= below:
            return None
        bounds.append(bound)
    return bounds


async def parse(
    kind: Kind,
    raw: bytes,
    tokenizer: PromptTokenizer,
    served_names: tuple[str, ...],
    max_model_len: int,
    count_from: int,
) -> Parsed:
    """Validate ``raw``; raises ``ApiError`` (400/404) with an OpenAI-style message on any problem.

    Prompts are counted exactly only when the count matters: a prompt whose ``upper_bound`` is below
    ``count_from`` (the disaggregation threshold) and fits the context is routed as short on the bound alone,
    and ``Parsed.recount`` counts it if a resumed stream needs the real number.
    """
    body = decode_json(raw)
    dropped = TRANSFER_FIELDS.intersection(body)
    if dropped:
        for name in dropped:
            del body[name]
        raw = msgspec.json.encode(body)
    spec: type[_Completion] | type[_Chat] = _Completion if kind == "completions" else _Chat
    try:
        req = msgspec.convert(body, spec, strict=True)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}", _param(e)) from None
    if req.model not in served_names:
        raise ApiError(404, f"The model `{req.model}` does not exist.", "model")
    max_tokens = req.max_tokens
    if isinstance(req, _Chat) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if max_tokens is not None and max_tokens <= 0:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}.", "n")

    prompts: Sequence[str | list[int]]
    if isinstance(req, _Completion):
        prompt = req.prompt
        prompts, special = _prompts(prompt), True
        # echo puts the prompt into the stream: the text so far would not be the continuation point.
        resumable = (isinstance(prompt, str) or _is_ids(prompt)) and req.n == 1 and not body.get("echo")
    else:
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        messages = [{"role": m.role, "content": _text_of(m.content)} for m in req.messages]
        text = tokenizer.render_chat(
            messages,
            req.add_generation_prompt,
            req.continue_final_message,
            body.get("tools"),
            req.chat_template_kwargs,
        )
        prompts, special = [text], False  # the template writes the special tokens
        resumable = req.n == 1
    fan_out = _fan_out(req.n, len(prompts), body)

    def parsed(
        prompt_tokens: int,
        recount: Callable[[], Awaitable[int]] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Parsed:
        resumable_stream = resumable and req.stream
        return Parsed(
            kind,
            body,
            raw,
            prompt_tokens,
            max_tokens,
            req.stream,
            resumable_stream,
            recount,
            prompt_ids,
            dropped,
            fan_out,
            tokenizer.text if kind == "chat" else None,
        )

    bounds = _bounds(prompts, tokenizer, special, count_from)
    if bounds is not None and _fits(max(bounds), max_tokens, max_model_len):
        counted: list[int] = []  # the exact count, once taken (each resume of the stream asks again)

        async def recount() -> int:
            if not counted:
                counted.append(sum(map(len, await _ids(prompts, tokenizer, special))))
            return counted[0]

        return parsed(sum(bounds), recount)
    ids = await _ids(prompts, tokenizer, special)
    lengths = [len(i) for i in ids]
    longest = max(lengths)
    if not _fits(longest, max_tokens, max_model_len):
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{longest} prompt tokens and {max_tokens or 0} completion tokens. Please reduce the length of the "
            "prompt or max_tokens.",
            "input_tokens",
        )
    return parsed(sum(lengths), prompt_ids=ids[0] if len(ids) == 1 else None)
