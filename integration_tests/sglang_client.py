"""A small SGLang PD client for the integration tests: what a PD router does, in a few lines.

SGLang's PD protocol sends the same ``/generate`` body to the prefill server (P) and the decode server (D),
both carrying ``bootstrap_host``/``bootstrap_port`` (P's bootstrap server) and a random 63-bit
``bootstrap_room`` that pairs the two legs. D's answer is the client's answer; P's is one token.
Runs in the pytest process; stdlib only, so it cannot hide a protocol detail behind a library.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    """One HTTP answer: status, decoded JSON (or ``{"raw": text}``) and how long it took."""

    status: int
    body: dict[str, Any]
    seconds: float

    @property
    def ok(self) -> bool:
        """HTTP 200 and not ended by an abort (SGLang reports failed PD transfers either way)."""
        finish = (self.body.get("meta_info") or {}).get("finish_reason") or {}
        return self.status == 200 and finish.get("type") != "abort"

    @property
    def output_ids(self) -> list[int]:
        return list(self.body.get("output_ids") or [])


def new_room() -> int:
    return random.getrandbits(63)


def body(
    prompt: str, max_new_tokens: int, bootstrap: tuple[str, int] | None, room: int | None
) -> dict[str, Any]:
    """A greedy ``/generate`` body; with ``bootstrap`` it is a PD request for ``room``."""
    out: dict[str, Any] = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
    }
    if bootstrap is not None:
        out.update(bootstrap_host=bootstrap[0], bootstrap_port=bootstrap[1], bootstrap_room=room)
    return out


def post(url: str, payload: dict[str, Any], timeout_s: float) -> Reply:
    """POST JSON; HTTP errors become a ``Reply`` (the tests assert on them), transport errors raise."""
    start = time.monotonic()
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = {"raw": raw.decode(errors="replace")}
    if not isinstance(decoded, dict):
        decoded = {"raw": decoded}
    return Reply(status, decoded, time.monotonic() - start)


def generate(base_url: str, prompt: str, max_new_tokens: int, timeout_s: float = 120) -> Reply:
    """Aggregated (no PD) request."""
    return post(base_url + "/generate", body(prompt, max_new_tokens, None, None), timeout_s)


def generate_pd(
    prefill_url: str,
    decode_url: str,
    bootstrap: tuple[str, int],
    prompt: str,
    max_new_tokens: int,
    room: int | None = None,
    timeout_s: float = 120,
) -> tuple[Reply, Reply]:
    """Send both legs concurrently, as SGLang's router does; returns ``(prefill, decode)`` replies."""
    payload = body(prompt, max_new_tokens, bootstrap, new_room() if room is None else room)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(post, prefill_url + "/generate", payload, timeout_s)
        d = pool.submit(post, decode_url + "/generate", payload, timeout_s)
        return p.result(), d.result()


@contextlib.contextmanager
def streaming(base_url: str, payload: dict[str, Any], events: int, timeout_s: float) -> Iterator[int]:
    """Stream ``payload`` and yield once ``events`` SSE events have arrived, the request still running;
    close the connection on leaving (a client abort if it has not finished).

    Yields the number of events read (fewer when the stream ended first).
    """
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(
            "POST",
            "/generate",
            json.dumps({**payload, "stream": True}),
            {"content-type": "application/json"},
        )
        resp = conn.getresponse()
        seen = 0
        while seen < events:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                seen += 1
        yield seen
    finally:
        conn.close()


def stream_then_disconnect(base_url: str, payload: dict[str, Any], chunks: int, timeout_s: float) -> int:
    """Stream ``payload`` and close the connection after ``chunks`` SSE events (a client abort).

    Returns the number of events read (fewer when the stream ended first).
    """
    with streaming(base_url, payload, chunks, timeout_s) as seen:
        return seen


def get_json(url: str, timeout_s: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())
