"""Capture the KV events a real SGLang CPU server publishes, for ``tests/router/test_kv_events_sglang.py``.

Run from the repository root under the engine lock (one aggregated SGLang server, ~1-2 min):

    flock /tmp/pd-engines.lock nice -n 19 .venv/bin/python -m tests.router.data.capture_sglang_kv_events

It starts SGLang (tiny model, ``--kv-events-config`` with a ZMQ publisher on loopback, page size 1 as on CPU
by default, a KV pool small enough to evict), sends token-id prompts through ``/generate``: ``A``, then ``A + B``
(a child of A's node), then unrelated prompts until A's and B's pages are evicted, then ``/flush_cache``. Every
ZMQ message received is written to ``sglang_kv_events.msgpack`` with the prompts: ``{"prompts": {name: ids},
"messages": [[topic, seq, payload], ...], "sglang": version}``.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import msgspec
import zmq

from pd_disagg.engines import base_url, sglang_python, sglang_server
from pd_disagg.servers import free_port, running

OUT = Path(__file__).with_name("sglang_kv_events.msgpack")
MODEL = Path(".cache/models/tiny-llama")
PROMPTS = {
    "A": [(7 * i) % 1500 + 300 for i in range(40)],
    "B": [(11 * i) % 1500 + 300 for i in range(24)],
}
FILLERS = [[(13 * i + 17 * k) % 1500 + 300 for i in range(150)] for k in range(5)]


def generate(url: str, ids: list[int]) -> None:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200, resp.read()


def main() -> None:
    port = free_port()
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True}
    server = sglang_server(
        MODEL,
        log_dir=Path("logs/capture"),
        name="sglang-kv-events",
        context_length=256,
        max_total_tokens=400,
        extra_args=("--kv-events-config", json.dumps(config)),
    )
    # Subscribed before the server starts (ZMQ connects once the publisher binds), so every batch after its
    # start-up is received (the first of its warm-up request's may go before the connection is made).
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    messages: list[list[object]] = []

    def drain(quiet_s: float = 2.0) -> None:
        """Receive until nothing came for ``quiet_s`` (the publisher sends after each scheduler step)."""
        while sub.poll(int(quiet_s * 1000)):
            messages.append(sub.recv_multipart())

    try:
        with running(server, timeout_s=420):
            url = base_url(server)
            generate(url, PROMPTS["A"])
            drain()
            generate(url, PROMPTS["A"] + PROMPTS["B"])
            drain()
            for ids in FILLERS:
                generate(url, ids)
            drain()
            with urllib.request.urlopen(
                urllib.request.Request(url + "/flush_cache", method="POST"), timeout=30
            ):
                pass
            drain()
    finally:
        sub.close(linger=0)
        ctx.term()
    version = subprocess.run(
        [sglang_python(), "-c", "import sglang; print(sglang.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    OUT.write_bytes(
        msgspec.msgpack.encode(
            {"sglang": version, "prompts": PROMPTS, "fillers": FILLERS, "messages": messages}
        )
    )
    print(f"{len(messages)} messages from SGLang {version} -> {OUT}")


if __name__ == "__main__":
    main()
