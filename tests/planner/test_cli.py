"""``pd-plan`` end to end in-process: the --json line format, errors, verify, plots, kv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner import cli, model
from planner.profile import Profile, load_profile, save_profile

PLAN_ARGS = ["--isl", "6144", "--osl", "512", "--ttft", "2", "--tpot", "0.02", "--tpm", "5e6"]


@pytest.fixture
def profile_path(tmp_path: Path, paper_profile: Profile) -> Path:
    path = tmp_path / "profile.json"
    save_profile(paper_profile, path)
    return path


def test_json_last_line_format(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*PLAN_ARGS, "--profile", str(profile_path), "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = json.loads(last)
    assert list(figures) == list(model.PLAN_JSON_FIELDS)
    assert isinstance(figures["prefill_instances"], int) and isinstance(figures["decode_instances"], int)
    expected = model.plan(
        load_profile(profile_path), model.Workload(5e6 / 60, isl=6144, osl=512, ttft_s=2, tpot_s=0.02)
    )
    assert figures == pytest.approx(expected.summary())
    assert (figures["prefill_instances"], figures["decode_instances"]) == (3, 2)


def test_throughput_in_tokens_per_second_equals_tpm(
    profile_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a if a != "--tpm" else "--throughput" for a in PLAN_ARGS]
    args[args.index("5e6")] = str(5e6 / 60)
    cli.main([*args, "--profile", str(profile_path), "--json"])
    cli.main([*PLAN_ARGS, "--profile", str(profile_path), "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[0]) == pytest.approx(json.loads(lines[1]))


def test_infeasible_explains_and_exits_2(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [*PLAN_ARGS, "--profile", str(profile_path), "--json"]
    args[args.index("--ttft") + 1] = "0.2"
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out.strip().splitlines()[-1])["error"]
    assert "minimum achievable TTFT 0.2536 s" in error
    assert "infeasible" in captured.err


def test_bad_profile_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"prefill_max_tokens_per_s": 1, "ttft_overhead_s": 0, "decode": []}')
    with pytest.raises(SystemExit) as info:
        cli.main([*PLAN_ARGS, "--profile", str(path)])
    assert info.value.code == 2
    assert "`decode` is empty" in capsys.readouterr().err


def test_missing_target_is_a_usage_error(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--isl", "1", "--osl", "1", "--ttft", "1", "--tpot", "1", "--profile", str(profile_path)])
    assert "one of the arguments --throughput --tpm is required" in capsys.readouterr().err


def test_verify_and_plots(profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plots = tmp_path / "plots"
    args = [
        *PLAN_ARGS,
        "--profile",
        str(profile_path),
        "--verify",
        "--requests",
        "3000",
        "--plot-dir",
        str(plots),
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    for shape in ("3P2D", "2P2D", "3P1D"):
        assert shape in out
    assert "verdict: the plan meets the SLOs" in out
    for name in ("decode-curve.png", "attainment.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kv_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "hidden_size": 8192,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["kv", "--model", str(tmp_path), "--tokens", "4096", "--link", "400Gbps", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bytes_per_token"] == 327680
    assert result["transfer_s"] == pytest.approx(327680 * 4096 / 50e9)


def test_kv_bad_config_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        cli.main(["kv", "--model", str(tmp_path), "--tokens", "1"])
    assert "num_hidden_layers" in capsys.readouterr().err


TRACE_ARGS = ["trace", "--ttft", "1", "--tpot", "0.02", "--prefill-samples", "2", "--decode-samples", "1"]


def test_trace_json_last_line_and_plot(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "day.png"
    args = [*TRACE_ARGS, "--profile", str(profile_path), "--peak-rate", "100", "--hours", "2"]
    assert cli.main([*args, "--plot", str(plot), "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert list(result["methods"]) == ["mean-only", "mean-only-same-gpus", "ours-no-lead", "ours"]
    for figures in result["methods"].values():
        assert 0 <= figures["overall_attainment"] <= 1 and figures["peak_gpus"] >= 2
    assert "GPU-hours" in captured.err  # the table goes to stderr with --json
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_fits_lengths_and_reads_hourly_rates(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text("".join(f'{{"input": {n}, "output": {n // 8}}}\n' for n in (1000, 2000, 4000, 3000)))
    rates = tmp_path / "rates.json"
    rates.write_text("[50, 80]")
    args = [
        *TRACE_ARGS,
        "--profile",
        str(profile_path),
        "--lengths",
        str(lengths),
        "--hourly-rates",
        str(rates),
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "ISL lognormal median 2213" in out  # exp(mean(log(1000, 2000, 4000, 3000)))
    assert "8 windows of 900 s" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--percentile", "100"], "percentile"),
        (["--replica-start-s", "-5"], "start"),
        (["--isl-sigma", "-1"], "sigma"),
    ],
)
def test_trace_bad_input_is_a_usage_error(
    profile_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([*TRACE_ARGS, "--profile", str(profile_path), "--peak-rate", "10", "--hours", "1", *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_trace_infeasible_percentile_slo_exits_2(
    profile_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*TRACE_ARGS, "--profile", str(profile_path), "--peak-rate", "10", "--hours", "1", "--json"]
    args[args.index("--ttft") + 1] = "0.2"
    assert cli.main(args) == 2
    assert (
        "p90 TTFT of an idle P instance"
        in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    )
