"""``make demo``: a disaggregated cluster on a real model (SmolLM2-135M-Instruct), end to end, with real servers.

Starts one prefill (P) and one decode (D) vLLM CPU server with PDConnector (P pinned to core 0, D to core 1)
and pd-router in front of them, then streams a short question (router sends it to D only, which prefills
locally) and a long document to summarise (P prefills and pushes the KV layer by layer to D, which decodes),
printing the answer, the path each took (``X-PD-Route``), TTFT and inter-token latency. The long prompt is then
sent to P alone, without a transfer: the colocated answer must be the P->D one, word for word (the servers run
float32, where both paths compute the same numbers; the exit status is 1 when they differ).

The model comes from ``make smollm2`` (``pd_disagg.smollm2``); any chat model directory works with ``--model``.

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

from pd_disagg import pd_client
from pd_disagg.engines import base_url, router_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port
from router.tokenize import PromptTokenizer

console = Console(highlight=False)
THRESHOLD_TOKENS = 128  # the router's length threshold in this demo: longer prompts go P->D
MAX_MODEL_LEN = 1024
# float32 rather than bf16: the CPUs this runs on have no bf16 matrix units (no slower), and in float32 the
# P->D answer equals the colocated one exactly, which the demo shows.
DTYPE = "float32"
SHORT_PROMPT = "What is the capital of France?"
# Written for this project: ~300 tokens, well above THRESHOLD_TOKENS, so the router sends it P->D.
LONG_PROMPT = """Summarise the following text in two sentences.

When a large language model answers a request, it works in two phases. In the first phase, called prefill, the \
model reads the whole prompt at once and computes a key and a value for every token in every layer; this work \
is heavy and takes longer the longer the prompt is. In the second phase, called decode, the model writes the \
answer one token at a time, and each step reads the keys and values of all the tokens before it. Decode steps \
are light but there are many of them, and users notice every pause between two words.

When both phases share one server, a long prompt that arrives in the middle of an answer stops that answer \
until the prompt has been read. Disaggregated serving puts the two phases on different servers: prefill \
servers read prompts, decode servers write answers. The keys and values computed by a prefill server are sent \
over the network to a decode server, layer by layer, while the prefill is still running, so the decode server \
can start writing as soon as the last layer arrives. A router in front of the servers decides, for each \
request, whether the prompt is long enough to be worth sending to a prefill server, or short enough for the \
decode server to read it itself."""


@dataclass
class StreamResult:
    """What one streamed request produced and when."""

    text: str = ""
    route: str = ""  # pd-router's X-PD-Route header: local (D only) or disagg (P->D)
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0


def chat_body(model: str, content: str, max_tokens: int, stream: bool) -> dict[str, object]:
    """A greedy chat completion request for one user message."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def stream_chat(url: str, model: str, content: str, max_tokens: int) -> StreamResult:
    """Send one streamed chat completion and time each SSE chunk as it arrives."""
    body = chat_body(model, content, max_tokens, stream=True)
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
        dtype=DTYPE,
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
        dtype=DTYPE,
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


def show_colocated(prefill_url: str, model: str, prompt: str, max_tokens: int, p_to_d: str) -> bool:
    """Ask P alone for ``prompt`` (no transfer: P prefills and decodes it, like a colocated server) and show
    whether its answer is the P->D one; P's prefix cache holds only KV that P computed itself."""
    answer = pd_client.post_json(
        f"{prefill_url}/v1/chat/completions", chat_body(model, prompt, max_tokens, stream=False), 300
    )
    colocated = answer["choices"][0]["message"]["content"] or ""
    if colocated == p_to_d:
        console.print("[bold]colocated[/] (P alone, no transfer): [green]the same answer, word for word[/]")
        return True
    console.print(f"[bold]colocated[/] (P alone, no transfer): [red]a different answer[/]:\n{colocated}")
    return False


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
        tokenizer = PromptTokenizer(model)
        results = {}
        for label, prompt in (("short prompt", SHORT_PROMPT), ("long prompt", LONG_PROMPT)):
            tokens = tokenizer.count(tokenizer.render_chat([{"role": "user", "content": prompt}]), False)
            first, *rest = prompt.splitlines()
            more = f" [dim]+ {len(' '.join(rest).split())} more words[/]" if rest else ""
            console.print(
                f"[bold]user[/] ({label}, {tokens} tokens): {first}{more}\n[bold]assistant[/]: ", end=""
            )
            results[label] = asyncio.run(stream_chat(url, str(model), prompt, max_tokens))
            report(label, results[label])
        long = results["long prompt"]
        if long.route != "disagg":
            console.print(f"[red]the long prompt took path {long.route!r}, not disagg[/]")
            return 1
        same = show_colocated(base_url(engines[0]), str(model), LONG_PROMPT, max_tokens, long.text)
        return 0 if same else 1
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
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    return run(args.model.resolve(), args.log_dir, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
