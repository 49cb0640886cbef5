"""Shared profiles for the planner's unit tests."""

from __future__ import annotations

import pytest

from planner.profile import DecodePoint, Profile

#: Five decode points of a GPU-like server: the profile of the fleet and tail-latency tests.
PROFILE = Profile(
    prefill_max_tokens_per_s=40000.0,
    ttft_overhead_s=0.1,
    decode=[DecodePoint(1, 0.010), DecodePoint(8, 0.011), DecodePoint(32, 0.014), DecodePoint(64, 0.018),
            DecodePoint(128, 0.026)],
)  # fmt: skip


@pytest.fixture
def paper_profile() -> Profile:
    """Three decode points, so the quadratic fit passes exactly through them (TPOT 20 ms <-> 4000 tok/s)."""
    return Profile(
        prefill_max_tokens_per_s=40000.0,
        ttft_overhead_s=0.1,
        decode=[DecodePoint(1, 0.010), DecodePoint(80, 0.020), DecodePoint(128, 0.026)],
    )
