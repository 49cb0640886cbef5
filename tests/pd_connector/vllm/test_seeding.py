"""First-token seeding on PDConnector's scheduler side (no engine): P hands on the token it sampled, D continues
from it (from P's ``Done`` or P's answer), and a seeded load that failed without one ends with an error."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from pd_connector import wire
from pd_connector.vllm.compat import FirstTokenEnd, StreamedFirstToken
from pd_connector.vllm.metadata import FinishedSend
from pd_connector.vllm.scheduler_side import SchedulerSide
from tests.pd_connector.vllm.sides import (
    ADDR,
    MAX_LEN,
    VOCAB,
    FakeBlocks,
    FakeOutput,
    FakeRequest,
    decode_params,
    make_side,
)


def _loaded(
    side: SchedulerSide, params: dict[str, Any], prompt_len: int = 64, sampling: SamplingParams | None = None
) -> Request:
    """A real vLLM request on D whose load of ``prompt_len`` tokens was planned (two blocks)."""
    sampling = sampling or SamplingParams(temperature=0.8, seed=7)
    req = Request("d1", list(range(prompt_len)), sampling, None)
    req.kv_transfer_params = params
    assert side.get_num_new_matched_tokens(req, 0) == (prompt_len, True)  # type: ignore[arg-type]
    req.num_computed_tokens = prompt_len  # what vLLM sets when it parks the request for the load
    side.update_state_after_alloc(req, FakeBlocks([3, 4]), prompt_len)  # type: ignore[arg-type]
    side.build_connector_meta(FakeOutput({}))  # type: ignore[arg-type]
    return req


def test_seeded_decode_continues_from_prefills_first_token() -> None:
    """P's token becomes D's first output and the position after the prompt is D's next input: vLLM's
    check (``num_computed_tokens == num_tokens``: recompute the last prompt token) no longer applies, and
    its model runner, which builds a new request from ``prompt_token_ids``, gets the token as input."""
    side, _ = make_side()
    req = _loaded(side, {**decode_params(), "pd_seed_first_token": True})
    prompt = req.prompt_token_ids
    side.update_connector_output({"d1"}, {"d1": 4242})
    assert list(req.output_token_ids) == [4242] and req.num_output_tokens == 1
    assert req.num_tokens == 65 and req.num_computed_tokens == 64 and req.num_prompt_tokens == 64
    assert req.prompt_token_ids == [*range(64), 4242]
    assert prompt == list(range(64)), "the client's prompt list is not changed in place"
    assert list(req.all_token_ids) == [*range(64), 4242]


def test_unseeded_decode_ignores_the_token() -> None:
    """Without the router's flag (vLLM's own proxies, other callers) D samples its first token itself, and
    a seeded request whose load brought no token (failed, or P sent none) is left as it was."""
    side, _ = make_side()
    req = _loaded(side, decode_params())
    side.update_connector_output({"d1"}, {"d1": 4242})
    assert req.num_output_tokens == 0 and req.num_tokens == 64
    side, _ = make_side()
    req = _loaded(side, {**decode_params(), "pd_seed_first_token": True})
    side.update_connector_output({"d1"}, {})
    side.update_connector_output({"d1"}, {"d1": 4242})  # a late token for a load already reported: ignored
    assert req.num_output_tokens == 0 and req.num_tokens == 64


STREAMED = {**decode_params(), "pd_seed_first_token": True, "pd_stream_first_token": True}


def test_a_streamed_seed_is_handed_to_the_output_hook() -> None:
    """``pd_stream_first_token``: once seeded, P's token waits in ``streamed_first_tokens`` for
    ``compat.hook_step_output`` to output it in the same step (a token that does not end the request:
    ``end`` None); the request is otherwise as seeding left it."""
    side, _ = make_side()
    req = _loaded(side, STREAMED)
    status = req.status
    side.update_connector_output({"d1"}, {"d1": 4242})
    assert side.streamed_first_tokens == {"d1": StreamedFirstToken(4242, None)}
    assert list(req.output_token_ids) == [4242] and req.status == status and req.stop_reason is None


@pytest.mark.parametrize(
    ("params", "sampling"),
    [
        ({**decode_params(), "pd_stream_first_token": True}, None),  # not seeded: D samples its own
        ({**decode_params(), "pd_seed_first_token": True}, None),  # seeded, P's answer streams the token
        (STREAMED, SamplingParams(temperature=0.8, seed=7, logprobs=2)),  # only P's answer has its logprobs
        (STREAMED, SamplingParams(temperature=0.8, seed=7, logprobs=0)),
        # vLLM's standard flow has no such field: P's answer, already in the router's hands, streams the token
        (
            {
                **wire.encode(wire.PrefillReturned("t1", ADDR, pd_seed_first_token=True)),
                "pd_stream_first_token": True,
            },
            None,
        ),
    ],
)
def test_d_streams_p_token_only_when_seeded_asked_and_without_logprobs(
    params: dict[str, Any], sampling: SamplingParams | None
) -> None:
    side, _ = make_side()
    _loaded(side, params, sampling=sampling)
    side.update_connector_output({"d1"}, {"d1": 4242})
    assert side.streamed_first_tokens == {}


@pytest.mark.parametrize(
    ("sampling", "end"),
    [
        (SamplingParams(max_tokens=1), FirstTokenEnd(RequestStatus.FINISHED_LENGTH_CAPPED, None)),
        (SamplingParams(stop_token_ids=[4242]), FirstTokenEnd(RequestStatus.FINISHED_STOPPED, 4242)),
        (SamplingParams(stop_token_ids=[4243], max_tokens=2), None),
        (SamplingParams(max_tokens=MAX_LEN), None),
    ],
)
def test_a_streamed_token_that_ends_the_request_says_how(
    sampling: SamplingParams, end: FirstTokenEnd | None
) -> None:
    """vLLM checks stop conditions on sampled tokens only; P's token is checked with vLLM's own check when
    it is seeded, and the request's status is left for vLLM to promote it as usual."""
    side, _ = make_side()
    req = _loaded(side, STREAMED, sampling=sampling)
    status = req.status
    side.update_connector_output({"d1"}, {"d1": 4242})
    assert side.streamed_first_tokens == {"d1": StreamedFirstToken(4242, end)}
    assert req.status == status and req.stop_reason is None


