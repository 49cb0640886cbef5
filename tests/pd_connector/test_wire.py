"""The router <-> engine wire contract: each flow's parameters round-trip, anything else is refused clearly."""

from __future__ import annotations

from typing import Any

import pytest

from pd_connector import wire


@pytest.mark.parametrize(
    "params",
    [
        wire.PushPrefill("t1"),
        wire.PushPrefill("t1", pd_test_corrupt=True),
        wire.PushDecode("t1", "10.0.0.1:7600"),
        wire.PushDecode("t1", "[fd00::1]:7600"),
        wire.StandardPrefill(),
        wire.PrefillReturned("cmpl-abc-0", "p0.cluster:7600"),
        wire.PrefillReturned("cmpl-abc-0", "p0.cluster:7600", pd_seed_first_token=True, pd_first_token=0),
    ],
)
def test_every_shape_round_trips_through_json_ready_dicts(params: wire.Params) -> None:
    assert wire.parse_params(wire.encode(params)) == params


def test_unset_optional_fields_stay_off_the_wire() -> None:
    """Legs that do not use them look as before; a first token 0 (a real token id) is not "unset"."""
    assert set(wire.encode(wire.PrefillReturned("t", "h:1"))).isdisjoint(
        {"pd_first_token", "pd_seed_first_token"}
    )
    assert wire.encode(wire.PrefillReturned("t", "h:1", pd_first_token=0))["pd_first_token"] == 0


def test_no_instruction_is_none() -> None:
    assert wire.parse_params(None) is None
    assert wire.parse_params({}) is None
    assert wire.parse_params({"do_remote_decode": False, "do_remote_prefill": False}) is None


def test_other_connectors_fields_do_not_break_our_params() -> None:
    """vLLM's standard flow carries remote_* values of other connectors; we read only what our role needs."""
    returned = {**wire.encode(wire.PrefillReturned("t", "h:1")), "remote_host": "x", "remote_port": 5}
    assert wire.parse_params(returned) == wire.PrefillReturned("t", "h:1")


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("prefill", "must be an object"),
        ([1], "must be an object"),
        ({"pd_role": "boss"}, "unknown pd_role"),
        ({"pd_role": "prefill"}, "pd_transfer_id"),
        ({"pd_role": "prefill", "pd_transfer_id": ""}, "pd_transfer_id"),
        ({"pd_role": "prefill", "pd_transfer_id": "a b"}, "pd_transfer_id"),
        ({"pd_role": "prefill", "pd_transfer_id": "t", "pd_test_corrupt": "yes"}, "pd_test_corrupt"),
        ({"pd_role": "decode", "pd_transfer_id": "t"}, "pd_prefill_addr"),
        ({"pd_role": "decode", "pd_transfer_id": "t", "pd_prefill_addr": "host"}, "pd_prefill_addr"),
        ({"pd_role": "decode", "pd_transfer_id": "t", "pd_prefill_addr": "h:1/../x"}, "pd_prefill_addr"),
        ({"do_remote_prefill": True}, "pd_transfer_id"),
        (
            {
                "do_remote_prefill": True,
                "pd_transfer_id": "t",
                "pd_prefill_addr": "h:1",
                "pd_first_token": -1,
            },
            "pd_first_token",
        ),
        (
            {
                "do_remote_prefill": True,
                "pd_transfer_id": "t",
                "pd_prefill_addr": "h:1",
                "pd_first_token": "7",
            },
            "pd_first_token",
        ),
        (
            {
                "do_remote_prefill": True,
                "pd_transfer_id": "t",
                "pd_prefill_addr": "h:1",
                "pd_first_token": 2**31,
            },
            "pd_first_token",
        ),
    ],
)
def test_malformed_params_are_refused_naming_the_field(raw: Any, why: str) -> None:
    with pytest.raises(wire.BadParams, match=why):
        wire.parse_params(raw)


def test_transfer_fields_cover_both_engines() -> None:
    assert {
        "kv_transfer_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
    } <= wire.TRANSFER_FIELDS
