"""The chaos benchmark's load: its prompts, their known answers, one request's classification, the seeded
fault timeline and the recovery figures. Used by ``benchmarks.chaos`` (the run) in the benchmark's process.

A prompt is a completion (token ids) or a chat (a user message of words); each is asked greedily with
``ignore_eos``, so its answer is fixed. Known answers are recorded on a colocated server before any fault and
compared token id for token id where the engine returns token ids for that request (vLLM: completions and
chat, streamed or not; SGLang: completions), text for text otherwise (SGLang's chat streams carry no ids).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

SERVED = "model"
OUTCOMES = ("ok", "failed_clean", "wrong_tokens", "hung", "disconnected")
#: Words of the chat prompts (English words tokenize to about one token each).
_TEXT = (
    "the of and to in is was for on that with as by at from his an were are which this be or had not "
    "but first new two time year city state world river school house water music light table window "
    "paper letter number "
    "order point story system market family garden summer winter evening"
)
WORDS = tuple(_TEXT.split())


@dataclass(frozen=True)
class Prompt:
    """One distinct prompt: token ids for /v1/completions, or a user message for /v1/chat/completions."""

    tokens: tuple[int, ...] = ()
    message: str = ""

    @property
    def chat(self) -> bool:
        return bool(self.message)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass(frozen=True)
class Answer:
    """A prompt's greedy answer: its token ids where the engine returns them for this prompt, else None (its
    text is compared), and its text."""

    ids: tuple[int, ...] | None
    text: str

    def want(self) -> list[int] | str:
        return list(self.ids) if self.ids is not None else self.text


@dataclass
class Record:
    """One request: when it started and ended (seconds into the load), how it ended, and what it was (its
    path, and whether it was streamed)."""

    start: float
    end: float
    outcome: str
    detail: str = ""
    kind: str = ""
    #: Tokens (or characters, compared by text) of the answer received before it ended.
    tokens: int = 0


def prompts(model: Path, n: int, seed: int) -> list[Prompt]:
    """``n`` distinct prompts of mixed lengths, alternately completions and chats: a third short (on vLLM they
    stay on D), the rest long enough for P->D."""
    rng = random.Random(f"{seed}:prompts")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    out = []
    for i in range(n):
        short = i % 3 == 0
        if i % 2 == 0:
            length = rng.randint(16, 120) if short else rng.randint(300, 800)
            out.append(Prompt(tokens=tuple(rng.randrange(10, vocab - 10) for _ in range(length))))
        else:  # words, so about 1-2 tokens each: within the context beside the chat template
            words = rng.randint(10, 60) if short else rng.randint(200, 420)
            out.append(Prompt(message=" ".join(rng.choice(WORDS) for _ in range(words))))
    return out


def body(prompt: Prompt, max_tokens: int, stream: bool, ids: bool) -> dict[str, Any]:
    """A greedy request of exactly ``max_tokens`` tokens; ``ids``: ask for the answer's token ids."""
    out: dict[str, Any] = {
        "model": SERVED,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if prompt.chat:
        out["messages"] = [{"role": "user", "content": prompt.message}]
    else:
        out["prompt"] = list(prompt.tokens)
    if ids:
        out["return_token_ids"] = True  # compared as ids: text splits multi-byte characters differently
    return out


def piece(choice: dict[str, Any], chat: bool, stream: bool, ids: bool) -> list[int] | str:
    """What one choice (a whole answer or a stream event's) adds to the answer: its token ids or its text."""
    return token_ids(choice) if ids else text(choice, chat, stream)


def token_ids(choice: dict[str, Any]) -> list[int]:
    return [int(t) for t in choice.get("token_ids") or []]


def text(choice: dict[str, Any], chat: bool, stream: bool) -> str:
    if chat:
        return (choice.get("delta" if stream else "message") or {}).get("content") or ""
    return choice.get("text") or ""


async def known_answers(
    url: str, items: list[Prompt], max_tokens: int, ids: Callable[[Prompt], bool]
) -> list[Answer]:
    """Each prompt's greedy answer from one server alone (colocated: no transfer), before any fault;
    ``ids(prompt)``: whether the engine returns token ids for it."""
    limit = asyncio.Semaphore(8)
    async with aiohttp.ClientSession() as session:

        async def answer(prompt: Prompt) -> Answer:
            want_ids = ids(prompt)
            payload = body(prompt, max_tokens, False, want_ids)
            async with limit, session.post(url + prompt.path, json=payload) as resp:
                resp.raise_for_status()
                choice = (await resp.json())["choices"][0]
            return Answer(tuple(token_ids(choice)) if want_ids else None, text(choice, prompt.chat, False))

        return list(await asyncio.gather(*(answer(p) for p in items)))


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    prompt: Prompt,
    answer: Answer,
    max_tokens: int,
    deadline_s: float,
    mode: str,
    t0: float,
) -> Record:
    """Send one request and classify how it ended (``mode``: plain, stream or drop)."""
    start = time.monotonic() - t0
    want = answer.want()
    ids = answer.ids is not None
    got: list[int] | str = [] if ids else ""  # the answer so far
    detail = ""

    def done(outcome: str) -> Record:
        why = (
            f"{mode} {prompt.path}: got {got!r}, want {want!r}; {detail}"
            if outcome == "wrong_tokens"
            else detail
        )
        kind = prompt.path + (" stream" if mode != "plain" else "")
        return Record(start, time.monotonic() - t0, outcome, why, kind, len(got))

    try:
        async with asyncio.timeout(deadline_s):
            payload = body(prompt, max_tokens, mode != "plain", ids)
            resp = await _post(session, url + prompt.path, payload)
            async with resp:
                if resp.status != 200:
                    detail = f"HTTP {resp.status}: {_message(await resp.text())}"
                    return done("failed_clean")
                if mode == "plain":
                    got = piece((await resp.json())["choices"][0], prompt.chat, False, ids)
                    return done("ok" if got == want else "wrong_tokens")
                ended = False
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        ended = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        detail = f"stream error: {_message(data)}"
                        break
                    for choice in event["choices"]:  # the usage chunk has none
                        got += piece(choice, prompt.chat, True, ids)  # type: ignore[operator]
                    if mode == "drop":
                        return done("disconnected")  # leaving the block drops the connection mid-stream
                if want[: len(got)] != got:
                    return done("wrong_tokens")
                if not ended and not detail:
                    detail = "stream ended without [DONE]"
                return done("ok" if ended and got == want else "failed_clean")
    except TimeoutError:
        detail = f"no end within {deadline_s} s"
        return done("hung")
    except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError, KeyError) as e:
        detail = repr(e)[:200]
        return done("wrong_tokens" if got and want[: len(got)] != got else "failed_clean")


