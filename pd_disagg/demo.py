"""``make demo``: bring up real engine servers on the tiny model, stream a chat completion, print TTFT/ITL.

With ``--router-config cluster.toml`` the demo starts the config's decode workers and pd-router, then streams a
short and a long prompt through the router and prints which path each took (``X-PD-Route``).

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
from urllib.parse import urlsplit

import aiohttp
from rich.console import Console

from pd_disagg.engines import base_url, router_server, vllm_server
from pd_disagg.servers import ManagedServer
from router.config import load_config
from router.tokenize import PromptTokenizer

console = Console(highlight=False)


@dataclass
class StreamResult:
    """What one streamed request produced and when."""

    text: str = ""
    route: str = ""  # pd-router's X-PD-Route header: local (D only) or disagg (P->D)
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
        result.route = resp.headers.get("X-PD-Route", "")
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
    path = f" via path [bold]{result.route}[/]" if result.route else ""
    console.print(
        f"[bold]{label}[/]{path}: {result.tokens} chunks, TTFT {result.ttft_s * 1e3:.0f} ms, "
        f"ITL median {itl:.1f} ms, worst gap {worst:.1f} ms"
    )


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _router_servers(config: Path, model: Path, log_dir: Path) -> tuple[list[ManagedServer], str]:
    """A vLLM server at each decode worker's port of ``config``, then pd-router itself.

    Prefill workers are not started here: they need the PDConnector (wired by the lead when it lands); until
    then the router sees no healthy P and long prompts take the local path with reason ``no_prefill``.
    """
    cfg = load_config(config)
    servers = [
        vllm_server(model, log_dir=log_dir, name=f"vllm-decode{i}", port=urlsplit(w.url).port, cpu_core=i % 2)
        for i, w in enumerate(cfg.decode)
    ]
    servers.append(router_server(config, log_dir=log_dir, port=cfg.server.port))
    return servers, f"http://127.0.0.1:{cfg.server.port}"


def _long_prompt(model: Path, min_tokens: int) -> str:
    """A prompt of at least ``min_tokens`` tokens (so the router's threshold sends it P->D)."""
    tokenizer = PromptTokenizer(model)
    lines = ["Summarise what this code does:"]
    line = "    total = total + values[index] * weights[index]"
    while (
        tokenizer.count(tokenizer.render_chat([{"role": "user", "content": "\n".join(lines)}]), False)
        < min_tokens
    ):
        lines.append(line)
    return "\n".join(lines)


def run_router_demo(config: Path, model: Path, log_dir: Path, max_tokens: int) -> int:
    """Start the workers and pd-router from ``config``; stream a short and a long prompt through it."""
    servers, url = _router_servers(config, model, log_dir)
    try:
        with console.status("starting vLLM (CPU) decode server(s) and pd-router ..."):
            for server in servers[:-1]:
                server.start()
            for server in servers[:-1]:
                server.wait_healthy(timeout_s=420)
            servers[-1].start()
            servers[-1].wait_healthy(timeout_s=60)
        console.print(f"pd-router ready at {url}; logs in {log_dir}/")
        threshold = load_config(config).policy.threshold_tokens
        for label, prompt in (
            ("short prompt", "Write a Python function that adds two numbers."),
            ("long prompt", _long_prompt(model, threshold + 16)),
        ):
            console.print(f"[bold]user[/] ({label}, {len(prompt)} chars) ...\n[bold]assistant[/]: ", end="")
            result = asyncio.run(stream_chat(url, str(model), prompt, max_tokens))
            report(label, result)
        return 0
    finally:
        for server in reversed(servers):
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pd-disagg demo on the tiny local model")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, default=Path("logs/demo"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--router-config", type=Path, help="run pd-router with this config (see examples/)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    if args.router_config is not None:
        try:
            return run_router_demo(args.router_config, args.model, args.log_dir, args.max_tokens)
        except KeyboardInterrupt:
            console.print("\ninterrupted: stopping servers")
            return 130

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
