"""The serving systems ``benchmarks.goodput`` compares, each on the same two cores behind pd-router.

Called by the benchmark process, one system at a time: ``build`` makes the servers (not started),
``System.start`` starts the engines and the router and waits for their health, ``System.close`` stops every
server by its process group (also on failure), and ``System.kv_counters`` reads what proves that KV moved
(or did not) between two points of a run. Every engine runs ``--model`` with vLLM's defaults apart from
what the system is about (same model and dtype); one engine is pinned to core 0, the other to core 1.

- ``aggregated``: two vLLM servers, vLLM's default scheduler; pd-router with no prefill worker, so every
  request goes to one of them (policy reason ``no_prefill``) and is prefilled and decoded there;
- ``aggregated_slo``: the same with ``scheduler_plugins.vllm.SLOScheduler`` (``--scheduler-cls``), whose
  TPOT and TTFT targets are the SLOs the benchmark measures against (the server's TTFT target the longest
  class's; each request carries its own class's in ``vllm_xargs``, ``System.slo_scheduler``) and whose ITL
  target is the longest class's TTFT SLO (no SLO limits a single gap);
- ``pd``: P (PDConnector producer, core 0) and D (consumer, core 1), pd-router's ``pd-push`` flow with the
  threshold policy (prompts shorter than its ``threshold_tokens`` are served by D alone);
- ``pd_lend``: ``pd`` with pd-router's ``policy.lend_max_active`` (``LEND_MAX_ACTIVE``): a short request
  runs on P alone while P has no prefill in flight and fewer requests than D (docs/router.md ``## Routing``);
- ``pd_lend_slo``: ``pd_lend`` with P under ``SLOScheduler`` (colocated mode, the same targets as
  ``aggregated_slo``'s), whose chunked prefill bounds the steps of the chats lent to P;
- ``nixl``: P and D with vLLM's NixlConnector (``kv_buffer_device: cpu``), pd-router's ``vllm-standard``
  flow (P with ``max_tokens`` 1, then D pulls the prompt's KV from the blocks P's answer names), the same
  threshold policy and D's ``kv_load_failure_policy`` as ``pd``. P advertises its side channel on the host
  pd-router knows it by (``VLLM_NIXL_SIDE_CHANNEL_HOST``): pd-router refuses a NIXL answer naming any other
  host (docs/router.md ``## P/D legs``), and vLLM's default, ``localhost``, is not ``127.0.0.1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.first_token import SERVED
from integration_tests.pd_checks import metric
from pd_disagg.engines import base_url, router_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port

PD_SYSTEMS = ("pd", "pd_lend", "pd_lend_slo")  # P with PDConnector on core 0, D on core 1
SYSTEMS = ("aggregated", "aggregated_slo", *PD_SYSTEMS, "nixl")
#: ``pd_lend``'s ``policy.lend_max_active``: above the requests one engine of these runs holds at once, so the
#: balance against D's load, not this cap, decides how many short requests P takes.
LEND_MAX_ACTIVE = 64
BLOCK_TOKENS = 32  # pd_disagg.engines.VLLM_CPU_ARGS' --block-size: the router's KV index names blocks alike
SLO_SCHEDULER = "scheduler_plugins.vllm.SLOScheduler"
STAGES = ("queue", "prefill", "decode")  # vLLM's per-request stage histograms


@dataclass
class System:
    """One system's engines (P first where there is one) and its pd-router, once ``start`` ran."""

    name: str
    engines: list[ManagedServer]
    router_config: dict[str, Any]
    log_dir: Path
    slo_scheduler: bool = False  # an engine runs SLOScheduler: requests may carry their class's TTFT target
    url: str = ""
    started: list[ManagedServer] = field(default_factory=list)

    def start(self, timeout_s: float = 900.0) -> None:
        for server in self.engines:
            self.started.append(server.start())
        for server in self.engines:
            server.wait_healthy(timeout_s)
        config = write_router_config(self.log_dir / f"{self.name}-router.toml", **self.router_config)
        router = router_server(config, log_dir=self.log_dir, port=free_port(), name=f"{self.name}-router")
        self.started.append(router.start())
        router.wait_healthy(120)
        self.url = base_url(router)

    def close(self) -> None:
        """Stop every started server (router first), each by its process group; safe after a failed start."""
        for server in reversed(self.started):
            server.stop()
        self.started.clear()

    def stage_seconds(self) -> dict[str, dict[str, float]]:
        """Per engine (by role: e0/e1, prefill/decode): requests finished and the summed seconds of vLLM's
        per-request stage histograms (``vllm:request_{queue,prefill,decode}_time_seconds``): where the time
        of a run's requests went on each engine, as deltas between two reads."""
        out = {}
        for server in self.engines:
            url = base_url(server)
            out[server.name.split("-", 1)[1]] = {
                "requests": metric(url, "vllm:request_queue_time_seconds_count"),
                **{f"{s}_s": metric(url, f"vllm:request_{s}_time_seconds_sum") for s in STAGES},
            }
        return out

    def kv_counters(self) -> dict[str, float]:
        """Counters that show KV movement: bytes P sent and loads that failed (``pd`` and its lending kin),
        bytes D pulled and failed transfers (``nixl``); nothing for the aggregated systems (no connector)."""
        if self.name in PD_SYSTEMS:
            p, d = (base_url(s) for s in self.engines)
            return {
                "kv_bytes": metric(p, "vllm:pd_connector_bytes_sent_total"),
                "kv_failures": metric(d, "vllm:pd_connector_failures_total"),
            }
        if self.name == "nixl":
            d = base_url(self.engines[1])
            return {
                "kv_bytes": metric(d, "vllm:nixl_bytes_transferred_sum"),
                "kv_failures": metric(d, "vllm:nixl_num_failed_transfers_total"),
            }
        return {}


