"""Measure a profile on a live OpenAI-compatible server (vLLM or SGLang): ``pd-plan profile``.

Runs in the user's shell (or the validation benchmark) as an aiohttp client of ``/v1/completions``. Prompts
are random token ids (a list of ints, which vLLM and SGLang accept), so every prompt has exactly the
requested length and never hits the prefix cache. Three phases:

1. unloaded TTFT: one ``isl``-token request at a time with ``max_tokens=1``;
2. saturated prefill: ``prefill_requests`` such requests, ``prefill_concurrency`` in flight; prompt tokens
   divided by wall time is ``prefill_max_tokens_per_s``; the TTFT overhead is the unloaded TTFT minus
   ``isl / prefill_max_tokens_per_s`` (what is not prefill compute);
3. decode (against ``decode_endpoint`` when the D pool is a different server): for each batch size ``b``,
   ``b`` concurrent streams of ``decode_tokens`` tokens (``ignore_eos``);
   the median of (last token - first token) / (tokens - 1) is the TPOT at ``b``.

A rich progress bar on stderr counts requests.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
import msgspec
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from planner.profile import DecodePoint, Profile, check


class ProfilerError(RuntimeError):
    """The server refused a request or answered something that is not an OpenAI completion."""


class ProfilerConfig(msgspec.Struct, frozen=True):
    """What to measure and how hard; defaults suit a GPU server, the tests use small values."""

    endpoint: str
    isl: int
    model: str | None = None
    decode_endpoint: str | None = None
    ttft_samples: int = 3
    prefill_requests: int = 16
    prefill_concurrency: int = 4
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_tokens: int = 64
    decode_prompt_tokens: int = 16
    token_id_low: int = 10
    token_id_high: int = 1000
    timeout_s: float = 300.0
    seed: int = 0


class RequestTiming(msgspec.Struct, frozen=True):
    """One streamed completion as the client saw it (seconds since the request was sent)."""

    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (NaN for a one-token answer)."""
        if self.completion_tokens < 2:
            return float("nan")
        return (self.total_s - self.ttft_s) / (self.completion_tokens - 1)


class _Choice(msgspec.Struct):
    text: str = ""


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


_chunk_decoder = msgspec.json.Decoder(_Chunk)


async def served_model(session: aiohttp.ClientSession, endpoint: str) -> str:
    """The first model id the server lists at ``/v1/models``."""
    async with session.get(f"{endpoint}/v1/models") as resp:
        body = await resp.read()
        if resp.status != 200:
            raise ProfilerError(f"GET {endpoint}/v1/models -> {resp.status}: {body[:300]!r}")
    try:
        models = msgspec.json.decode(body, type=_Models)
    except msgspec.DecodeError as exc:
        raise ProfilerError(f"{endpoint}/v1/models: unexpected answer: {exc}") from exc
    if not models.data:
        raise ProfilerError(f"{endpoint}/v1/models lists no model")
    return models.data[0].id


async def stream_completion(
    session: aiohttp.ClientSession, endpoint: str, model: str, prompt: Sequence[int], max_tokens: int
) -> RequestTiming:
    """Send one streamed completion of exactly ``max_tokens`` tokens and time its first and last token."""
    payload = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    chunks = 0
    usage = None
    async with session.post(f"{endpoint}/v1/completions", json=payload) as resp:
        if resp.status != 200:
            raise ProfilerError(
                f"POST {endpoint}/v1/completions -> {resp.status}: {(await resp.read())[:300]!r}"
            )
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            try:
                chunk = _chunk_decoder.decode(data)
            except msgspec.DecodeError as exc:
                raise ProfilerError(f"{endpoint}: not an OpenAI completion chunk: {data[:200]!r}") from exc
            if chunk.choices:
                last = time.perf_counter()
                first = first or last
                chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
    if first is None or last is None:
        raise ProfilerError(f"{endpoint}: the stream ended without a token")
    return RequestTiming(
        ttft_s=first - start,
        total_s=last - start,
        prompt_tokens=usage.prompt_tokens if usage else len(prompt),
        completion_tokens=usage.completion_tokens if usage else chunks,
    )


class RandomPrompts:
    """Random token-id prompts, each different so the prefix cache never helps."""

    def __init__(self, seed: int, low: int, high: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._low, self._high = low, high

    def __call__(self, length: int) -> list[int]:
        return [int(t) for t in self._rng.integers(self._low, self._high, length)]


async def _bounded(
    count: int, concurrency: int, job: Callable[[], Awaitable[RequestTiming]], advance: Callable[[], None]
) -> list[RequestTiming]:
    """Run ``count`` jobs with at most ``concurrency`` in flight; ``advance`` ticks the progress bar."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one() -> RequestTiming:
        async with semaphore:
            result = await job()
            advance()
            return result

    return list(await asyncio.gather(*(one() for _ in range(count))))


def _monotone(tpots: list[float]) -> list[float]:
    """TPOT cannot fall as the batch grows; flatten measurement noise that says otherwise."""
    return [float(v) for v in np.maximum.accumulate(tpots)]


async def measure_profile(config: ProfilerConfig, console: Console | None = None) -> Profile:
    """Run the three phases against ``config.endpoint`` and return the (checked) profile."""
    if config.isl < 1 or not config.decode_batches or min(config.decode_batches) < 1:
        raise ValueError("isl and every decode batch must be >= 1")
    endpoint = config.endpoint.rstrip("/")
    decode_endpoint = (config.decode_endpoint or endpoint).rstrip("/")
    prompts = RandomPrompts(config.seed, config.token_id_low, config.token_id_high)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    console = console or Console(file=sys.stderr)
    total = 1 + config.ttft_samples + config.prefill_requests + sum(config.decode_batches)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await served_model(session, endpoint)
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("warm-up", total=total)

            def advance() -> None:
                progress.advance(task)

            def prefill_job() -> Awaitable[RequestTiming]:
                return stream_completion(session, endpoint, model, prompts(config.isl), 1)

            await _bounded(1, 1, prefill_job, advance)
            progress.update(task, description=f"unloaded TTFT at {config.isl} tokens")
            unloaded = await _bounded(config.ttft_samples, 1, prefill_job, advance)
            progress.update(task, description=f"saturated prefill x{config.prefill_concurrency}")
            started = time.perf_counter()
            saturated = await _bounded(
                config.prefill_requests, config.prefill_concurrency, prefill_job, advance
            )
            elapsed = time.perf_counter() - started
            tp_max = sum(t.prompt_tokens for t in saturated) / elapsed
            overhead = max(0.0, statistics.median(t.ttft_s for t in unloaded) - config.isl / tp_max)
            tpots = []
            for batch in sorted(set(config.decode_batches)):
                progress.update(task, description=f"decode batch {batch}")

                def decode_job() -> Awaitable[RequestTiming]:
                    prompt = prompts(config.decode_prompt_tokens)
                    return stream_completion(session, decode_endpoint, model, prompt, config.decode_tokens)

                timings = await _bounded(batch, batch, decode_job, advance)
                tpots.append(statistics.median(t.tpot_s for t in timings))
    batches = sorted(set(config.decode_batches))
    points = [DecodePoint(batch=b, tpot_s=t) for b, t in zip(batches, _monotone(tpots), strict=True)]
    return check(
        Profile(
            prefill_max_tokens_per_s=tp_max,
            ttft_overhead_s=overhead,
            decode=points,
            isl=config.isl,
            source=f"{endpoint} (decode {decode_endpoint}) model={model}",
        )
    )
