"""``pd-plan profile`` against a real vLLM CPU server on the tiny model, then plan and verify with the result.

One server for the module (30-60 s to start); small profiling settings keep the whole file well under its
3-minute budget.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from pd_disagg.engines import base_url, vllm_server
from pd_disagg.servers import ManagedServer
from planner import model
from planner.profile import load_profile
from planner.profiler import served_model, stream_completion

ROOT = Path(__file__).resolve().parent.parent
ISL = 256
BATCHES = (1, 2, 4)


@pytest.fixture(scope="module")
def endpoint(start_servers: Callable[..., list[ManagedServer]], tiny_model: Path, log_dir: Path) -> str:
    (server,) = start_servers(
        vllm_server(tiny_model, log_dir=log_dir, name="planner-vllm", max_model_len=1024)
    )
    return base_url(server)


def _pd_plan(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "planner.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_stream_completion_counts_exact_tokens(endpoint: str) -> None:
    """The profiler's assumptions about the server: token-id prompts, ignore_eos, usage in the stream."""

    async def one() -> tuple[str, float, int, int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            name = await served_model(session, endpoint)
            timing = await stream_completion(session, endpoint, name, list(range(10, 10 + 40)), 12)
            return name, timing.tpot_s, timing.prompt_tokens, timing.completion_tokens

    name, tpot, prompt_tokens, completion_tokens = asyncio.run(one())
    assert name.endswith("tiny-llama")
    assert (prompt_tokens, completion_tokens) == (40, 12)
    assert 0 < tpot < 1.0


def test_profile_then_plan_and_verify(endpoint: str, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    batches = ",".join(map(str, BATCHES))
    profiled = _pd_plan(
        "profile", "--endpoint", endpoint, "--isl", str(ISL), "--out", str(out), "--batches", batches,
        "--ttft-samples", "2", "--prefill-requests", "6", "--prefill-concurrency", "2", "--decode-tokens", "16",
    )  # fmt: skip
    assert profiled.returncode == 0, profiled.stderr[-3000:]
    assert "decode batch 4" in profiled.stderr  # the progress bar reached the last phase

    profile = load_profile(out)  # validates the schema and the curve
    assert profile.isl == ISL
    assert [p.batch for p in profile.decode] == list(BATCHES)
    assert 0 < profile.decode[0].tpot_s < 1.0
    assert profile.prefill_max_tokens_per_s > 100  # the tiny model prefills thousands of tokens/s on a CPU

    # SLOs the measured server can meet: TTFT 3x its minimum, TPOT at its largest measured batch.
    ttft = 3 * model.min_ttft_s(profile, ISL)
    tpot = profile.decode[-1].tpot_s
    throughput = 1.5 * profile.prefill_max_tokens_per_s
    planned = _pd_plan(
        "--profile", str(out), "--isl", str(ISL), "--osl", "16", "--ttft", f"{ttft}", "--tpot", f"{tpot}",
        "--throughput", f"{throughput}", "--verify", "--requests", "2000", "--json",
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-3000:]
    figures = json.loads(planned.stdout.strip().splitlines()[-1])
    assert list(figures) == list(model.PLAN_JSON_FIELDS)
    workload = model.Workload(throughput, isl=ISL, osl=16, ttft_s=ttft, tpot_s=tpot)
    expected = model.plan(profile, workload)
    assert figures == pytest.approx(expected.summary(), rel=1e-6)
    assert figures["prefill_instances"] >= 2  # 1.5x one instance's maximum needs at least two P
    assert "verdict:" in planned.stderr
