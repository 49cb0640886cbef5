"""Command lines and environments for real engine servers on this project's CPU machines.

Knows the flags a vLLM CPU server needs (see docs/development.md) so tests, benchmarks and the demo build
servers the same way. Returns ``ManagedServer`` objects; starting and stopping is ``servers.py``'s job.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pd_disagg.servers import ManagedServer, free_port
from pd_disagg.sglang_cpu import STAND_INS_DIR

# Settings every vLLM CPU server in this project uses: eager mode and a block size that CPU attention accepts
# (multiple of 32). Tests use float32, which makes vLLM's greedy tokens equal to transformers' exactly.
VLLM_CPU_ARGS = ("--enforce-eager", "--block-size", "32", "--seed", "0")
UCX_TEST_ENV = {
    "UCX_NET_DEVICES": "lo",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCXPY_PROGRESS_MODE": "blocking",
}
# Every engine server: no hub access, no tokenizer thread pools fighting the engine for two cores, UCX on lo.
ENGINE_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **UCX_TEST_ENV}


def _local_server(
    name: str,
    argv: Sequence[str],
    port: int,
    log_dir: Path,
    env: Mapping[str, str],
    health_path: str = "/health",
    cwd: Path | None = None,
) -> ManagedServer:
    """A server on ``127.0.0.1:port`` logging to ``log_dir/NAME-PORT.log``, healthy when ``health_path`` is 200."""
    return ManagedServer(
        name=name,
        argv=argv,
        log_path=log_dir / f"{name}-{port}.log",
        health_url=f"http://127.0.0.1:{port}{health_path}",
        env=env,
        cwd=cwd,
    )


def vllm_server(
    model: str | Path,
    *,
    log_dir: Path,
    name: str = "vllm",
    port: int | None = None,
    cpu_core: int | str | None = None,
    confine: bool = False,
    kv_cache_gib: int = 1,
    max_model_len: int = 1024,
    dtype: str = "bfloat16",
    kv_transfer_config: Mapping[str, Any] | Path | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> ManagedServer:
    """A vLLM OpenAI server on ``127.0.0.1:port`` (not yet started).

    ``cpu_core`` pins vLLM's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``), so two servers on a two-core
    machine do not fight over the same core. ``confine`` also keeps every other process of the server (API
    server, EngineCore) on those cores (``taskset``): a benchmark standing in for servers on separate hosts
    uses it, so one server's front end and idle loops do not run on the other's core. ``kv_transfer_config``
    is a dict (passed as JSON text) or the path of a JSON file (passed as the path: ``pd-vllm`` reads it).
    ``cwd``: the server's working directory (relative model and config paths resolve there).
    """
    port = port or free_port()
    cores = str(cpu_core).replace("|", ",")
    argv = [
        *(["taskset", "-c", cores] if confine and cpu_core is not None else []),
        sys.executable,
        "-m",
        "pd_disagg.vllm_launcher",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        *VLLM_CPU_ARGS,
        *extra_args,
    ]
    if isinstance(kv_transfer_config, Path):
        argv += ["--kv-transfer-config", str(kv_transfer_config)]
    elif kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    server_env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),  # whole GiB: vLLM parses an int
        "VLLM_LOGGING_LEVEL": "INFO",
        "VLLM_NO_USAGE_STATS": "1",
        **ENGINE_ENV,
    }
    if cpu_core is not None:
        server_env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core)
    server_env.update(env or {})
    return _local_server(name, argv, port, log_dir, server_env, cwd=cwd)


# SGLang runs from its own virtualenv (`make sglang-env`): it pins torch and transformers versions that differ
# from vLLM's. ``PD_SGLANG_PYTHON`` overrides the interpreter (e.g. a worktree using another checkout's venv).
SGLANG_VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv-sglang" / "bin" / "python"
# Settings every SGLang CPU server in this project uses (docs/sglang.md explains each).
SGLANG_CPU_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-overlap-schedule",
    "--random-seed",
    "0",
)


def sglang_python() -> str:
    """The interpreter of the SGLang virtualenv (``PD_SGLANG_PYTHON`` or the repo's ``.venv-sglang``)."""
    return os.environ.get("PD_SGLANG_PYTHON") or str(SGLANG_VENV_PYTHON)


def sglang_server(
    model: str | Path,
    *,
    log_dir: Path,
    name: str = "sglang",
    port: int | None = None,
    cpu_core: int | str | None = None,
    max_total_tokens: int = 4096,
    context_length: int = 1024,
    dtype: str = "bfloat16",
    disaggregation_mode: str | None = None,
    transfer_backend: str = "pd",
    bootstrap_port: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> ManagedServer:
    """An SGLang server on ``127.0.0.1:port`` (not yet started), run on CPU as docs/sglang.md describes.

    ``disaggregation_mode`` is ``None`` (aggregated), ``"prefill"`` or ``"decode"``; P/D servers use
    ``transfer_backend`` and a prefill server's bootstrap server listens on ``bootstrap_port``. Decode servers
    back retracted requests up in CPU tensors (the default pins host memory through CUDA). ``cpu_core``
    pins SGLang's OpenMP threads (``SGLANG_CPU_OMP_THREADS_BIND``).
    """
    port = port or free_port()
    argv = [
        sglang_python(),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--context-length",
        str(context_length),
        "--max-total-tokens",
        str(max_total_tokens),
        *SGLANG_CPU_ARGS,
    ]
    if disaggregation_mode is not None:
        argv += [
            "--disaggregation-mode",
            disaggregation_mode,
            "--disaggregation-transfer-backend",
            transfer_backend,
        ]
        if bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        if disaggregation_mode == "decode":
            argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    argv += list(extra_args)
    server_env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(STAND_INS_DIR), os.environ.get("PYTHONPATH")])),
        # SGLang advertises (and our backend binds) the address get_local_ip_auto() finds, which is the NIC's
        # by default; keep every bootstrap and transfer listener on loopback.
        "SGLANG_HOST_IP": "127.0.0.1",
        **ENGINE_ENV,
    }
    if cpu_core is not None:
        server_env["SGLANG_CPU_OMP_THREADS_BIND"] = str(cpu_core)
    server_env.update(env or {})
    return _local_server(name, argv, port, log_dir, server_env)


