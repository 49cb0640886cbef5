"""A broken chat stream continued token-exactly: the chat's prompt ids + the delivered ids sent as a token-id
completion, whose events the router rewrites as the chat's own chunks (``streaming.continuation``, ``Seam``,
``Stitcher``). No servers: a byte-level tokenizer makes a token that is half a character."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.requests import Parsed
from router.streaming import DONE, Seam, Stitcher, StreamState, as_completion, continuation
from router.tokenize import PromptTokenizer
from tests.router.byte_tokens import byte_tokenizer

pytestmark = pytest.mark.unit

PROMPT_IDS = [1, 2, 3]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}


def ev(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def chat_event(delta: dict[str, Any], ids: list[int] | None, prompt: list[int] | None = None) -> bytes:
    """A chat chunk as vLLM streams it with ``return_token_ids`` (the prompt's ids on the role chunk)."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, "token_ids": ids}
    head: dict[str, Any] = {"id": "chatcmpl-A", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    return ev({**head, "choices": [choice], **({"prompt_token_ids": prompt} if prompt else {})})


def completion_event(text: str, ids: list[int], finish: str | None = None) -> bytes:
    """A completions chunk as vLLM streams it for a token-id prompt with ``return_token_ids``."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    choice |= {"prompt_token_ids": None, "token_ids": ids}
    return ev({"id": "cmpl-B", "object": "text_completion", "created": 9, "model": "m", "choices": [choice]})


def usage_event(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    return ev(
        {
            "id": "cmpl-B",
            "object": "text_completion",
            "created": 9,
            "model": "m",
            "choices": [],
            "usage": usage,
        }
    )


def chat(
    tokenizer: PromptTokenizer, body: dict[str, Any] = CHAT, prompt_ids: list[int] | None = None
) -> Parsed:
    raw = msgspec.json.encode(body)
    return Parsed("chat", body, raw, 3, 8, True, True, prompt_ids=prompt_ids, text_of_ids=tokenizer.text)


def decoded(batch: bytes) -> list[Any]:
    return [msgspec.json.decode(e[6:]) if e != DONE.strip() else "[DONE]" for e in batch.split(b"\n\n") if e]


def test_a_chat_broken_inside_a_character_continues_as_a_token_exact_completion(tmp_path: Path) -> None:
    """D streamed "h" and the first byte of "é", then died: the continuation is the chat's prompt ids + both
    delivered ids as a completion, and the new worker's events reach the client as the chat's chunks: its id
    and created, chat's object and delta, "é" whole (vLLM's detokenizer, primed with a prompt that ends
    inside the character, streams decoded prompt text there: "hé"), then the worker's own text."""
    tokenizer = byte_tokenizer(tmp_path)
    h, i = tokenizer.ids("h", False)[0], tokenizer.ids("i", False)[0]
    first, second = tokenizer.ids("é", False)
    s = StreamState()
    s.observe_batch(
        chat_event({"role": "assistant", "content": ""}, None, PROMPT_IDS)
        + chat_event({"content": "h"}, [h])
        + chat_event({"content": ""}, [first])  # vLLM streams no text for half a character
    )
    parsed = chat(tokenizer)
    body = continuation(parsed, s)
    assert body is not None and as_completion(parsed, body)
    assert body["prompt"] == [*PROMPT_IDS, h, first] and body["max_tokens"] == 6
    assert "messages" not in body and "add_generation_prompt" not in body and body["stream"] is True

    assert s.ids is not None
    st = Stitcher(s, prompt_tokens=3, strip_ids=False, seam=Seam(tokenizer.text, s.ids, "".join(s.text)))
    out = st.rewrite_batch(
        completion_event("hé", [second])
        + completion_event("i", [i])
        + completion_event("", [i, h], finish="length")
        + usage_event(5, 4)
        + DONE
    )
    events = decoded(out)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {"chatcmpl-A"} and {c["created"] for c in chunks} == {7}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"content": "é"},
        {"content": "i"},
        {"content": ""},
    ]
    assert chunks[0]["choices"][0] == {
        "index": 0,
        "delta": {"content": "é"},
        "logprobs": None,
        "finish_reason": None,
        "token_ids": [second],
    }  # vLLM's chat chunk: no stop_reason before the finish, no prompt ids
    assert chunks[2]["choices"][0]["finish_reason"] == "length" and "stop_reason" in chunks[2]["choices"][0]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 2 + 4
    assert s.ids == [h, first, second, i, i, h] and "".join(s.text) == "héi"