def _message(text: str) -> str:
    """The message of an OpenAI error body (``{"error": {"message": ...}}``), else the text, shortened."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text[:300]
    message = error.get("message") if isinstance(error, dict) else error
    return str(message)[:300]


async def _post(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> aiohttp.ClientResponse:
    """POST, retrying while nothing listens (the router restarting), as a client with a retry policy does;
    the caller's deadline bounds it."""
    while True:
        try:
            return await session.post(url, json=payload)
        except aiohttp.ClientConnectorError:
            await asyncio.sleep(0.2)  # back-off before the next connection attempt


def timeline(requests: int, faults: dict[str, int], seed: int) -> list[tuple[int, str]]:
    """(requests started before it, kind) for every fault but client disconnects, seeded and in order."""
    rng = random.Random(f"{seed}:timeline")
    events = [
        (rng.randint(requests // 20, requests * 17 // 20), kind)
        for kind, n in faults.items()
        if kind != "client_disconnect"
        for _ in range(n)
    ]
    return sorted(events)


async def load(
    url: str,
    items: list[Prompt],
    answers: list[Answer],
    *,
    requests: int,
    concurrency: int,
    faults: dict[str, int],
    max_tokens: int,
    deadline_s: float,
    backoff_s: float,
    seed: int,
    strike: Callable[[str], Coroutine[Any, Any, None]],
    t0: float,
) -> list[Record]:
    """``requests`` requests at up to ``concurrency`` at once, each of a seeded prompt and mode, with
    ``strike(kind)`` started at each point of the fault timeline; returns when every request and fault ended.
    A request that failed holds its slot ``backoff_s`` longer, as a client that backs off after an error:
    with one P/D pair every request fails while either restarts, and without it the failures would use up
    the requests within that minute, leaving none to measure the recovery by.
    Records' times are seconds since ``t0`` (the injector's clock too)."""
    rng = random.Random(f"{seed}:load")
    drops = set(rng.sample(range(requests), min(faults.get("client_disconnect", 0), requests)))
    pending_faults = timeline(requests, faults, seed)
    records: list[Record] = []
    limit = asyncio.Semaphore(concurrency)
    fault_tasks: list[asyncio.Task[None]] = []
    progress = _progress(requests)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def run(i: int) -> None:
            k = rng.randrange(len(items))
            mode = "drop" if i in drops else rng.choice(("plain", "stream"))
            try:
                record = await one_request(
                    session, url, items[k], answers[k], max_tokens, deadline_s, mode, t0
                )
                records.append(record)
                if record.outcome == "failed_clean":
                    await asyncio.sleep(backoff_s)  # the client waits before its next request
            finally:
                limit.release()
                progress(records)

        tasks = []
        for i in range(requests):
            while pending_faults and pending_faults[0][0] <= i:
                fault_tasks.append(asyncio.create_task(strike(pending_faults.pop(0)[1])))
            await limit.acquire()
            tasks.append(asyncio.create_task(run(i)))
        await asyncio.gather(*tasks)
        await asyncio.gather(*fault_tasks)
    return records


def _progress(total: int) -> Callable[[list[Record]], None]:
    """A rich progress line on stderr (stdout's last line is the JSON result)."""
    from collections import Counter

    from rich.console import Console
    from rich.progress import Progress

    bar = Progress(console=Console(stderr=True), transient=True)
    task = bar.add_task("chaos", total=total)
    bar.start()

    def update(records: list[Record]) -> None:
        counts = Counter(r.outcome for r in records)
        bar.update(task, completed=len(records), description=" ".join(f"{k}={counts[k]}" for k in OUTCOMES))
        if len(records) >= total:
            bar.stop()

    return update


def plot(records: list[Record], struck: list[tuple[float, str]], path: Path) -> None:
    """Request outcomes over time (by when each ended), the faults marked: the run's PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for i, outcome in enumerate(OUTCOMES):
        ends = [r.end for r in records if r.outcome == outcome]
        ax.scatter(ends, [i] * len(ends), s=4, label=f"{outcome} ({len(ends)})")
    for at, kind in struck:
        ax.axvline(at, color="grey", lw=0.6)
        ax.text(at, len(OUTCOMES) - 0.5, kind, rotation=90, fontsize=6, va="top")
    ax.set_yticks(range(len(OUTCOMES)), OUTCOMES)
    ax.set_xlabel("seconds into the load (request end); grey lines: faults")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def recovery(records: list[Record], struck: list[tuple[float, str]]) -> dict[str, list[float] | None]:
    """Per fault kind: seconds from each fault to the end of the first request started after it and answered
    right, as [p50, p99]; None for a kind whose faults all struck after the last request started (faults
    wait for each other, so a late one can miss the load)."""
    ok = sorted((r.start, r.end) for r in records if r.outcome == "ok")
    per: dict[str, list[float]] = {}
    for at, kind in struck:
        after = [end for start, end in ok if start >= at]
        per.setdefault(kind, [])
        if after:
            per[kind].append(min(after) - at)
    return {k: [pct(v, 50), pct(v, 99)] if v else None for k, v in per.items()}


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank), rounded to the millisecond."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 3)
