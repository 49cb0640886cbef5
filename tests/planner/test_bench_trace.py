"""``python -m benchmarks.planner_trace``: its last stdout line is one JSON object (here on a tiny case)."""

from __future__ import annotations

import json

import pytest

from benchmarks import planner_trace


def test_last_line_is_the_comparison_with_timings(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--peak-rate", "40", "--hours", "1", "--prefill-samples", "1", "--decode-samples", "1"]
    assert planner_trace.main(["--repetitions", "2", *tiny]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["wall_s"]) == 2 and result["wall_s_median"] > 0
    assert set(result["methods"]) == {"mean-only", "mean-only-same-gpus", "ours-no-lead", "ours"}
    assert result["command"].endswith("--peak-rate 40 --hours 1 --prefill-samples 1 --decode-samples 1")
