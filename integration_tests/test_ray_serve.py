"""examples/ray_serve.yaml, run exactly as shipped with ``serve run`` on a real local Ray cluster.

A Ray head is started here (``ray start --head --block``, two CPUs: one per engine replica) and the shipped
config deployed onto it: one prefill and one decode vLLM replica with PDConnector and pd-router in front. Proven:
both replicas registered with the router; a long prompt goes P->D with its KV transferred (exact bytes on both
sides, no failure, no recompute) and answers the tokens P answers alone; a short prompt goes straight to D and
moves no byte. Then the cluster is killed with SIGKILL and every process it ran, the engines (which Ray never
saw: they are the replicas' children, in their own process groups) included, must be gone: the engines die
with their replicas.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from integration_tests.conftest import ROOT
from integration_tests.pd_checks import Transfers, blocks_to_load, metric
from pd_disagg.servers import ManagedServer, descendants, free_port, process_group_members
from tests.polling import wait_until

CONFIG = ROOT / "examples" / "ray_serve.yaml"
# Ray's token authentication off for the head and `serve run` alike: with a ~/.ray/auth_token on the host (any
# local ray.init() writes one), Ray 2.60's `ray start --head` turns it on while `serve run` does not send it,
# and cannot connect (InvalidAuthToken). This test is about the application, on loopback.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 300.0


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
    return alive


def _engine_group(url: str) -> set[int]:
    """The process group of the vLLM server serving ``url`` (its API server leads it)."""
    port = url.rsplit(":", 1)[1]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if b"pd_disagg.vllm_launcher" in argv and port.encode() in argv:
                    return set(process_group_members(int(entry)))
    raise AssertionError(f"no engine process serves {url}")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.load(resp)


def _complete(url: str, model: str, prompt: str) -> tuple[str, dict[str, Any]]:
    """A greedy completion; returns (X-PD-Route, answer)."""
    payload = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(payload).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return resp.headers.get("X-PD-Route", ""), json.load(resp)


def test_shipped_ray_serve_app_disaggregates_and_dies_with_its_cluster(
    tiny_model: Path, log_dir: Path
) -> None:
    started = time.monotonic()
    app = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    assert (ROOT / app["model"]).resolve() == tiny_model.resolve(), "the example's model is the test model"
    model, router_server = app["served_model_name"] or app["model"], app["router"]["server"]
    router = f"http://{router_server['host']}:{router_server['port']}"
    gcs_port = free_port()
    head = ManagedServer(
        name="ray-head",
        argv=[
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={gcs_port}",
            "--num-cpus=2",
            "--object-store-memory=100000000",
            "--include-dashboard=false",  # ~0.7 GiB in ten processes, and nothing here uses it
            "--disable-usage-stats",
        ],
        log_path=log_dir / f"ray-head-{gcs_port}.log",
        health_url="",  # no HTTP endpoint without the dashboard: ready when the GCS port accepts (_listening)
        # The example's connector names the variable holding the key (secret_env); as docs/multi-host.md says,
        # it is exported where Ray starts, and Ray's workers and so the engines inherit it.
        env={**RAY_ENV, app["connector"]["secret_env"]: secrets.token_hex(32)},
    )
    serve_run = ManagedServer(
        name="serve-run",
        argv=[str(BIN / "serve"), "run", "--address", f"127.0.0.1:{gcs_port}", str(CONFIG.relative_to(ROOT))],
        log_path=log_dir / f"serve-run-{gcs_port}.log",
        health_url=f"{router}/ready",
        cwd=ROOT,
        env=RAY_ENV,
    )
    engines: set[int] = set()
    ray_processes: set[int] = set()
    try:
        try:
            head.start()
            wait_until(lambda: head.alive() and _listening(gcs_port), 60, "the Ray head's GCS listening")
            serve_run.start().wait_healthy(START_TIMEOUT_S)
            deployed = time.monotonic()
            wait_until(lambda: len(_get(f"{router}/admin/workers")["workers"]) == 2, 60, "P and D registered")
            workers = {w["role"]: w for w in _get(f"{router}/admin/workers")["workers"]}
            p_url, d_url = workers["prefill"]["url"], workers["decode"]["url"]
            engines = _engine_group(p_url) | _engine_group(d_url)

            long_prompt = " ".join(f"line {i}: value = compute({i})" for i in range(60))
            _, colocated = _complete(p_url, model, long_prompt)
            prompt_tokens = colocated["usage"]["prompt_tokens"]
            assert prompt_tokens > app["router"]["policy"]["threshold_tokens"]
            transfers = Transfers(p_url, d_url)
            route, answer = _complete(router, model, long_prompt)
            assert route == "disagg"
            assert answer["choices"][0]["text"] == colocated["choices"][0]["text"]
            transfers.check(1, blocks=blocks_to_load(prompt_tokens))
            sent = metric(p_url, "vllm:pd_connector_bytes_sent_total")
            route, answer = _complete(router, model, "def add(a, b):")
            assert route == "local" and answer["choices"][0]["text"]
            assert metric(p_url, "vllm:pd_connector_bytes_sent_total") == sent
            print(
                f"ray serve: up in {deployed - started:.1f}s, checked in {time.monotonic() - deployed:.1f}s"
            )
        finally:
            # No graceful shutdown anywhere: SIGKILL the driver and every Ray process (raylet's workers, the
            # replicas among them, may leave the head's process group), never the engines themselves.
            serve_run.kill(signal.SIGKILL)
            serve_run.stop()
            if head.proc is not None:
                ray_processes = (descendants(head.pid) | {head.pid}) - engines
            head.kill(signal.SIGKILL)
            for pid in _alive(ray_processes):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            head.stop()
        wait_until(lambda: not _alive(ray_processes | engines), 60, "the cluster and its engines gone")
    finally:
        for pid in _alive(ray_processes | engines):  # never leak, also when a check above failed
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
