"""Trust nothing a client sends: malformed requests and client-chosen transfer fields, through pd-router and
straight to the engines, get an error or run locally; nothing dials a client's address or holds a block.

Runs on the package's cluster and router (conftest.py) in the default configuration; each test ends by
proving P->D still serves (``pd_checks.Transfers``).
"""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from integration_tests.pd_checks import REFUSED, blocks_idle, blocks_to_load, metric
from integration_tests.pd_connector.cluster import (
    ROUTER_THRESHOLD,
    Cluster,
    body,
    post,
    through_router,
    token_ids,
    tokens,
)
from pd_connector import wire
from pd_disagg import pd_client
from tests.polling import wait_until


class _Listener:
    """A TCP listener a client names as a "prefill address": counts every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[_Listener]:
    trap = _Listener()
    yield trap
    trap.close()


def _client_transfer_fields(trap: str) -> list[dict[str, Any]]:
    """kv_transfer_params a hostile client may send: every role, a peer of its choosing, malformed shapes."""
    tid = uuid.uuid4().hex
    return [
        wire.encode(wire.StandardPrefill()),
        wire.encode(wire.PushPrefill(tid)),
        wire.encode(wire.PushDecode(tid, trap)),
        wire.encode(wire.PrefillReturned(tid, trap)),
        {"pd_role": "decode", "pd_transfer_id": ["x"], "pd_prefill_addr": trap},
        {"pd_role": "boss", "pd_prefill_addr": trap},
        {"do_remote_prefill": True, "pd_transfer_id": tid},
    ]


#: Malformed completions and the status pd-router answers (engines answer some other 4xx to a few of them).
BAD_BODIES: list[tuple[Any, int]] = [
    (b"{not json", 400),
    (b"[" * 5000 + b"]" * 5000, 400),
    (b'"a string"', 400),
    ({"model": "tiny", "prompt": 5}, 400),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400),
    ({"model": "nope", "prompt": "x"}, 404),
]


def test_bad_input_through_the_router(pd: Cluster, router: str, listener: _Listener) -> None:
    """Malformed requests get an OpenAI-style 4xx; client transfer fields (on both paths) make no server
    connect anywhere and hold no block; both engines still serve P->D afterwards."""
    for payload, status in BAD_BODIES:
        got, _, raw = post(router, "/v1/completions", payload)
        assert got == status, (payload[:40] if isinstance(payload, bytes) else payload, raw)
        assert set(json.loads(raw)["error"]) >= {"message", "type", "code"}
    got, _, raw = post(router, "/v1/completions", b"{}", {"content-type": "text/plain"})
    assert 400 <= got < 500 and "error" in json.loads(raw), raw
    for params in _client_transfer_fields(listener.addr):
        for n in (ROUTER_THRESHOLD // 2, ROUTER_THRESHOLD + 40):
            prompt = tokens(n, seed=7100 + n)
            extra: dict[str, Any] = {
                "kv_transfer_params": params,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_room": 7,
            }
            route, answer = through_router(router, body(prompt, **extra))
            assert token_ids(answer) == pd.reference(prompt), (params, route)
    assert listener.connections == 0, "a client-chosen address was dialled"
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "no block held")
    prompt = tokens(300, seed=7199)
    transfers = pd.transfers()
    assert through_router(router, body(prompt))[1]["choices"][0]["token_ids"] == pd.reference(prompt)
    transfers.check(1, blocks=blocks_to_load(len(prompt)))


def test_client_transfer_fields_sent_straight_to_the_engines(pd: Cluster, listener: _Listener) -> None:
    """The same fields sent to P's and D's own API servers (another proxy, or none): a role the engine does
    not play, a prefill address outside D's allow-list, malformed params are refused (counted) and the
    request runs locally; nothing dials the client's listener; D holds no block; P (whose decode params once
    crashed its engine) and D both keep serving P->D. Malformed HTTP gets a 4xx from each engine too."""
    for url in (pd.p_url, pd.d_url):
        for payload, _ in BAD_BODIES:
            status, _, raw = post(url, "/v1/completions", payload)
            assert 400 <= status < 500, (url, raw[:200])
        status, _, raw = post(url, "/v1/completions", b"{}", {"content-type": "text/plain"})
        assert 400 <= status < 500, (url, raw[:200])
    refused = metric(pd.p_url, REFUSED) + metric(pd.d_url, REFUSED)
    cases = _client_transfer_fields(listener.addr)
    prefill_roles = cases[:2]  # P takes these: it prefills and holds blocks for at most its lease
    for i, params in enumerate(cases):
        prompt = tokens(90, seed=7300 + i)
        for url in (pd.d_url, pd.p_url):
            if url == pd.p_url and params in prefill_roles:
                continue
            answer = pd_client.post_json(url + "/v1/completions", body(prompt, kv_transfer_params=params))
            assert token_ids(answer) == pd.reference(prompt), (url, params)
    assert listener.connections == 0, "a client-chosen address was dialled"
    wait_until(lambda: blocks_idle(pd.d_url), 10, "D holds no block for a client's transfer fields")
    wait_until(lambda: blocks_idle(pd.p_url), 10, "P holds no block for decode parameters")
    wait_until(
        lambda: metric(pd.p_url, REFUSED) + metric(pd.d_url, REFUSED) >= refused + 2 * len(cases) - 2,
        15,
        "every refusal counted",
    )
    prompt = tokens(200, seed=7399)
    transfers = pd.transfers()
    assert pd.disaggregated(prompt) == pd.reference(prompt)
    transfers.check(1, blocks=blocks_to_load(len(prompt)))
