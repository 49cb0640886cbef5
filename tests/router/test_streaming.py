"""Stream bookkeeping and the stitching of a resumed stream (no servers)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from router.requests import Parsed
from router.streaming import (
    DONE,
    FirstToken,
    Stitcher,
    StreamState,
    Unresumable,
    WorkerErrorEvent,
    continuation,
    strip_token_ids,
)
from tests.router.byte_tokens import byte_tokenizer


def ev(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _chunk(obj: str, own: dict, finish, rid, created, after: dict | None = None) -> bytes:
    """One SSE event of one choice, its fields in vLLM's order (``own`` first, ``after`` last)."""
    choice = {"index": 0, **own, "logprobs": None, "finish_reason": finish, **(after or {})}
    return ev({"id": rid, "object": obj, "created": created, "model": "m", "choices": [choice]})


def comp_chunk(text, finish=None, rid="cmpl-1", created=10):
    return _chunk("text_completion", {"text": text}, finish, rid, created)


def ids_chunk(text, ids, finish=None, prompt=None):
    """A completion chunk as vLLM streams it with ``return_token_ids`` (the prompt's ids on the first one)."""
    after = {"stop_reason": None, "prompt_token_ids": prompt, "token_ids": ids}
    return _chunk("text_completion", {"text": text}, finish, "c", 1, after)


def chat_chunk(delta, rid="chatcmpl-1", created=10):
    return _chunk("chat.completion.chunk", {"delta": delta}, None, rid, created)


def parsed(kind, body, max_tokens=8):
    return Parsed(kind, body, msgspec.json.encode(body), 5, max_tokens, True, True)


def test_state_counts_tokens_including_empty_text_events() -> None:
    s = StreamState()
    for e in (comp_chunk("a"), comp_chunk(""), comp_chunk(" b"), DONE):
        s.observe(e)
    assert (s.id, s.created, s.tokens, "".join(s.text)) == ("cmpl-1", 10, 3, "a b")


def test_state_skips_chat_role_chunk() -> None:
    s = StreamState()
    for e in (chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "x"})):
        s.observe(e)
    assert (s.tokens, s.text) == (1, ["x"])


def test_completion_continuation_appends_text_and_reduces_max_tokens() -> None:
    s = StreamState()
    s.observe(comp_chunk(" w2"))
    s.observe(comp_chunk(" w3"))
    body = continuation(parsed("completions", {"model": "m", "prompt": "hello world", "max_tokens": 8}), s)
    assert body == {"model": "m", "prompt": "hello world w2 w3", "max_tokens": 6}


