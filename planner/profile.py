"""The profile file: what the planner and the simulator know about one P or D instance.

Written by ``pd-plan profile`` (``planner.profiler``) or by hand, read by ``pd-plan`` (``planner.cli``). The
schema is a msgspec Struct so that a wrong type, a missing field or a typo in a field name is reported with
its JSON path, and the checks msgspec cannot express (at least one decode point, unique batch sizes, TPOT
growing with the batch) are done here with messages that say what to fix.

    {"prefill_max_tokens_per_s": float, "ttft_overhead_s": float,
     "decode": [{"batch": int, "tpot_s": float}, ...]}
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated

import msgspec

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class ProfileError(ValueError):
    """A profile file is missing, is not JSON, or does not describe a usable instance."""


class DecodePoint(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Measured time per output token with ``batch`` requests decoding together on one D instance."""

    batch: PositiveInt
    tpot_s: PositiveFloat


class Profile(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """One instance's measured performance.

    ``prefill_max_tokens_per_s``: saturated prefill throughput at the profiled input length.
    ``ttft_overhead_s``: the part of TTFT that is not prefill compute (KV transfer, HTTP, tokenisation).
    ``decode``: the TPOT-vs-batch curve. ``isl`` (input length the prefill was measured at) and ``source``
    (endpoint or note) are optional metadata the profiler fills in.
    """

    prefill_max_tokens_per_s: PositiveFloat
    ttft_overhead_s: NonNegativeFloat
    decode: list[DecodePoint]
    isl: PositiveInt | None = None
    source: str | None = None

    def sorted_decode(self) -> list[DecodePoint]:
        return sorted(self.decode, key=lambda p: p.batch)


def check(profile: Profile) -> Profile:
    """Checks beyond the schema; raises ``ProfileError`` naming the problem."""
    if not profile.decode:
        raise ProfileError("`decode` is empty: it needs at least one {batch, tpot_s} point")
    batches = [p.batch for p in profile.decode]
    duplicates = sorted({b for b in batches if batches.count(b) > 1})
    if duplicates:
        raise ProfileError(f"`decode` has more than one point for batch {duplicates}: keep one per batch")
    points = profile.sorted_decode()
    for lower, higher in itertools.pairwise(points):
        if higher.tpot_s < lower.tpot_s:
            raise ProfileError(
                f"`decode`: TPOT falls from {lower.tpot_s:g} s at batch {lower.batch} to {higher.tpot_s:g} s "
                f"at batch {higher.batch}; a larger batch cannot decode faster per token (re-measure)"
            )
    return profile


def decode_profile(data: bytes, origin: str = "profile") -> Profile:
    """Parse and check profile JSON bytes; ``origin`` names the source in error messages."""
    try:
        profile = msgspec.json.decode(data, type=Profile)
    except msgspec.ValidationError as exc:
        raise ProfileError(f"{origin}: invalid profile: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ProfileError(f"{origin}: not valid JSON: {exc}") from exc
    try:
        return check(profile)
    except ProfileError as exc:
        raise ProfileError(f"{origin}: {exc}") from exc


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile file; every failure is a ``ProfileError`` with the path in its message."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc.strerror or exc}") from exc
    return decode_profile(data, str(path))


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write a checked profile as indented JSON (written to a temporary name first, so nothing is half-written)."""
    check(profile)
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")
    tmp.replace(target)
