"""Profile files: round trip, and every kind of bad file gets an error that says what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.profile import DecodePoint, Profile, ProfileError, load_profile, save_profile

GOOD = {
    "prefill_max_tokens_per_s": 1000.0,
    "ttft_overhead_s": 0.05,
    "decode": [{"batch": 1, "tpot_s": 0.01}, {"batch": 4, "tpot_s": 0.012}],
}


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_round_trip(tmp_path: Path) -> None:
    profile = Profile(1000.0, 0.05, [DecodePoint(1, 0.01), DecodePoint(4, 0.012)], isl=512, source="x")
    save_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile
    assert load_profile(_write(tmp_path, GOOD)).decode[1] == DecodePoint(4, 0.012)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "Expected `object`, got `array`"),
        ({k: v for k, v in GOOD.items() if k != "decode"}, "missing required field `decode`"),
        (
            {**GOOD, "prefill_max_tokens_per_s": "fast"},
            r"Expected `float`, got `str` - at `\$.prefill_max_tokens_per_s`",
        ),
        (
            {**GOOD, "prefill_max_tokens_per_s": 0},
            r"Expected `float` > 0.0 - at `\$.prefill_max_tokens_per_s`",
        ),
        ({**GOOD, "ttft_overhead_s": -0.1}, r"Expected `float` >= 0.0 - at `\$.ttft_overhead_s`"),
        ({**GOOD, "decode": [{"batch": 0, "tpot_s": 0.01}]}, r"at `\$.decode\[0\].batch`"),
        ({**GOOD, "decode": [{"batch": 1, "tpot": 0.01}]}, "unknown field `tpot`"),
        ({**GOOD, "prefil_max_tokens_per_s": 1.0}, "unknown field `prefil_max_tokens_per_s`"),
        ({**GOOD, "decode": []}, "`decode` is empty"),
        ({**GOOD, "decode": [{"batch": 2, "tpot_s": 0.01}, {"batch": 2, "tpot_s": 0.02}]}, r"batch \[2\]"),
        ({**GOOD, "decode": [{"batch": 1, "tpot_s": 0.02}, {"batch": 8, "tpot_s": 0.01}]}, "TPOT falls"),
    ],
)
def test_bad_profiles_are_explained(tmp_path: Path, data: object, message: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read profile: No such file"):
        load_profile(tmp_path / "absent.json")


def test_save_refuses_a_bad_profile_and_keeps_the_old_file(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    with pytest.raises(ProfileError):
        save_profile(Profile(1.0, 0.0, []), path)
    assert json.loads(path.read_text()) == GOOD
