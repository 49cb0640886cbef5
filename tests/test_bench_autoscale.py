"""benchmarks.autoscale without Ray: the workload's phases and arrivals, a request's attainment at the SLO's
boundary, replica-seconds from replica samples, a phase's figures, the targets, the JSON, and the three
systems' Serve configs (Serve's own schema and the application's checks accept them; the engines are capped
by the ``engine`` resource)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray.serve.schema import ServeDeploySchema

from benchmarks.autoscale import write_profile
from benchmarks.autoscale_analysis import (
    Phase,
    Record,
    Sample,
    Slo,
    arrivals,
    holding,
    phase_figures,
    phases,
    replica_changes,
    replica_seconds,
    report,
    targets,
    totals,
)
from benchmarks.autoscale_systems import ENGINE_SLOTS, SYSTEMS, Knobs, serve_config
from pd_disagg.ray_serve.app_config import parse_args
from planner.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
SLO = Slo(ttft_s=1.0, tpot_s=0.1)
PHASE = Phase("p", duration_s=10.0, rate_rps=2.0, prompt_tokens=10, max_tokens=3)


def test_the_workload_shifts_from_prompts_to_outputs_to_short() -> None:
    long_prompts, long_outputs, short_only = phases(short=False)
    assert long_prompts.prompt_tokens > 256 > long_outputs.prompt_tokens  # P->D, then D alone (threshold)
    assert long_outputs.max_tokens > long_prompts.max_tokens
    assert short_only.prompt_tokens < 256 and short_only.max_tokens < long_outputs.max_tokens
    assert all(p.duration_s < f.duration_s for p, f in zip(phases(short=True), phases(False), strict=True))
    assert [p.rate_rps for p in phases(False, (1.0, 2.0, 3.0))] == [1.0, 2.0, 3.0]
    for bad in ((1.0, 2.0), (1.0, 0.0, 1.0)):
        with pytest.raises(ValueError, match="three positive rates"):
            phases(False, bad)


def test_arrivals_are_the_same_per_seed_and_within_the_phase() -> None:
    first, again, other = arrivals(PHASE, 1), arrivals(PHASE, 1), arrivals(PHASE, 2)
    assert first == again and first != other
    assert first == sorted(first) and first[0] > 0 and first[-1] < PHASE.duration_s
    many = arrivals(Phase("p", 1000.0, 2.0, 1, 1), 0)
    assert 1800 < len(many) < 2200  # ~ rate x length


def test_attainment_at_the_boundaries() -> None:
    assert Record("p", 0, 200, (1.0, 1.1, 1.2)).attains(SLO)  # TTFT and TPOT exactly at the SLO
    assert not Record("p", 0, 200, (1.01, 1.02)).attains(SLO)
    assert not Record("p", 0, 200, (0.5, 0.8)).attains(SLO)  # one gap of 0.3 s
    assert Record("p", 0, 200, (0.5,)).attains(SLO)  # one token: no gap
    assert Record("p", 0, 200, (0.5, 0.8), tokens=5).attains(SLO)  # 0.3 s over 4 later tokens (usage)
    assert not Record("p", 0, 200, ()).attains(SLO)  # no token
    assert not Record("p", 0, 500, (0.1, 0.2)).attains(SLO)


def test_replica_seconds_integrate_a_step_function_over_the_phase() -> None:
    samples = [Sample(0.0, 1, 1), Sample(5.0, 1, 2), Sample(12.0, 2, 2)]
    assert replica_seconds(samples, 0.0, 10.0) == {"prefill": 10.0, "decode": 15.0}
    assert replica_seconds(samples, 10.0, 20.0) == {"prefill": 18.0, "decode": 20.0}
    assert replica_seconds([Sample(3.0, 1, 1)], 0.0, 10.0) == {"prefill": 10.0, "decode": 10.0}
    with pytest.raises(ValueError):
        replica_seconds([], 0, 1)
    assert replica_changes([*samples, Sample(13.0, 2, 2)]) == [[0.0, 1, 1], [5.0, 1, 2], [12.0, 2, 2]]


def test_replicas_waiting_for_a_slot_hold_nothing() -> None:
    listed = {"prefill": ["RUNNING", "STOPPING"], "decode": ["RUNNING", "STARTING"]}
    assert holding(listed, 3) == {"prefill": 2, "decode": 1}  # D's second waits for the slot P releases
    assert holding(listed, 4) == {"prefill": 2, "decode": 2}
    assert holding({"prefill": ["STARTING"], "decode": ["RUNNING", "STOPPED"]}, 3) == {
        "prefill": 1,
        "decode": 1,
    }
    both = {"prefill": ["RUNNING", "STARTING"], "decode": ["RUNNING", "STARTING", "STARTING"]}
    assert holding(both, 3) == {"prefill": 2, "decode": 1}  # decode's first, then prefill's
    assert holding(both, 2) == {"prefill": 1, "decode": 1}


def test_a_phase_counts_sent_failed_attained_and_goodput_per_replica_second() -> None:
    records = [
        Record("p", 0.0, 200, (0.5, 0.55)),
        Record("p", 1.0, 200, (2.0, 2.05)),  # TTFT missed
        Record("p", 2.0, 0, (), "refused"),
        Record("other", 0.0, 200, (0.1,)),
    ]
    figures = phase_figures(records, [Sample(0.0, 1, 1)], PHASE, 0.0, SLO)
    assert figures["sent"] == 3 and figures["failed"] == 1 and figures["attained"] == 1
    assert figures["slo_attainment"] == pytest.approx(1 / 3)
    assert figures["goodput_rps"] == pytest.approx(0.1)
    assert figures["replica_s"] == 20.0 and figures["goodput_per_replica_s"] == pytest.approx(0.05)
    assert figures["ttft_p90_s"] == 2.0
    empty = phase_figures([], [Sample(0.0, 1, 1)], PHASE, 0.0, SLO)
    assert empty["slo_attainment"] is None and empty["ttft_p90_s"] is None


def _system(attained: float, replica_s: float, attainments: list[float]) -> dict[str, object]:
    per_phase = {
        f"p{i}": {
            "attained": attained / len(attainments),
            "replica_s": replica_s / len(attainments),
            "slo_attainment": a,
        }
        for i, a in enumerate(attainments)
    }
    return {"phases": per_phase, "total": totals(per_phase)}  # type: ignore[arg-type]


def test_the_targets_compare_goodput_per_replica_second() -> None:
    systems = {
        "static": _system(100, 1000, [0.5, 1.0]),
        "ray": _system(100, 900, [0.8, 1.0]),
        "ours": _system(130, 1000, [0.95, 0.9]),
    }
    got = targets(systems)
    assert got["ours_attainment_every_phase"] is True and got["ours_worst_phase_attainment"] == 0.9
    assert got["vs_static"] == pytest.approx(1.3) and got["vs_static_met"] is True
    assert got["vs_ray"] == pytest.approx(1.17) and got["vs_ray_met"] is False
    assert targets({"ours": _system(1, 1, [0.89])})["vs_static"] is None
    assert targets({"static": _system(1, 1, [1.0])})["ours_attainment_every_phase"] is None
    text = json.dumps(report(True, SLO, phases(True), systems))
    assert json.loads(text)["targets"]["vs_static_met"] is True


def _knobs(tmp_path: Path) -> Knobs:
    return Knobs(
        model=ROOT / ".cache" / "models" / "tiny-llama",
        profile=write_profile(tmp_path / "profile.json"),
        log_dir=tmp_path,
        router_port=8301,
        dashboard_port=8266,
        ttft_slo_s=2.0,
        tpot_slo_s=0.1,
        hold_s=30.0,
        replica_start_s=80.0,
    )


@pytest.mark.parametrize("system", SYSTEMS)
def test_each_system_is_a_serve_config_the_application_accepts(system: str, tmp_path: Path) -> None:
    knobs = _knobs(tmp_path)
    assert load_profile(str(knobs.profile)).prefill_max_tokens_per_s > 0
    config = serve_config(system, knobs)
    schema = ServeDeploySchema(**config)
    app = schema.applications[0]
    parsed = parse_args(app.args)
    assert parsed.router["server"]["port"] == 8301
    variable = parsed.connector["secret_env"]  # the example's: the engines need the key in their environment
    assert parsed.prefill.env[variable] == parsed.decode.env[variable] != ""
    engines = {
        d["name"]: d for d in config["applications"][0]["deployments"] if d["name"] in ("Prefill", "Decode")
    }
    for options in engines.values():
        assert options["ray_actor_options"]["resources"] == {"engine": 1}  # at most ENGINE_SLOTS alive
        most = options.get("autoscaling_config", {}).get("max_replicas", options.get("num_replicas"))
        assert most * 2 <= ENGINE_SLOTS + 1
    assert app.external_scaler_enabled == (system == "ours")
    assert (parsed.autoscale is not None) == (system == "ours")
    assert ("autoscaling_config" in engines["Decode"]) == (system == "ray")
    with pytest.raises(ValueError):
        serve_config("other", knobs)