def test_a_streamed_token_that_fills_the_context_ends_the_request() -> None:
    """The prompt plus P's token reach the model's context length: nothing can follow."""
    side, _ = make_side()
    req = _loaded(side, STREAMED, prompt_len=MAX_LEN - 1, sampling=SamplingParams(max_tokens=5))
    side.update_connector_output({"d1"}, {"d1": 4242})
    end = FirstTokenEnd(RequestStatus.FINISHED_LENGTH_CAPPED, None)
    assert side.streamed_first_tokens == {"d1": StreamedFirstToken(4242, end)} and req.num_tokens == MAX_LEN


def _returned(first_token: int | None) -> dict[str, Any]:
    """D's params in vLLM's standard flow: what P answered (with its first token), seeded by the router."""
    returned = wire.PrefillReturned("t1", ADDR, pd_seed_first_token=True, pd_first_token=first_token)
    return wire.encode(returned)


def test_failed_load_is_seeded_with_the_token_p_answered() -> None:
    """vLLM's standard flow: P died after answering, so its ``Done`` never came and the load failed; D still
    continues from the token the client was streamed, taken from P's answer, and vLLM recomputes the prompt
    and that token (it set ``num_computed_tokens`` to 0 for the failed load before this hook)."""
    side, _ = make_side()
    req = _loaded(side, _returned(4242))
    req.num_computed_tokens = 0
    side.update_connector_output({"d1"}, {})
    assert list(req.output_token_ids) == [4242] and req.prompt_token_ids == [*range(64), 4242]
    assert req.num_tokens == 65 and req.num_computed_tokens == 0
    # P's ``Done`` wins over the copy in its answer when both came.
    side, _ = make_side()
    req = _loaded(side, _returned(4242))
    side.update_connector_output({"d1"}, {"d1": 17})
    assert list(req.output_token_ids) == [17]


def test_a_seeded_load_that_failed_without_a_token_ends_with_an_error() -> None:
    """pd-push: the load failed before P's ``Done`` came (P died after answering, the link broke), so no token
    can seed the request; recomputing would make D sample a first token of its own after the one the client
    has. It is named to fail instead, and is then neither seeded nor aborted as a load in flight. A seeded load
    with a token to continue from, and an unseeded one, recompute as vLLM's policy says."""
    side, _ = make_side()
    req = _loaded(side, {**decode_params(), "pd_seed_first_token": True})
    assert side.loads_to_fail({"d1"}, {}) == {"d1"}
    side.update_connector_output({"d1"}, {})
    assert req.num_output_tokens == 0
    req.status = RequestStatus.FINISHED_ERROR
    assert side.request_finished(req, [3, 4]) == (False, None)  # type: ignore[arg-type]
    assert side.build_connector_meta(FakeOutput({})).aborted_recvs == []  # type: ignore[arg-type]
    for params, tokens in (
        ({**decode_params(), "pd_seed_first_token": True}, {"d1": 7}),  # Done came before the failure
        (_returned(7), {}),  # vLLM's standard flow: P's answer has it
        (decode_params(), {}),  # not seeded: D samples its own first token anyway
    ):
        side, _ = make_side()
        _loaded(side, params)
        assert side.loads_to_fail({"d1"}, tokens) == set()
    side, _ = make_side()
    _loaded(side, {**decode_params(), "pd_seed_first_token": True})
    assert side.loads_to_fail(set(), {}) == set(), "a load that did not end this step"
    assert side.loads_to_fail({"d1"}, {"d1": VOCAB}) == {"d1"}, "a token outside the vocabulary seeds nothing"


