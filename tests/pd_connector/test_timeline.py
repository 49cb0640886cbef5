"""Stage spans are named in the order the stages happened, so a histogram label says what waited for what."""

from __future__ import annotations

import time

import pytest

from pd_connector.timeline import SEND_STAGES, Timeline, spans


def test_spans_follow_the_order_stages_happened_in() -> None:
    usual = {"offered": 1.0, "destinations": 1.5, "prompt_done": 3.0, "done": 3.25}
    assert spans(usual, SEND_STAGES) == {
        "offered->destinations": 0.5,
        "destinations->prompt_done": 1.5,
        "prompt_done->done": 0.25,
    }
    late_decode = {"offered": 1.0, "destinations": 4.0, "prompt_done": 3.0, "done": 4.5}
    assert spans(late_decode, SEND_STAGES) == {
        "offered->prompt_done": 2.0,
        "prompt_done->destinations": 1.0,
        "destinations->done": 0.5,
    }
    assert spans({"offered": 1.0, "unknown": 2.0}, SEND_STAGES) == {}


def test_a_stage_keeps_its_first_stamp_and_can_be_backdated() -> None:
    line = Timeline()
    before = time.monotonic()
    line.mark("offered", before - 0.5)  # stamped on another thread half a second ago
    line.mark("offered")
    assert line.stamps["offered"] == pytest.approx(time.time() - 0.5, abs=0.05)
