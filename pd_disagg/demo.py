"""``make demo``: a disaggregated cluster on the tiny model, end to end, with real servers.

Starts one prefill (P) and one decode (D) vLLM CPU server with PDConnector (P pinned to core 0, D to core 1)
and pd-router in front of them, then streams a short prompt (router sends it to D only, which prefills
locally) and a long one (P prefills and pushes the KV layer by layer to D, which decodes), printing the answer,
the path each took (``X-PD-Route``), TTFT and inter-token latency.

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

from pd_disagg.engines import base_url, router_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port
from router.tokenize import PromptTokenizer

console = Console(highlight=False)
THRESHOLD_TOKENS = 128  # the router's length threshold in this demo: longer prompts go P->D
MAX_MODEL_LEN = 1024


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


def _cluster(model: Path, log_dir: Path) -> tuple[list[ManagedServer], ManagedServer]:
    """P and D engine servers with PDConnector, and pd-router configured for them (none started yet)."""
    side_channel_port = free_port()
    prefill = vllm_server(
        model,
        name="demo-prefill",
        cpu_core=0,
        kv_transfer_config={
            "kv_connector": "PDConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "side_channel_host": "127.0.0.1",
                "side_channel_port": side_channel_port,
            },
        },
        log_dir=log_dir,
        max_model_len=MAX_MODEL_LEN,
    )
    decode = vllm_server(
        model,
        name="demo-decode",
        cpu_core=1,
        kv_transfer_config={
            "kv_connector": "PDConnector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
        },
        log_dir=log_dir,
        max_model_len=MAX_MODEL_LEN,
    )
    config = write_router_config(
        log_dir / "router.toml",
        flow="pd-push",
        sections={
            "model": {"path": str(model), "max_model_len": MAX_MODEL_LEN},
            "policy": {"threshold_tokens": THRESHOLD_TOKENS},
        },
        prefill=[{"url": base_url(prefill), "bootstrap": f"127.0.0.1:{side_channel_port}"}],
        decode=[{"url": base_url(decode)}],
    )
    return [prefill, decode], router_server(config, log_dir=log_dir, port=free_port())


def _long_prompt(model: Path, min_tokens: int) -> str:
    """A chat prompt of at least ``min_tokens`` tokens (so the router's threshold sends it P->D)."""
    tokenizer = PromptTokenizer(model)
    lines = ["Summarise what this code does:"]
    line = "    total = total + values[index] * weights[index]"
    while (
        tokenizer.count(tokenizer.render_chat([{"role": "user", "content": "\n".join(lines)}]), False)
        < min_tokens
    ):
        lines.append(line)
    return "\n".join(lines)


def run(model: Path, log_dir: Path, max_tokens: int) -> int:
    engines, router = _cluster(model, log_dir)
    servers = [*engines, router]
    try:
        with console.status(
            "starting prefill and decode vLLM (CPU) servers with PDConnector, then pd-router ..."
        ):
            for server in engines:
                server.start()
            for server in engines:
                server.wait_healthy(timeout_s=420)
            router.start()
            router.wait_healthy(timeout_s=60)
        url = base_url(router)
        console.print(
            f"pd-router ready at {url} (P {base_url(engines[0])}, D {base_url(engines[1])}); logs in {log_dir}/"
        )
        for label, prompt in (
            ("short prompt", "Write a Python function that adds two numbers."),
            ("long prompt", _long_prompt(model, THRESHOLD_TOKENS + 64)),
        ):
            console.print(f"[bold]user[/] ({label}, {len(prompt)} chars)\n[bold]assistant[/]: ", end="")
            report(label, asyncio.run(stream_chat(url, str(model), prompt, max_tokens)))
        return 0
    except KeyboardInterrupt:
        console.print("\ninterrupted: stopping servers")
        return 130
    finally:
        for server in reversed(servers):
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="pd-disagg demo: 1 prefill + 1 decode vLLM server behind pd-router"
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, default=Path("logs/demo"))
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    return run(args.model.resolve(), args.log_dir, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
