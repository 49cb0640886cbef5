"""vLLM's NixlConnector on P in the vllm-standard flow: its answer reaches D re-encoded, or counts as P's failure.

P is a configured worker, but what it answers still tells D which host to dial and which blocks to read, and D's
NixlConnector has no allow-list of its own: pd-router accepts the answer only when its ``remote_host`` is the
prefill worker's host and every field has the shape vLLM 0.32.0 gives it (``wire.NixlReturned``), and D gets those
fields and no others. ``returned_params`` is tested at its boundary, then the flow through the router with the
fake engines (``test_support.fake_vllm``, whose P answers whatever ``kv_answer`` a test sets).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pd_connector import wire
from router.balancer import Worker
from router.config import CircuitConfig, WorkerConfig
from router.health import CircuitBreaker
from router.upstream import UpstreamError, returned_params
from test_support.fake_vllm import generate
from tests.router.conftest import MODEL, long_prompt
from tests.router.sse import text_of


def nixl_answer(host: str = "127.0.0.1", **changes: Any) -> dict[str, Any]:
    """A prefill answer as vLLM 0.32.0's NixlConnector writes it in pull mode (field for field)."""
    answer: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[3, 4, 5]],
        "remote_engine_id": "4f1b2d9c-6a0e-4c41-9d0e-2b9f0c6a7e11",
        "remote_request_id": "cmpl-8c1e5a0f-0-4d2c9e1b",
        "remote_host": host,
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 80,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }
    answer.update(changes)
    return answer


def _worker(url: str, bootstrap: str = "") -> Worker:
    return Worker(WorkerConfig(url, bootstrap=bootstrap), "prefill", CircuitBreaker(CircuitConfig()))


def _data(params: Any) -> bytes:
    return msgspec.json.encode({"id": "cmpl-1", wire.KV_TRANSFER_PARAMS: params})


@pytest.mark.parametrize(
    ("url", "bootstrap", "host"),
    [
        ("http://127.0.0.1:8100", "", "127.0.0.1"),  # the host of the worker's URL
        ("http://P0.cluster:8100", "", "p0.cluster"),  # names compare as the URL parser spells them
        ("http://[fd00::1]:8100", "", "fd00::1"),
        ("http://[fd00::1]:8100", "", "[fd00::1]"),
        ("http://p0-api:8100", "10.0.0.5:7600", "10.0.0.5"),  # the configured address, when there is one
    ],
)
def test_a_nixl_answer_naming_the_prefill_worker_is_accepted_field_for_field(
    url: str, bootstrap: str, host: str
) -> None:
    answer = nixl_answer(host)
    params = returned_params(_data(answer), _worker(url, bootstrap))
    assert isinstance(params, wire.NixlReturned)
    assert wire.encode(params) == answer  # D gets what P said, nothing lost


def test_push_mode_answers_without_an_expiry_time_are_accepted() -> None:
    answer = nixl_answer(transfer_mode="push")
    del answer["remote_blocks_expiry_time"]
    params = returned_params(_data(answer), _worker("http://127.0.0.1:8100"))
    assert isinstance(params, wire.NixlReturned) and params.transfer_mode == "push"


def test_fields_outside_the_contract_are_not_forwarded() -> None:
    answer = nixl_answer(pd_seed_first_token=True, do_remote_decode_extra=1, kv_load_failure_policy="fail")
    params = returned_params(_data(answer), _worker("http://127.0.0.1:8100"))
    assert wire.encode(params) == nixl_answer()


@pytest.mark.parametrize(
    ("url", "bootstrap", "host"),
    [
        ("http://127.0.0.1:8100", "", "10.9.9.9"),  # any other host
        ("http://127.0.0.1:8100", "", "localhost"),  # names are not resolved: P must advertise as configured
        ("http://p0-api:8100", "10.0.0.5:7600", "p0-api"),  # the configured address wins over the URL's
        ("http://[fd00::1]:8100", "", "fd00::2"),
    ],
)
def test_a_nixl_answer_naming_another_host_is_the_prefill_workers_failure(
    url: str, bootstrap: str, host: str
) -> None:
    with pytest.raises(UpstreamError, match="remote_host is not") as e:
        returned_params(_data(nixl_answer(host)), _worker(url, bootstrap))
    assert e.value.kind == "protocol" and e.value.worker_fault


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"remote_block_ids": [3, 4, 5]}, "remote_block_ids"),  # the flat list of older vLLM versions
        ({"remote_block_ids": [[-1]]}, "remote_block_ids"),
        ({"remote_block_ids": None}, "remote_block_ids"),
        ({"remote_port": "5600"}, "remote_port"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_host": "127.0.0.1/evil"}, "remote_host"),
        ({"remote_host": ""}, "remote_host"),
        ({"remote_request_id": "a b"}, "remote_request_id"),
        ({"remote_engine_id": 7}, "remote_engine_id"),
        ({"tp_size": 0}, "tp_size"),
        ({"remote_num_tokens": -1}, "remote_num_tokens"),
        ({"transfer_mode": "teleport"}, "transfer_mode"),
        ({"do_remote_decode": True}, "do_remote_decode"),  # would ask D to hold its blocks for another
        ({"do_remote_prefill": False}, "do_remote_prefill"),
        ({"remote_blocks_expiry_time": 12.5}, "remote_blocks_expiry_time"),  # P never sets it
        ({"tp_size": None}, "tp_size"),
    ],
)
def test_a_malformed_nixl_answer_is_the_prefill_workers_failure(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(UpstreamError, match=f"NixlConnector.*{field}") as e:
        returned_params(_data(nixl_answer(**changes)), _worker("http://127.0.0.1:8100"))
    assert e.value.kind == "protocol"


def test_a_nixl_answer_missing_a_field_is_the_prefill_workers_failure() -> None:
    answer = nixl_answer()
    del answer["remote_port"]
    with pytest.raises(UpstreamError, match=r"NixlConnector.*remote_port"):
        returned_params(_data(answer), _worker("http://127.0.0.1:8100"))


def test_our_connectors_answer_is_still_ours() -> None:
    """PDConnector's answer carries ``remote_engine_id: null``: it is read as before, not as NIXL's."""
    ours = {**wire.encode(wire.PrefillReturned("p-req-1", "127.0.0.1:7600")), "remote_engine_id": None}
    assert returned_params(_data(ours), _worker("http://127.0.0.1:8100")) == wire.PrefillReturned(
        "p-req-1", "127.0.0.1:7600"
    )


# ---- through the router ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_gets_the_nixl_answer_and_no_seeding(make_cluster, stream: bool) -> None:
    """A streamed request is not seeded (NixlConnector's D samples its own first token): the client's tokens
    are D's, as many as asked for."""
    c = await make_cluster(n_prefill=1, n_decode=1, flow="vllm-standard")
    c.prefill[0].kv_answer = nixl_answer(extra="dropped")  # the cluster's P workers advertise 127.0.0.1
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 3, "stream": stream}
    r = await c.router.post("/v1/completions", json=body)
    raw = await r.read()
    assert r.status == 200 and r.headers["X-PD-Route"] == "disagg"
    (p,), (d,) = c.prefill[0].requests, c.decode[0].requests
    assert p[wire.KV_TRANSFER_PARAMS] == wire.encode(wire.StandardPrefill())
    assert d[wire.KV_TRANSFER_PARAMS] == nixl_answer()
    assert d["max_tokens"] == 3 and d["stream"] is stream
    expected = "".join(generate(long_prompt(), 3))
    assert (text_of(raw) if stream else msgspec.json.decode(raw)["choices"][0]["text"]) == expected
