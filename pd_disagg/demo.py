"""``make demo``: bring up real engine servers on the tiny model, stream a chat completion, print TTFT/ITL.

Runs in one foreground process that owns every server it starts: on normal exit, on an error, on Ctrl-C
(SIGINT) or SIGTERM, all server process groups are stopped before it returns, so nothing is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import aiohttp
from rich.console import Console

from pd_disagg.engines import base_url, vllm_server
from pd_disagg.servers import ManagedServer

console = Console(highlight=False)


@dataclass
class StreamResult:
    """What one streamed request produced and when."""

    text: str = ""
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0


async def stream_chat(url: str, model: str, content: str, max_tokens: int) -> StreamResult:
    """Send one streamed chat completion and time each SSE chunk as it arrives."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    result = StreamResult()
    start = last = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=300)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{url}/v1/chat/completions", json=body) as resp,
    ):
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if not delta:
                continue
            now = time.perf_counter()
            if result.tokens == 0:
                result.ttft_s = now - start
            else:
                result.gaps_s.append(now - last)
            last = now
            result.tokens += 1
            result.text += delta
            console.print(delta, end="", markup=False)
    console.print()
    return result


def report(label: str, result: StreamResult) -> None:
    itl = statistics.median(result.gaps_s) * 1e3 if result.gaps_s else float("nan")
    worst = max(result.gaps_s) * 1e3 if result.gaps_s else float("nan")
    console.print(
        f"[bold]{label}[/]: {result.tokens} chunks, TTFT {result.ttft_s * 1e3:.0f} ms, "
        f"ITL median {itl:.1f} ms, worst gap {worst:.1f} ms"
    )


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pd-disagg demo on the tiny local model")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, default=Path("logs/demo"))
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)

    servers: list[ManagedServer] = [vllm_server(args.model, log_dir=args.log_dir, name="vllm", cpu_core=0)]
    try:
        with console.status("starting vLLM (CPU) server ..."):
            for server in servers:
                server.start()
            for server in servers:
                server.wait_healthy(timeout_s=420)
        url = base_url(servers[0])
        console.print(f"server ready at {url}; logs in {args.log_dir}/")
        prompt = "Write a Python function that adds two numbers."
        console.print(f"[bold]user[/]: {prompt}\n[bold]assistant[/]: ", end="")
        result = asyncio.run(stream_chat(url, str(args.model), prompt, args.max_tokens))
        report("colocated vLLM", result)
        return 0
    except KeyboardInterrupt:
        console.print("\ninterrupted: stopping servers")
        return 130
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