def build(
    name: str,
    model: Path,
    dtype: str,
    max_len: int,
    log_dir: Path,
    slo_ms: tuple[float, float] | None = None,
    confine: bool = False,
) -> System:
    """The servers of system ``name`` (not started). ``slo_ms``: (TTFT, TPOT) targets of the SLO scheduler of
    ``aggregated_slo`` and ``pd_lend_slo``, required for them and ignored otherwise. ``confine``: every
    process of an engine on its core (``vllm_server(confine=True)``), not only its OpenMP threads."""
    sections: dict[str, dict[str, Any]] = {
        "model": {"path": str(model), "served_names": [SERVED], "max_model_len": max_len},
        "kv_routing": {"block_size": BLOCK_TOKENS},
        # Overload must show as latency (missed SLOs), not as requests the router gave up on.
        "timeouts": {"first_byte_s": 900.0, "idle_s": 300.0, "request_s": 1800.0},
    }

    def engine(role: str, core: int, kv: dict[str, Any] | None = None, **kwargs: Any) -> ManagedServer:
        return vllm_server(
            model,
            log_dir=log_dir,
            name=f"{name}-{role}",
            cpu_core=core,
            confine=confine,
            dtype=dtype,
            max_model_len=max_len,
            kv_transfer_config=kv,
            extra_args=["--served-model-name", SERVED, *kwargs.pop("extra_args", [])],
            **kwargs,
        )

    extra: list[str] = []
    env: dict[str, str] = {}
    if name.endswith("_slo"):
        if slo_ms is None:
            raise ValueError(f"{name} needs the SLOs for its scheduler's targets")
        extra = ["--scheduler-cls", SLO_SCHEDULER]
        # The TPOT SLO is a mean over the answer: a TPOT target, not an ITL target (docs/scheduler.md). No
        # SLO limits a single gap, so the ITL target only keeps a step within the longest TTFT SLO: chunking
        # a prompt costs the decodes more time in all than one step does.
        env = {
            "PD_SCHED_TTFT_TARGET_MS": f"{slo_ms[0]:.0f}",
            "PD_SCHED_TPOT_TARGET_MS": f"{slo_ms[1]:.1f}",
            "PD_SCHED_ITL_TARGET_MS": f"{slo_ms[0]:.0f}",
        }
    if name in ("aggregated", "aggregated_slo"):
        engines = [engine(f"e{core}", core, extra_args=extra, env=env) for core in (0, 1)]
        config = {"flow": "pd-push", "sections": sections, "decode": [{"url": base_url(e)} for e in engines]}
        return System(name, engines, config, log_dir, slo_scheduler=bool(extra))
    if name in PD_SYSTEMS:
        side = free_port()
        p = engine(
            "prefill",
            0,
            {
                "kv_connector": "PDConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"side_channel_port": side},
            },
            extra_args=extra,
            env=env,
        )
        d = engine(
            "decode",
            1,
            {"kv_connector": "PDConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"},
        )
        if name != "pd":
            sections["policy"] = {"lend_max_active": LEND_MAX_ACTIVE}
        config = {
            "flow": "pd-push",
            "sections": sections,
            "prefill": [{"url": base_url(p), "bootstrap": f"127.0.0.1:{side}"}],
            "decode": [{"url": base_url(d)}],
        }
        return System(name, [p, d], config, log_dir, slo_scheduler=bool(extra))
    if name == "nixl":
        nixl = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
        p, d = (
            engine(
                role,
                core,
                {**nixl, **kv},
                env={
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                },
            )
            for role, core, kv in (
                ("prefill", 0, {"kv_role": "kv_producer"}),
                ("decode", 1, {"kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}),
            )
        )
        config = {
            "flow": "vllm-standard",
            "sections": sections,
            "prefill": [{"url": base_url(p)}],
            "decode": [{"url": base_url(d)}],
        }
        return System(name, [p, d], config, log_dir)
    raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