@pytest.mark.parametrize(
    ("params", "tokens", "fails"),
    [
        ({**decode_params(), "pd_seed_first_token": True}, {"d1": VOCAB - 1}, False),  # last id: a token
        ({**decode_params(), "pd_seed_first_token": True}, {"d1": VOCAB}, True),  # first id past it
        ({**decode_params(), "pd_seed_first_token": True}, {"d1": -1}, True),
        ({**decode_params(), "pd_seed_first_token": True}, {}, True),  # landed, but Done carried no token
        (_returned(VOCAB - 1), {}, False),  # standard flow: P's answer carries it
        (_returned(VOCAB), {}, True),
        (_returned(VOCAB), {"d1": 3}, False),  # Done's token wins over a bad copy in the answer
        (decode_params(), {"d1": VOCAB}, False),  # not seeded: the token is not used anyway
    ],
)
def test_a_seeded_load_that_ended_without_a_usable_token_ends_with_an_error(
    params: dict[str, object], tokens: dict[str, int], fails: bool
) -> None:
    """The rule is "any seeded load that ended without a usable token", not only a failed one: a load that
    landed whole but whose token is missing or outside the vocabulary would otherwise decode unseeded and
    repeat the client's first token. Named requests are neither seeded nor aborted as loads in flight."""
    side, _ = make_side()
    req = _loaded(side, params)
    assert side.loads_to_fail({"d1"}, tokens) == ({"d1"} if fails else set())
    side.update_connector_output({"d1"}, tokens)
    if fails:
        assert req.num_output_tokens == 0
        req.status = RequestStatus.FINISHED_ERROR
        assert side.request_finished(req, [3, 4]) == (False, None)  # type: ignore[arg-type]
        assert side.build_connector_meta(FakeOutput({})).aborted_recvs == []  # type: ignore[arg-type]


@pytest.mark.parametrize("token", [VOCAB, VOCAB + 5, 2**31 - 1])
def test_a_token_outside_the_vocabulary_is_never_used(token: int) -> None:
    """From a faulty or hostile P (``Done``) or caller (the body): the model's embedding lookup would crash
    the engine. ``update_connector_output`` never seeds with it (and ``loads_to_fail`` ends such a request
    first: test_a_seeded_load_that_ended_without_a_usable_token_ends_with_an_error)."""
    side, _ = make_side()
    req = _loaded(side, {**decode_params(), "pd_seed_first_token": True})
    side.update_connector_output({"d1"}, {"d1": token})
    assert req.num_output_tokens == 0 and req.num_tokens == 64
    side, _ = make_side()
    req = _loaded(side, _returned(token))
    side.update_connector_output({"d1"}, {})
    assert req.num_output_tokens == 0 and req.num_tokens == 64
    side, _ = make_side()
    req = _loaded(side, _returned(VOCAB - 1))  # the last id of the vocabulary is a token
    side.update_connector_output({"d1"}, {})
    assert list(req.output_token_ids) == [VOCAB - 1]


def test_prefill_answers_its_first_token() -> None:
    """P's answer (vLLM's standard flow: D's params) carries the token P sampled; an aborted prefill's
    answer carries none."""
    side, _ = make_side()
    req = FakeRequest("p1", {"do_remote_decode": True}, list(range(40)))
    side.update_state_after_alloc(req, FakeBlocks([]), 0)  # type: ignore[arg-type]
    req.status, req.output_token_ids = RequestStatus.FINISHED_LENGTH_CAPPED, [0]
    _, params = side.request_finished(req, [1, 2])  # type: ignore[arg-type]
    returned = wire.parse_params(params)
    assert isinstance(returned, wire.PrefillReturned) and returned.pd_first_token == 0


def test_prefill_hands_its_first_token_to_the_worker() -> None:
    """What ``Done`` carries to D: the token P sampled after the prompt (none for an aborted request)."""
    side, _ = make_side()
    for req_id, status, outputs, expected in (
        ("p1", RequestStatus.FINISHED_LENGTH_CAPPED, [77], FinishedSend("p1", True, True, 77)),
        ("p2", RequestStatus.FINISHED_STOPPED, [2], FinishedSend("p2", True, True, 2)),
        ("p3", RequestStatus.FINISHED_ABORTED, [], FinishedSend("p3", False, True, None)),
    ):
        req = FakeRequest(req_id, {"pd_role": "prefill", "pd_transfer_id": req_id}, list(range(40)))
        side.update_state_after_alloc(req, FakeBlocks([]), 0)  # type: ignore[arg-type]
        req.status, req.output_token_ids = status, outputs
        side.request_finished(req, [1, 2])  # type: ignore[arg-type]
        assert side.build_connector_meta(FakeOutput({})).finished_sends == [expected]  # type: ignore[arg-type]
