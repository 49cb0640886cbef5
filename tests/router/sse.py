"""Helpers to read an SSE body the way a client would."""

from __future__ import annotations

import json
import re
from typing import Any

_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def events(raw: bytes) -> list[bytes]:
    """Each ``data: ...\\n\\n`` event, separator included; asserts nothing else is in the body."""
    parts = raw.split(b"\n\n")
    assert parts[-1] == b"", raw[-100:]
    return [p + b"\n\n" for p in parts[:-1]]


def payloads(raw: bytes) -> list[Any]:
    out = []
    for e in events(raw):
        assert e.startswith(b"data: ")
        body = e[6:-2]
        out.append(body.decode() if body == b"[DONE]" else json.loads(body))
    return out


def text_of(raw: bytes) -> str:
    text = ""
    for p in payloads(raw):
        if isinstance(p, dict):
            for c in p.get("choices", []):
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


def normalized(raw: bytes) -> bytes:
    """The body with response ids and timestamps blanked (they differ between any two requests)."""
    return _VOLATILE.sub(rb'"\1":0', raw)