def sglang_router(
    prefill: Sequence[tuple[str, int]],
    decode: Sequence[str],
    *,
    log_dir: Path,
    name: str = "sglang-router",
    port: int | None = None,
    extra_args: Sequence[str] = (),
) -> ManagedServer:
    """SGLang's own PD router (``sglang-router``, from the SGLang venv) on ``127.0.0.1:port`` (not started).

    ``prefill``: ``(base_url, bootstrap_port)`` per prefill server; ``decode``: base URLs of decode servers.
    """
    port = port or free_port()
    argv = [
        sglang_python(),
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # Its metrics listener defaults to a fixed port: pick a free one so routers can run side by side.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    for url, bootstrap_port in prefill:
        argv += ["--prefill", url, str(bootstrap_port)]
    for url in decode:
        argv += ["--decode", url]
    argv += list(extra_args)
    return _local_server(name, argv, port, log_dir, {})


def base_url(server: ManagedServer) -> str:
    """``http://host:port`` of a server built by this module (derived from its health URL)."""
    return server.health_url.rsplit("/", 1)[0]


def write_router_config(
    path: Path,
    *,
    flow: str,
    sections: Mapping[str, Mapping[str, Any]],
    prefill: Sequence[Mapping[str, Any]] = (),
    decode: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """Write a pd-router TOML config (``flow``, ``[section]`` tables, ``[[prefill]]``/``[[decode]]`` workers).

    Values are written as JSON literals, which TOML reads the same for strings, numbers, booleans and lists.
    """
    lines = [f"flow = {json.dumps(flow)}"]
    for name, table in sections.items():
        lines += [f"[{name}]", *(f"{key} = {json.dumps(value)}" for key, value in table.items())]
    for role, workers in (("prefill", prefill), ("decode", decode)):
        for worker in workers:
            lines += [f"[[{role}]]", *(f"{key} = {json.dumps(value)}" for key, value in worker.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def router_server(
    config: Path, *, log_dir: Path, port: int, name: str = "router", cwd: Path | None = None
) -> ManagedServer:
    """``pd-router --config CONFIG --port PORT`` (not yet started); healthy once it answers ``/ready``."""
    argv = [sys.executable, "-m", "router.cli", "--config", str(config), "--port", str(port)]
    env = {"TOKENIZERS_PARALLELISM": "false"}
    return _local_server(name, argv, port, log_dir, env, health_path="/ready", cwd=cwd)