def test_chat_continuation_continues_the_assistant_message() -> None:
    s = StreamState()
    s.observe(chat_chunk({"role": "assistant", "content": ""}))
    s.observe(chat_chunk({"content": "Hel"}))
    msgs = [{"role": "user", "content": "hi"}]
    body = continuation(parsed("chat", {"model": "m", "messages": msgs, "max_completion_tokens": 8}), s)
    assert body is not None
    assert body["messages"] == [*msgs, {"role": "assistant", "content": "Hel"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_completion_tokens"] == 7
    # a client that was already continuing its own assistant message: extend that one
    own = [*msgs, {"role": "assistant", "content": "Sure:"}]
    body = continuation(parsed("chat", {"model": "m", "messages": own, "continue_final_message": True}), s)
    assert body is not None
    assert body["messages"][-1] == {"role": "assistant", "content": "Sure:Hel"}


def test_nothing_left_to_generate() -> None:
    s = StreamState()
    s.observe(comp_chunk("a"))
    assert continuation(parsed("completions", {"model": "m", "prompt": "p", "max_tokens": 1}, 1), s) is None


def test_stitcher_keeps_id_drops_role_and_sums_usage() -> None:
    s = StreamState()
    s.observe(chat_chunk({"role": "assistant", "content": ""}, rid="chatcmpl-A", created=1))
    s.observe(chat_chunk({"content": "x"}, rid="chatcmpl-A", created=1))
    st = Stitcher(s, prompt_tokens=5, strip_ids=False)
    assert st.rewrite(chat_chunk({"role": "assistant", "content": ""}, rid="chatcmpl-B", created=2)) is None
    out = st.rewrite(chat_chunk({"content": "y"}, rid="chatcmpl-B", created=2))
    assert out is not None
    assert msgspec.json.decode(out[6:])["id"] == "chatcmpl-A"
    assert msgspec.json.decode(out[6:])["created"] == 1
    usage = ev(
        {
            "id": "chatcmpl-B",
            "object": "chat.completion.chunk",
            "created": 2,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 9, "total_tokens": 12, "completion_tokens": 3},
        }
    )
    rewritten = st.rewrite(usage)
    assert rewritten is not None
    fixed = msgspec.json.decode(rewritten[6:])["usage"]
    assert fixed == {"prompt_tokens": 5, "total_tokens": 5 + 4, "completion_tokens": 4}
    assert list(fixed) == ["prompt_tokens", "total_tokens", "completion_tokens"]  # vLLM's key order
    assert st.rewrite(DONE) == DONE
    assert s.tokens == 2 and "".join(s.text) == "xy"


def _after_p(chat: bool = False) -> tuple[StreamState, Stitcher]:
    """A stream whose client got P's token (id 7, text " a") from P's answer, and the stitcher of D's
    stream, which carries that token too."""
    state = StreamState(need_text=chat)
    if chat:
        state.observe(chat_chunk({"role": "assistant", "content": ""}, rid="P", created=1))
        state.observe(chat_chunk({"content": " a"}, rid="P", created=1))
    else:
        state.observe(ids_chunk(" a", [7], prompt=[1, 2]))
    return state, Stitcher(state, 2, strip_ids=False, skip=FirstToken([7], " a"))


def test_p_token_is_cut_out_of_d_stream_alone_or_merged_with_the_next() -> None:
    """D's stream carries P's token first: its own event is dropped; merged with the next token (D's front
    end was behind), the token's id and text are cut from the front and the rest goes on. Usage is D's,
    which counted P's token already; only the first token event is cut."""
    state, st = _after_p()
    assert st.rewrite(ids_chunk(" a", [7], prompt=[1, 2])) is None
    out = msgspec.json.decode((st.rewrite(ids_chunk(" b", [8])) or b"")[6:])
    assert out["choices"][0]["token_ids"] == [8]
    state, st = _after_p()
    merged = msgspec.json.decode((st.rewrite(ids_chunk(" a b", [7, 8], prompt=[1, 2])) or b"")[6:])
    assert (merged["choices"][0]["text"], merged["choices"][0]["token_ids"]) == (" b", [8])
    assert merged["choices"][0]["prompt_token_ids"] is None
    assert msgspec.json.decode((st.rewrite(ids_chunk(" a", [7])) or b"")[6:])["choices"][0]["text"] == " a"
    usage = ev(
        {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3},
        }
    )
    assert msgspec.json.decode((st.rewrite(usage) or b"")[6:])["usage"]["completion_tokens"] == 3
    assert state.ids == [7, 8, 7]


def test_p_token_is_cut_out_of_d_chat_stream_after_its_role_chunk() -> None:
    state, st = _after_p(chat=True)
    assert st.rewrite(chat_chunk({"role": "assistant", "content": ""}, rid="D", created=2)) is None
    assert st.rewrite(chat_chunk({"content": " a"}, rid="D", created=2)) is None
    out = msgspec.json.decode((st.rewrite(chat_chunk({"content": " b"}, rid="D", created=2)) or b"")[6:])
    assert (out["id"], out["choices"][0]["delta"]["content"]) == ("P", " b")
    assert "".join(state.text) == " a b"


def test_a_first_token_event_that_ends_the_stream_keeps_its_finish_reason() -> None:
    _, st = _after_p()
    out = msgspec.json.decode((st.rewrite(ids_chunk(" a", [7], finish="stop")) or b"")[6:])
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["token_ids"] == []


