"""benchmarks.rss_soak's load and arithmetic, without engines."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from benchmarks.rss_soak import OUTPUT_TOKENS, PROMPT_TOKENS, plot, request_bodies, summarize

pytestmark = pytest.mark.unit


def test_growth_is_counted_from_the_first_round_and_scaled_per_thousand_requests() -> None:
    rss = {"p": [3000.0, 3010.0, 3030.0], "d": [2900.0, 2900.0, 2950.0]}
    summary = summarize(rss, per_round=100)
    assert summary["growth_mb"] == {"p": 30.0, "d": 50.0}  # the first round's own growth is warm-up
    assert summary["per_1k_requests_mb"] == 400.0  # 80 MB over the 200 requests after the first round
    assert summary["rss_mb"] == rss


def test_one_round_has_nothing_to_scale() -> None:
    assert summarize({"p": [3000.0]}, per_round=100)["per_1k_requests_mb"] is None


def test_the_load_is_the_same_per_seed_and_within_bounds() -> None:
    bodies = request_bodies(200, 2048, random.Random(1))
    assert bodies == request_bodies(200, 2048, random.Random(1))
    lengths = [len(b["prompt"]) for b in bodies]
    assert PROMPT_TOKENS[0] <= min(lengths) and max(lengths) <= PROMPT_TOKENS[1]
    assert all(100 <= t < 2048 for b in bodies for t in b["prompt"])
    assert all(b["max_tokens"] == OUTPUT_TOKENS for b in bodies)
    streamed = sum(b["stream"] for b in bodies)
    assert 0 < streamed < len(bodies)


def test_the_plot_is_written(tmp_path: Path) -> None:
    systems = {
        "pd": summarize({"pd-prefill": [1.0, 2.0], "pd-decode": [1.0, 3.0]}, per_round=10),
        "aggregated": summarize({"aggregated-e0": [1.0, 2.0]}, per_round=10),
    }
    plot(systems, 10, tmp_path / "rss.png")
    assert (tmp_path / "rss.png").stat().st_size > 0
