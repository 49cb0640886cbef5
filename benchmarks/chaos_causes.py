"""Why each request of a chaos run failed: the cause of every ``failed_clean``, and how many broken streams
pd-router resumed. Called by ``benchmarks.chaos.run`` in the benchmark's process after the load.

The issue allows a failure only where the serving node died with no survivor able to continue. The client
cannot see which node served it, so each failure is attributed from what can be observed: the error the
client got (its HTTP status and message, or how its stream ended), the faults whose window overlapped the
request (kind and target, from ``Injector.windows``), and whether a P and a D were up when it failed (no
kill, restart or stop holding every server of the role at that moment). pd-router's log (one file across its
restarts) says how many streams it resumed on another D and how many it could not.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.chaos_load import Record


@dataclass(frozen=True)
class Window:
    """One fault, from when it struck to when its target was back (a kill: healthy after the restart; a
    stop: SIGCONT; a proxy fault: its delay or stall over; a reset or garbage: the moment itself)."""

    start: float
    end: float
    kind: str
    target: str  # the server's name ("" for a proxy fault: every P<->D connection)
    role: str  # "prefill", "decode", "router" or "links"


#: The error messages the router sends (router/proxy.py, router/resume.py, router/relay.py) and the client's
#: own endings, each to a short cause name; the first pattern that matches wins.
_CAUSES: tuple[tuple[str, str], ...] = (
    (r"no healthy decode worker", "no_decode_worker"),
    (r"no healthy prefill worker", "no_prefill_worker"),
    (r"inside a character", "resume_refused_partial_character"),
    (r"could not be resumed", "resume_failed"),
    (r"upstream workers timed out after", "attempts_exhausted_timeout"),
    (r"upstream workers failed \((\w+)\) after", "attempts_exhausted_{0}"),
    (r"upstream workers are overloaded|HTTP 429", "overloaded"),
    (r"the request timed out", "request_timeout"),
    (r"HTTP 5\d\d", "http_5xx_other"),
    (
        r"ServerDisconnected|ClientPayloadError|ClientOSError|Connection reset|ended without",
        "connection_lost",
    ),
)


def cause_of(detail: str) -> str:
    """The cause name of a failure's ``detail`` (what the client saw); "other" for none of the known ones."""
    for pattern, name in _CAUSES:
        m = re.search(pattern, detail)
        if m:
            return name.format(*m.groups())
    return "other"


def overlapping(record: Record, windows: list[Window]) -> list[Window]:
    """The faults that were in effect at some moment of the request's life."""
    return [w for w in windows if w.start <= record.end and w.end >= record.start]


def roles_down(at: float, windows: list[Window], roles: dict[str, int]) -> list[str]:
    """The roles (``roles``: how many servers each has) with no server up at ``at``: every one of them killed
    and not yet healthy again, or stopped (garbage and proxy faults take no server down)."""
    out = []
    for role, n in roles.items():
        down = {
            w.target for w in windows if w.role == role and w.start <= at <= w.end and w.kind != "garbage"
        }
        if len(down) >= n:
            out.append(role)
    return out


def router_resumes(log: Path) -> dict[str, int]:
    """What pd-router's log says about broken streams: resumed on another D, and ended unresumed."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    return {
        "resumed": text.count("resuming a broken stream on "),
        # of which (pd-router since this was added to its log line): chats continued as token-id completions
        "resumed_chats_token_exact": text.count("(chat, token-exact as a completion)"),
        "resumed_chats_from_text": text.count("(chat, from its text)"),
        "not_resumed": text.count("not resuming a broken stream"),
        "attempts_failed": len(re.findall(r"attempt \d+ failed: ", text)),
    }


def attribute(records: list[Record], windows: list[Window], roles: dict[str, int]) -> dict[str, Any]:
    """Counts of the failed requests by cause, each with the faults overlapping them and how many failed while
    a survivor was up (``survivor_up``: the router, a P and a D up when it failed); up to 3 examples of each
    cause (the client's message). ``roles``: how many servers each role has (the router: 1).

    A connection to the router that dropped while the router was down (killed by ``router_restart``) is
    ``router_died``: the router held the client's connection, and with one router nothing else can continue
    it. The same drop with the router up stays ``connection_lost``."""
    by: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.outcome != "failed_clean":
            continue
        cause = cause_of(r.detail)
        down = roles_down(r.end, windows, roles)
        if cause == "connection_lost" and "router" in down:
            cause = "router_died"
        entry = by.setdefault(
            cause, {"n": 0, "survivor_up": 0, "streamed_tokens": 0, "faults": Counter(), "examples": []}
        )
        entry["n"] += 1
        entry["survivor_up"] += not down
        entry["streamed_tokens"] += r.tokens > 0
        over = overlapping(r, windows)
        entry["faults"].update({w.kind for w in over} or {"none"})
        if len(entry["examples"]) < 3:
            entry["examples"].append(f"{r.kind}: {r.detail[:160]}")
    for entry in by.values():
        entry["faults"] = dict(entry["faults"].most_common())
    return dict(sorted(by.items(), key=lambda kv: -int(kv[1]["n"])))