def test_token_ids_count_merged_events_and_make_the_continuation_token_exact() -> None:
    s = StreamState()
    first = ids_chunk("ab", [11, 12], prompt=[5, 6, 7])
    s.observe_batch(first + comp_chunk("c"))
    assert s.prompt_ids == [5, 6, 7] and s.ids == [11, 12]
    assert s.tokens == 3  # two tokens merged into one event, then one event without ids
    s2 = StreamState()
    s2.observe(first)
    body = continuation(parsed("completions", {"model": "m", "prompt": "xyz", "max_tokens": 8}), s2)
    assert body is not None and body["prompt"] == [5, 6, 7, 11, 12] and body["max_tokens"] == 6


def test_strip_token_ids_restores_vllm_nulls() -> None:
    with_ids = (
        b'data: {"choices":[{"index":0,"text":"a","prompt_token_ids":[1, 2],"token_ids":[3]}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":"x"},"token_ids":[]}],"prompt_token_ids":[9]}\n\n'
    )
    assert strip_token_ids(with_ids) == (
        b'data: {"choices":[{"index":0,"text":"a","prompt_token_ids":null,"token_ids":null}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":"x"},"token_ids":null}],"prompt_token_ids":null}\n\n'
    )
    assert strip_token_ids(b'data: {"text":"token_ids:[1]"}') == b'data: {"text":"token_ids:[1]"}'


def test_completions_fast_path_scans_ids_without_decoding() -> None:
    def event(i, ids, finish=None, prompt=None):
        return ids_chunk(f'say "token_ids":[9] {i}', ids, finish, prompt)

    s = StreamState(need_text=False)
    s.observe_batch(event(0, [10], prompt=[1, 2]))
    s.observe_batch(event(1, [11, 12]) + event(2, [13]))
    assert (s.prompt_ids, s.ids, s.tokens, s.finished) == ([1, 2], [10, 11, 12, 13], 4, False)
    s.observe_batch(event(3, [14], finish="stop") + DONE)
    assert s.ids == [10, 11, 12, 13, 14] and s.finished


def test_an_error_event_stops_a_stitched_stream_after_what_came_before_it() -> None:
    """vLLM's generation error (``data: {"error": ...}``) where tokens were due: the events before it are
    handed back (and counted as delivered), the error and what follows are not; a token whose text says
    "error" is a token."""
    s = StreamState()
    st = Stitcher(s, prompt_tokens=5, strip_ids=False)
    error = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
    wordy = comp_chunk('"error"')
    with pytest.raises(WorkerErrorEvent) as raised:
        st.rewrite_batch(comp_chunk(" a") + wordy + ev({"error": error}) + DONE)
    assert str(raised.value) == "Internal server error"
    out = raised.value.out
    assert b'" a"' in out and b"InternalServerError" not in out and DONE not in out and s.tokens == 2
    assert st.rewrite_batch(comp_chunk(" b") + DONE).endswith(DONE)


def chat_ids_chunk(content: str, ids: list[int]) -> bytes:
    return ev(
        {"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"content": content}, "token_ids": ids}]}
    )


def test_a_chat_broken_inside_a_character_is_not_continued_from_its_text(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer(tmp_path)
    first, second = tokenizer.ids("é", add_special_tokens=False)  # two bytes, two tokens
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    chat = Parsed("chat", body, msgspec.json.encode(body), 5, 8, True, True, text_of_ids=tokenizer.text)
    s = StreamState()
    s.observe(chat_ids_chunk("", [first]))  # vLLM streams no text for half a character
    with pytest.raises(Unresumable, match="inside a character"):
        continuation(chat, s)  # from the text alone the new worker would generate `first` again
    s.observe(chat_ids_chunk("é", [second]))
    resumed = continuation(chat, s)
    assert resumed is not None and resumed["messages"][-1] == {"role": "assistant", "content": "é"}
    assert resumed["max_tokens"] == 6
