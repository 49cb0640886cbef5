"""First-token seeding on the P/D path: the client's first token is the one P sampled, and D continues from it.

Router process, one request's coroutine (``legs.py``). P samples a token when its prefill ends; D, asked with
``pd_seed_first_token`` (docs/wire-contract.md), takes that token from P's ``Done`` over the side channel and
samples the second one after it, so the first token reaches the client as soon as P's leg answers (P's
prefill plus one hop) and a sampled stream stays one sequence. Where D's own stream can carry the token
(``decode_streams_first``: pd-push, no logprobs asked), D is asked to (``pd_stream_first_token``), and the
first of the two to reach the router is the client's first token: D's stream is then relayed as it is, or
P's answer is followed by D's events without P's token (``PrefillAnswer.first_token`` says what to cut
out). Otherwise D's API server never sees the first token, so the router writes it: ``PrefillAnswer``
(parsed once per request) turns P's (non-streamed) answer into the stream events vLLM would have sent for
it, and D's events follow through ``streaming.Stitcher`` (P's ``id`` and ``created``, no second role chunk
or prompt ids, usage counting the first token).

``applies`` keeps seeding to requests where D's front end, which does not see the first token where only P's
answer carries it, still gets everything else right: one streamed sequence, no penalties or structured
output that depend on the text or count of the earlier tokens (docs/wire-contract.md lists them); the rest
go P->D unseeded. Stop strings are seeded only where D's stream carries P's token, and then D's stream alone
brings it (``answer_may_lead``): D's API server checks them on the text, P's token's included.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.streaming import DONE, FirstToken

#: Sampling fields whose effect on D's tokens depends on the earlier tokens' text or count, which D's API
#: server (detokenizer, stop checker) or model runner (penalties over outputs, min_tokens) would miss.
_BLOCKING = (
    "frequency_penalty",
    "presence_penalty",
    "min_tokens",
    "bad_words",
    "prompt_logprobs",
    "echo",
    "suffix",
    "best_of",
    "use_beam_search",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "tools",
    "functions",
    "logits_processors",
)


class NotSeedable(ValueError):
    """P's answer cannot be streamed as the first token (not vLLM's JSON, no token, an unknown ending)."""


#: Sampling fields that D's API server applies to the text, P's token's included: seeded only where D's own
#: stream carries P's token, and then D's stream alone brings it (``answer_may_lead``). A stop string that
#: starts in P's token's text makes D's API server hold that text back, or cut it and end the stream; P's
#: answer, which D's API server never sees, would have sent it.
_D_STREAM_ONLY = ("stop",)


def _asked(body: dict[str, Any], fields: tuple[str, ...]) -> bool:
    return any(body.get(field) not in (None, False, 0, [], "") for field in fields)


def applies(body: dict[str, Any], d_streams: bool) -> bool:
    """Whether a P/D request (the client's body) is served with D continuing from P's first token;
    ``d_streams``: whether the flow can have D's own stream carry that token (pd-push)."""
    if body.get("stream") is not True or body.get("n", 1) != 1:
        return False
    if _asked(body, _BLOCKING):
        return False
    if _asked(body, _D_STREAM_ONLY) and not (d_streams and decode_streams_first(body)):
        return False
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return False
    opts = body.get("stream_options")
    return not (isinstance(opts, dict) and opts.get("continuous_usage_stats"))


def decode_streams_first(body: dict[str, Any]) -> bool:
    """Whether a seeded request (the client's body) can have D's own stream carry P's token: not when
    logprobs are asked (P's answer alone has the token's; a seeded D streams it only without them)."""
    logprobs = body.get("logprobs")
    return logprobs is None or logprobs is False


def answer_may_lead(body: dict[str, Any]) -> bool:
    """Whether, where D's stream carries P's token, P's answer races it to be the client's first token: not
    for a request with a field of ``_D_STREAM_ONLY``, whose text D's API server alone gets right."""
    return not _asked(body, _D_STREAM_ONLY)


class PrefillAnswer:
    """P's one-token answer, parsed once: the stream events it becomes, the token to cut out of D's stream,
    the prompt length P counted. ``parse`` raises ``NotSeedable`` for anything but a completion (or chat
    completion) with one choice that ended by length or stop."""

    def __init__(self, answer: dict[str, Any], choice: dict[str, Any]) -> None:
        self._answer, self._choice = answer, choice

    @classmethod
    def parse(cls, data: bytes) -> PrefillAnswer:
        try:
            answer = msgspec.json.decode(data)
            choice = answer["choices"][0]
        except (msgspec.DecodeError, KeyError, IndexError, TypeError):
            raise NotSeedable("the prefill answer is not a completion with one choice") from None
        if not isinstance(answer, dict) or not isinstance(choice, dict):
            raise NotSeedable("the prefill answer is not a completion with one choice")
        if choice.get("finish_reason") not in ("length", "stop"):
            raise NotSeedable(f"the prefill ended with finish_reason {choice.get('finish_reason')!r}")
        return cls(answer, choice)

    def first_events(
        self, chat: bool, client_max_tokens: int | None, include_usage: bool
    ) -> tuple[bytes, bool]:
        """The stream events of the answer (its one token), and whether they end the stream.

        They end it when P's token finished the request (a stop token: ``finish_reason`` "stop") or the
        client asked for one token: then the events carry the finish reason, the usage chunk when asked, and
        ``[DONE]``, and D's leg is dropped. Fields vLLM streams (``token_ids``, ``prompt_token_ids``,
        ``logprobs``) are passed as P returned them; ``streaming.strip_token_ids`` hides ids the client did
        not ask for, as on D's events.
        """
        answer, choice = self._answer, self._choice
        head = {
            "id": answer.get("id", ""),
            "created": answer.get("created", 0),
            "model": answer.get("model", ""),
        }
        complete = choice.get("finish_reason") == "stop" or client_max_tokens == 1
        finish = choice.get("finish_reason") if complete else None
        chunks: list[dict[str, Any]] = []
        if chat:
            obj = "chat.completion.chunk"
            message = choice.get("message") or {}
            role: dict[str, Any] = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
            }
            role["finish_reason"] = None
            first: dict[str, Any] = {**head, "object": obj, "choices": [role]}
            if "prompt_token_ids" in answer:
                first["prompt_token_ids"] = answer["prompt_token_ids"]
            chunks.append(first)
            token = {"index": 0, "delta": {"content": message.get("content") or ""}}
            token.update(
                logprobs=choice.get("logprobs"), finish_reason=finish, stop_reason=choice.get("stop_reason")
            )
            if "token_ids" in choice:
                token["token_ids"] = choice["token_ids"]
            chunks.append({**head, "object": obj, "choices": [token]})
        else:
            obj = "text_completion"
            token = {"index": 0, "text": choice.get("text") or "", "logprobs": choice.get("logprobs")}
            token.update(finish_reason=finish, stop_reason=choice.get("stop_reason"))
            for field in ("token_ids", "prompt_token_ids"):
                if field in choice:
                    token[field] = choice[field]
            chunks.append({**head, "object": obj, "choices": [token]})
        out = b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks)
        if complete:
            if include_usage and isinstance(answer.get("usage"), dict):
                out += b"data: " + msgspec.json.encode(
                    {**head, "object": obj, "choices": [], "usage": answer["usage"]}
                )
                out += b"\n\n"
            out += DONE
        return out, complete

    def first_token(self, chat: bool) -> FirstToken:
        """P's token as the answer gives it (its ids, when the router asked for them, and its text), to be cut
        out of D's stream when D streams it too."""
        ids = self._choice.get("token_ids")
        text = (self._choice.get("message") or {}).get("content") if chat else self._choice.get("text")
        return FirstToken(ids if isinstance(ids, list) else None, text if isinstance(text, str) else "")

    def prompt_tokens(self) -> int:
        """The prompt length P counted (its usage; 0 when it gave none), which the stitched usage of D's
        stream reports."""
        usage = self._answer.get("usage")
        count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return count if isinstance(count, int) else 0
