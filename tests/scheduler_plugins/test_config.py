"""Settings come from defaults, PD_SCHED_* variables and --additional-config; bad values fail loudly."""

from __future__ import annotations

import functools

import pytest

from scheduler_plugins import config
from scheduler_plugins.config import (
    InvalidTargetWarnings,
    Mode,
    SchedulerSettings,
    load_settings,
    request_target_ms,
    tightened_ms,
)


def test_defaults() -> None:
    settings = load_settings({"PATH": "/bin"}, None)
    assert settings == SchedulerSettings()
    assert settings.mode is Mode.COLOCATED and settings.itl_target_ms == 100.0
    assert settings.tpot_target_ms == 0.0  # no TPOT account unless set


def test_env_then_additional_config_wins() -> None:
    env = {"PD_SCHED_ITL_TARGET_MS": "50", "PD_SCHED_MODE": "decode", "PD_SCHED_HEADROOM": "0.7"}
    settings = load_settings(env, {"scheduler_plugins": {"itl_target_ms": 80, "mode": "prefill"}})
    assert settings.itl_target_ms == 80 and settings.mode is Mode.PREFILL and settings.headroom == 0.7


def test_other_additional_config_sections_are_ignored() -> None:
    assert load_settings({}, {"someone_else": {"x": 1}}) == SchedulerSettings()


@pytest.mark.parametrize(
    ("env", "additional", "fragment"),
    [
        ({"PD_SCHED_ITL_TARGET_MS": "-1"}, None, "itl_target_ms"),
        ({"PD_SCHED_ITL_TARGET_MS": "fast"}, None, "itl_target_ms"),
        ({"PD_SCHED_TPOT_TARGET_MS": "-1"}, None, "tpot_target_ms"),
        ({"PD_SCHED_LOST_TARGET_SLACK": "-0.1"}, None, "lost_target_slack"),
        ({"PD_SCHED_LONE_STEP_TTFT_SHARE": "1.5"}, None, "lone_step_ttft_share"),
        ({"PD_SCHED_TYPO": "1"}, None, "PD_SCHED_TYPO"),
        ({}, {"scheduler_plugins": {"mode": "both"}}, "mode"),
        ({}, {"scheduler_plugins": {"headroom": 1.5}}, "headroom"),
        ({}, {"scheduler_plugins": {"colour": "red"}}, "colour"),
        ({}, {"scheduler_plugins": [1, 2]}, "JSON object"),
    ],
)
def test_bad_values_name_the_setting(env: dict, additional: dict | None, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        load_settings(env, additional)


def test_a_lone_step_takes_its_share_of_the_ttft_target() -> None:
    """0.25 x 0.85 x 2000 ms by default; 0: no limit."""
    assert SchedulerSettings().lone_step_limit_s() == pytest.approx(0.425)
    assert SchedulerSettings(ttft_target_ms=1000, headroom=1).lone_step_limit_s() == pytest.approx(0.25)
    assert SchedulerSettings(lone_step_ttft_share=0).lone_step_limit_s() == float("inf")


@pytest.mark.parametrize(
    ("align", "min_chunk", "block", "expect"), [(0, 0, 32, 32), (0, 40, 32, 64), (16, 0, 32, 16)]
)
def test_min_chunk_is_aligned(align: int, min_chunk: int, block: int, expect: int) -> None:
    settings = SchedulerSettings(chunk_align_tokens=align, min_chunk_tokens=min_chunk)
    assert settings.min_chunk(block) == expect


def test_default_chunks_are_finer_than_a_block() -> None:
    """By default chunks are 16-token multiples whatever the block size (vLLM needs no block alignment)."""
    settings = SchedulerSettings()
    assert (settings.chunk_align(32), settings.min_chunk(32)) == (16, 16)
    assert SchedulerSettings(chunk_align_tokens=0).chunk_align(32) == 32


def test_a_request_target_only_tightens_an_optional_server_target() -> None:
    assert tightened_ms(30.0, 0.0) == 30.0  # no server target: the request's own
    assert tightened_ms(30.0, 50.0) == 30.0
    assert tightened_ms(80.0, 50.0) == 50.0  # never looser than the server's


def test_an_invalid_request_target_is_warned_of_once_per_request_and_name() -> None:
    """Each planned step reads its requests' targets again; the log gets one line per bad request and name."""
    warned: list[tuple[str, str, object]] = []
    invalid = InvalidTargetWarnings(lambda rid, key, value: warned.append((rid, key, value)))
    for rid in ["a", "a", "b", "a"]:
        for key in ["itl_target_ms", "ttft_target_ms"]:
            assert request_target_ms({key: "soon"}, key, 7.0, functools.partial(invalid, rid)) == 7.0
    assert warned == [
        ("a", "itl_target_ms", "soon"),
        ("a", "ttft_target_ms", "soon"),
        ("b", "itl_target_ms", "soon"),
        ("b", "ttft_target_ms", "soon"),
    ]


def test_invalid_target_warnings_remember_a_bounded_number_of_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Clients sending bad requests without end cannot grow the scheduler's memory: the oldest is forgotten
    (and would be warned of again)."""
    monkeypatch.setattr(config, "REMEMBERED_INVALID_TARGETS", 2)
    warned: list[str] = []
    invalid = InvalidTargetWarnings(lambda rid, key, value: warned.append(rid))
    for rid in ["a", "b", "c", "c", "b", "a"]:
        invalid(rid, "itl_target_ms", -1)
    assert warned == ["a", "b", "c", "a"]
