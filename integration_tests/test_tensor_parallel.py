"""PDConnector across tensor parallelism on real vLLM CPU servers: P TP 2 -> D TP 1, P TP 2 -> D TP 2 and
P TP 1 -> D TP 2, on the tiny GQA model (2 KV heads: one per rank at TP 2), over the same-host ``cma`` data
plane (``process_vm_writev`` from P's worker processes into D's; tcp and ucx run in the other modules).

vLLM's CPU backend runs TP 2 as two worker processes, one per core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
Each P rank listens on the side channel's port + rank; a D rank names only rank 0's and takes each of its
heads from the P rank holding it. Proven per pair: the greedy tokens equal D's own colocated answer, exactly
the prompt's KV blocks moved (summed over ranks), every D rank completed its load, nothing failed or was
recomputed; and a negative control where one P rank zeroes its heads changes the answer, so every rank's
bytes are used. Pairs run one after the other (at most two TP servers at a time fit the two cores). Up to four
vLLM CPU workers share the two cores here and each spins after its steps, so a worker's I/O thread can wait
seconds for a core: the control plane's heartbeat timeout is 30 s (10 s by default).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integration_tests.pd_checks import Transfers, blocks_idle, blocks_to_load, decode_hit_after_seen
from pd_disagg import pd_client
from pd_disagg.engines import base_url, vllm_server
from pd_disagg.servers import ManagedServer, free_ports
from tests.polling import wait_until

MAX_MODEL_LEN = 1024
SECRET = "tp-secret"


def _server(model: Path, log_dir: Path, role: str, tp: int, side_channel_port: int) -> ManagedServer:
    extra: dict[str, Any] = {
        "secret": SECRET,
        "transport": "cma",
        "load_timeout_s": 60.0,
        "heartbeat_timeout_s": 30.0,
    }
    if role == "prefill":
        extra |= {"side_channel_port": side_channel_port, "lease_s": 60.0, "test_allow_corruption": True}
    return vllm_server(
        model,
        log_dir=log_dir,
        name=f"tp-{role}{tp}",
        cpu_core="0|1" if tp == 2 else (0 if role == "prefill" else 1),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        extra_args=["--served-model-name", "tiny", "--tensor-parallel-size", str(tp)],
        kv_transfer_config={
            "kv_connector": "PDConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
    )


class Pairs:
    """One P and one D of the TP sizes a test asks for; restarts only the side whose TP changes."""

    def __init__(self, start: Callable[..., list[ManagedServer]], model: Path, log_dir: Path) -> None:
        self._start, self._model, self._log_dir = start, model, log_dir
        self.port = free_ports(2)
        self.servers: dict[str, tuple[int, ManagedServer]] = {}

    def ensure(self, p_tp: int, d_tp: int) -> tuple[str, str]:
        todo = []
        for role, tp in (("prefill", p_tp), ("decode", d_tp)):
            have = self.servers.get(role)
            if have is None or have[0] != tp or not have[1].alive():
                if have is not None:
                    have[1].stop()
                server = _server(self._model, self._log_dir, role, tp, self.port)
                self.servers[role] = (tp, server)
                todo.append(server)
        if todo:
            self._start(*todo)
            for server in todo:  # a TP server's first forward sets up its ranks' collectives: seconds, once
                pd_client.post_json(base_url(server) + "/v1/completions", _body([11, 12, 13]))
        return base_url(self.servers["prefill"][1]), base_url(self.servers["decode"][1])


@pytest.fixture(scope="module")
def pairs(start_servers, tiny_model: Path, log_dir: Path) -> Iterator[Pairs]:
    yield Pairs(start_servers, tiny_model, log_dir)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1900) for _ in range(n)]


def _body(prompt: list[int]) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True}


def _ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def _check_pair(pairs: Pairs, p_tp: int, d_tp: int) -> None:
    """Two prompt sizes (one block; several chunks), each twice: one D already answered (it loads the last
    block), one it has not (it loads everything); tokens as colocated, exact blocks summed over the ranks, every
    D rank loaded, over cma."""
    p_url, d_url = pairs.ensure(p_tp, d_tp)
    for role in ("prefill", "decode"):
        assert "data plane cma" in pairs.servers[role][1].log_tail(400)
    bootstrap = f"127.0.0.1:{pairs.port}"
    for i, n in enumerate((33, 700)):
        seen = _tokens(n, seed=40_000 + 100 * p_tp + 10 * d_tp + i)
        colocated = _ids(pd_client.post_json(d_url + "/v1/completions", _body(seen)))
        transfers = Transfers(p_url, d_url)
        answer, p_answer = pd_client.disaggregated(p_url, d_url, bootstrap, _body(seen))
        assert isinstance(p_answer, dict), p_answer
        assert _ids(answer) == colocated, f"{n} tokens, P TP {p_tp} -> D TP {d_tp}"
        transfers.check(1, blocks=blocks_to_load(n, decode_hit_after_seen(n)), decode_ranks=d_tp)
        fresh = _tokens(n, seed=41_000 + 100 * p_tp + 10 * d_tp + i)
        colocated = _ids(pd_client.post_json(p_url + "/v1/completions", _body(fresh)))
        transfers = Transfers(p_url, d_url)
        answer, _ = pd_client.disaggregated(p_url, d_url, bootstrap, _body(fresh))
        assert _ids(answer) == colocated, f"{n} fresh tokens, P TP {p_tp} -> D TP {d_tp}"
        transfers.check(1, blocks=blocks_to_load(n), decode_ranks=d_tp)
    wait_until(lambda: blocks_idle(p_url) and blocks_idle(d_url), 15, "no block held")


# In this order each test restarts one server at most: (2, 1) -> (2, 2) -> (2, 2) -> (1, 2).
def test_prefill_tp2_to_decode_tp1(pairs: Pairs) -> None:
    _check_pair(pairs, 2, 1)


def test_prefill_tp2_to_decode_tp2(pairs: Pairs) -> None:
    _check_pair(pairs, 2, 2)


def test_one_rank_zeroing_its_heads_changes_the_answer(pairs: Pairs) -> None:
    """Negative control (P TP 2): the last P rank zeroes the heads it pushes; the transfer completes and
    D's answer changes, so the heads every rank sends are the ones D decodes from."""
    p_url, d_url = pairs.ensure(2, 2)
    prompt = _tokens(400, seed=42_000)
    reference = _ids(pd_client.post_json(p_url + "/v1/completions", _body(prompt)))
    transfers = Transfers(p_url, d_url)
    answer, _ = pd_client.disaggregated(p_url, d_url, f"127.0.0.1:{pairs.port}", _body(prompt), corrupt=True)
    assert _ids(answer) != reference
    transfers.check(1, blocks=blocks_to_load(len(prompt)), decode_ranks=2)


def test_prefill_tp1_to_decode_tp2(pairs: Pairs) -> None:
    _check_pair(pairs, 1, 2)