def test_a_seam_on_a_character_boundary_keeps_the_workers_text_and_merged_events(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer(tmp_path)
    h, i = tokenizer.ids("h", False)[0], tokenizer.ids("i", False)[0]
    first, second = tokenizer.ids("é", False)
    s = StreamState()
    s.observe_batch(
        chat_event({"role": "assistant", "content": ""}, None, PROMPT_IDS) + chat_event({"content": "h"}, [h])
    )
    assert s.ids is not None
    seam = Seam(tokenizer.text, s.ids, "h")
    assert seam.pending is None
    st = Stitcher(s, 3, False, seam)
    out = st.rewrite_batch(completion_event("éi", [first, second, i]))  # merged into one event by vLLM
    assert decoded(out)[0]["choices"][0]["delta"] == {"content": "éi"}
    # broken after the first byte, and the worker merges the second byte with the next token
    s2 = StreamState()
    s2.observe_batch(chat_event({"content": "h"}, [h]) + chat_event({"content": ""}, [first]))
    assert s2.ids is not None
    st2 = Stitcher(s2, 3, True, Seam(tokenizer.text, s2.ids, "h"))
    out2 = st2.rewrite_batch(completion_event("hIGNORED", [second, i]))
    assert decoded(out2)[0]["choices"][0] == {
        "index": 0,
        "delta": {"content": "éi"},
        "logprobs": None,
        "finish_reason": None,
        "token_ids": None,  # hidden again: the client did not ask for ids
    }


def test_prompt_ids_come_from_the_worker_else_the_routers_rendering_else_the_text(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer(tmp_path)
    h = tokenizer.ids("h", False)[0]
    no_prompt = StreamState()
    no_prompt.observe(chat_event({"content": "h"}, [h]))  # a seeded stream: P's token, no prompt ids
    body = continuation(chat(tokenizer, prompt_ids=[4, 5]), no_prompt)
    assert body is not None and body["prompt"] == [4, 5, h]
    text_only = continuation(chat(tokenizer), no_prompt)  # neither: continued from its text
    assert text_only is not None and text_only["messages"][-1] == {"role": "assistant", "content": "h"}
    assert not as_completion(chat(tokenizer), text_only)


@pytest.mark.parametrize("field", [{"logprobs": True, "top_logprobs": 2}, {"tools": [{"type": "function"}]}])
def test_a_chat_whose_answer_is_more_than_its_content_continues_from_its_text(
    tmp_path: Path, field: dict[str, Any]
) -> None:
    """Chat logprobs and tool calls have a chat format a completion's events do not carry."""
    tokenizer = byte_tokenizer(tmp_path)
    h = tokenizer.ids("h", False)[0]
    s = StreamState()
    s.observe_batch(
        chat_event({"role": "assistant", "content": ""}, None, PROMPT_IDS) + chat_event({"content": "h"}, [h])
    )
    body = continuation(chat(tokenizer, {**CHAT, **field}), s)
    assert body is not None and "messages" in body and "prompt" not in body
    assert body["continue_final_message"] is True


def test_a_chat_without_a_token_limit_continues_to_the_end_of_the_context(tmp_path: Path) -> None:
    """A completion's default limit is 16 tokens, a chat's the rest of the context: the continuation asks
    for the rest."""
    tokenizer = byte_tokenizer(tmp_path)
    h = tokenizer.ids("h", False)[0]
    s = StreamState()
    s.observe_batch(
        chat_event({"role": "assistant", "content": ""}, None, PROMPT_IDS) + chat_event({"content": "h"}, [h])
    )
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    unlimited = Parsed(
        "chat", body, msgspec.json.encode(body), 3, None, True, True, text_of_ids=tokenizer.text
    )
    cont = continuation(unlimited, s, context=100)
    assert cont is not None and cont["prompt"] == [*PROMPT_IDS, h] and cont["max_tokens"] == 100 - 4
    text = continuation(unlimited, s)  # no context length known: from its text, the chat's own default
    assert text is not None and "messages" in text and "max_tokens" not in text
