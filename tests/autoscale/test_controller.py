"""The controller's loop on pd-router's real metrics text and a scaler that records what it is told: D scales
up on load at once and back down after the hold, each decision is exported, a failed scrape skips an interval,
and ``run`` stops when told."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import msgspec
import pytest

from pd_disagg.autoscale.controller import Controller
from pd_disagg.autoscale.metrics import serve
from pd_disagg.autoscale.policy import Reason, Replicas
from pd_disagg.autoscale.settings import AutoscaleSettings, check
from pd_disagg.servers import free_port
from planner.profile import DecodePoint, Profile
from router.metrics import RouterMetrics

PROFILE = Profile(
    prefill_max_tokens_per_s=4000.0,
    ttft_overhead_s=0.05,
    decode=[DecodePoint(1, 0.02), DecodePoint(8, 0.025), DecodePoint(32, 0.04)],
)


class RecordingScaler:
    """Reports each role's replicas as the last count it was told, all running (or that many starting)."""

    def __init__(self) -> None:
        self.targets = {"prefill": 1, "decode": 1}
        self.calls: list[tuple[str, int]] = []

    async def replicas(self) -> dict[str, Replicas]:
        return {role: Replicas(running=n, starting=0, target=n) for role, n in self.targets.items()}

    async def scale(self, role: str, target: int) -> None:
        self.calls.append((role, target))
        self.targets[role] = target


def _settings(tmp_path: Path, **over: object) -> AutoscaleSettings:
    path = tmp_path / "profile.json"
    path.write_bytes(msgspec.json.encode(PROFILE))
    raw = {
        "profile": str(path),
        "ttft_slo_s": 1.0,
        "tpot_slo_s": 0.03,
        "interval_s": 10.0,
        "window_s": 10.0,
        "replica_start_s": 0.0,
        "scale_down_hold_s": 30.0,
        "cooldown_s": 0.0,
        "min_samples": 1,
        "max_decode": 2,
        **over,
    }
    return msgspec.convert(raw, AutoscaleSettings)


def _load(router: RouterMetrics, requests: int) -> None:
    for _ in range(requests):
        router.requests_for("/v1/completions", "disagg", "long").inc()
        router.lengths("disagg", 500, 100)
        router.ttft_for("disagg").observe(0.2)
        router.itl_for("disagg").observe(0.02)


async def test_decode_follows_the_load_up_at_once_and_down_after_the_hold(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    router, scaler, clock = RouterMetrics(), RecordingScaler(), [0.0]

    async def scrape() -> str:
        return router.render().decode()

    controller = Controller(settings, check(settings), scrape, scaler, clock=lambda: clock[0])
    assert await controller.tick() == []  # one scrape: no estimate yet
    clock[0] = 10.0
    _load(router, 200)  # 20 req/s
    decisions = {d.role: d for d in await controller.tick()}
    assert (decisions["decode"].target, decisions["decode"].reason) == (2, Reason.PLAN_UP)
    assert ("decode", 2) in scaler.calls
    reasons = []
    for t in range(20, 70, 10):  # no more load: the plan drops at t = 20 (window 10 s)
        clock[0] = float(t)
        reasons.append(next(d.reason for d in await controller.tick() if d.role == "decode"))
    assert reasons == [Reason.HOLD, Reason.HOLD, Reason.HOLD, Reason.PLAN_DOWN, Reason.STEADY]
    assert scaler.calls[-1] == ("decode", 1)
    # The recording scaler's replicas run as soon as ordered: measured at the next interval.
    assert controller.starts.measured_s == {"prefill": 10.0, "decode": 10.0}
    text = controller.metrics.render().decode()
    assert 'pd_autoscale_desired_replicas{role="decode"} 1.0' in text
    assert 'pd_autoscale_decisions_total{reason="plan_up",role="decode"} 1.0' in text
    assert 'pd_autoscale_decisions_total{reason="plan_down",role="decode"} 1.0' in text
    assert 'pd_autoscale_replica_start_seconds{role="decode"} 10.0' in text


async def test_a_failed_scrape_skips_the_interval_and_is_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _settings(tmp_path)
    scaler = RecordingScaler()

    async def scrape() -> str:
        raise aiohttp.ClientConnectionError("router down")

    controller = Controller(settings, check(settings), scrape, scaler)
    with caplog.at_level(logging.DEBUG, "pd_disagg.autoscale"):
        assert await controller.tick() == [] and await controller.tick() == [] and scaler.calls == []
    assert 'pd_autoscale_errors_total{step="scrape"} 2.0' in controller.metrics.render().decode()
    # One warning when it starts failing, not one per interval.
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]


async def test_run_ticks_until_stopped_and_serves_its_metrics(tmp_path: Path) -> None:
    settings = _settings(tmp_path, interval_s=0.01)
    router, ticked = RouterMetrics(), asyncio.Event()

    async def scrape() -> str:
        ticked.set()
        return router.render().decode()

    controller = Controller(settings, check(settings), scrape, RecordingScaler())
    port = free_port()
    runner = await serve(controller.metrics, "127.0.0.1", port)
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        await asyncio.wait_for(ticked.wait(), 10)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as resp,
        ):
            assert resp.status == 200 and "pd_autoscale_desired_replicas" in await resp.text()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await runner.cleanup()


def test_settings_check_names_each_bad_setting(tmp_path: Path) -> None:
    settings = _settings(tmp_path, ttft_slo_s=0.0, min_decode=3, max_decode=2, percentile=100.0)
    with pytest.raises(ValueError) as error:
        check(settings)
    for name in ("ttft_slo_s", "min_decode, max_decode", "percentile"):
        assert name in str(error.value)
    with pytest.raises(ValueError, match="profile:"):
        check(msgspec.structs.replace(settings, profile=str(tmp_path / "missing.json")))
