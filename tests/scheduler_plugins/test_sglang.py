"""scheduler_plugins.sglang against a fake SGLang scheduler that has the fields and methods the adapter touches
(``pd_connector.sglang.compat.scheduler`` reads them by the same names on the real one; the integration test in
integration_tests/test_sglang.py runs it on a real server). Hooks are called as SGLang's ``HookRegistry``
calls them: AROUND with the original first, BEFORE with the arguments, AFTER with the result first."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from pd_connector.sglang.compat import scheduler as compat
from scheduler_plugins import sglang
from scheduler_plugins.config import Mode, SchedulerSettings
from scheduler_plugins.cost_model import CostModel, step_shape

CAP = 512
# A fixed law: 20 ms + 1 ms per prefill token + 1 ms per decode, attention free.
LAW = (0.020, 1e-3, 1e-3, 0.0)


def _params(custom: Any = None, max_new_tokens: int | None = 128) -> Any:
    return SimpleNamespace(custom_params=custom, max_new_tokens=max_new_tokens)


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    extend_end: int | None = None
    sampling_params: Any = field(default_factory=_params)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    time_stats: Any = None  # SGLang's SchedulerReqTimeStats: scheduler_recv_time, a perf_counter() reading


class FakeMode:
    def __init__(self, name: str) -> None:
        self.name = name

    def is_decode(self) -> bool:
        return self.name == "decode"

    def is_extend(self) -> bool:
        return self.name in ("extend", "mixed")

    def is_mixed(self) -> bool:
        return self.name == "mixed"


class FakeScheduler:
    """SGLang's ``Scheduler`` as the adapter sees it; ``get_new_batch_prefill`` records the chunk size it read."""

    def __init__(self, mixed: bool = True, cap: int | None = CAP, mode: str = "null") -> None:
        self.chunked_prefill_size = cap
        self.is_mixed_chunk = mixed
        self.enable_overlap = False
        self.page_size = 1
        self.chunked_req: FakeReq | None = None
        self.waiting_queue: list[FakeReq] = []
        self.server_args = SimpleNamespace(disaggregation_mode=mode)
        self.seen: list[int | None] = []

    def get_new_batch_prefill(self, running_batch: Any) -> str:
        self.seen.append(self.chunked_prefill_size)
        return "plan"


def _running(*lengths: int, params: Any = None) -> Any:
    return SimpleNamespace(reqs=[FakeReq(list(range(n)), sampling_params=_params(params)) for n in lengths])


def _started(monkeypatch: pytest.MonkeyPatch, scheduler: FakeScheduler, **settings: str) -> sglang.SLOChunker:
    for name, value in settings.items():
        monkeypatch.setenv(f"PD_SCHED_{name.upper()}", value)
    sglang.init_hook(None, scheduler)
    chunker = compat.attached(scheduler)
    assert isinstance(chunker, sglang.SLOChunker)
    return chunker


def _prefill(scheduler: FakeScheduler, running_batch: Any) -> int | None:
    assert sglang.prefill_hook(FakeScheduler.get_new_batch_prefill, scheduler, running_batch) == "plan"
    assert scheduler.chunked_prefill_size == CAP  # the configured size is back after the call
    return scheduler.seen[-1]


def test_the_chunk_follows_the_budget_and_counts_the_riding_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = FakeScheduler()
    chunker = _started(monkeypatch, scheduler, itl_target_ms="100")
    chunker.cost_model = CostModel(LAW)
    scheduler.waiting_queue = [FakeReq(list(range(1000)))]
    # 3 decodes: 20 + 3 + chunk ms <= 85 ms (headroom 0.85) -> chunk 48 (16-token units); SGLang's
    # PrefillAdder subtracts the 3 mixed decodes from the size again.
    assert _prefill(scheduler, _running(10, 10, 10)) == 3 + 48
    assert chunker.last_chunk == 48


def test_no_pending_prefill_leaves_sglang_size(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = FakeScheduler()
    _started(monkeypatch, scheduler, itl_target_ms="1")
    assert _prefill(scheduler, _running(10)) == CAP


def test_a_partial_prefill_gets_the_chunk_with_its_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill under way goes first, and its computed tokens make deep chunks cost more."""
    scheduler = FakeScheduler()
    chunker = _started(monkeypatch, scheduler, itl_target_ms="100")
    chunker.cost_model = CostModel((0.020, 1e-3, 1e-3, 1e-6))  # + 1 us per attended pair
    scheduler.waiting_queue = [FakeReq(list(range(1000)))]
    shallow = _prefill(scheduler, _running(10))
    scheduler.chunked_req = FakeReq(list(range(2000)), extend_end=1500)
    deep = _prefill(scheduler, _running(10))
    assert shallow is not None and deep is not None and deep < shallow


@pytest.mark.parametrize(
    ("chunk_lone", "share", "expected"), [("false", "0.25", 400), ("false", "0", CAP), ("true", "0.25", 64)]
)
def test_a_prefill_with_no_decode_beside_it_takes_the_lone_limit(
    monkeypatch: pytest.MonkeyPatch, chunk_lone: str, share: str, expected: int
) -> None:
    """No stream is between two tokens, so the ITL target does not chunk it (unless chunk_lone_prefill): the
    lone step's share of the TTFT target does (0.25 x 0.85 x 2000 ms: 20 + 400 ms), or nothing (share 0:
    the whole cap)."""
    scheduler = FakeScheduler()
    chunker = _started(
        monkeypatch,
        scheduler,
        itl_target_ms="100",
        chunk_lone_prefill=chunk_lone,
        lone_step_ttft_share=share,
    )
    chunker.cost_model = CostModel(LAW)
    scheduler.waiting_queue = [FakeReq(list(range(1000)))]
    # 20 + chunk ms <= 85 ms -> 64 (16-token units) when chunked to the ITL target.
    assert _prefill(scheduler, _running()) == expected


@pytest.mark.parametrize(("first", "behind", "expected"), [(48, 1000, 64), (1000, 16, 400), (48, None, 400)])
def test_a_lone_step_is_short_only_when_its_first_prompt_ends_in_it_and_another_waits(
    monkeypatch: pytest.MonkeyPatch, first: int, behind: int | None, expected: int
) -> None:
    """No decode: a 48-token prompt with a long one behind it ends in a step of the ITL size (20 + 64 ms <=
    85), and the long one takes the rest of it, instead of both waiting for a lone step of 420 ms (the
    TTFT target's share). A short prompt behind a long one gains nothing from the ITL size here (SGLang
    gives the chunk to the first prompt), nor does a prompt alone: the lone step's limit stands."""
    scheduler = FakeScheduler()
    chunker = _started(monkeypatch, scheduler, itl_target_ms="100")
    chunker.cost_model = CostModel(LAW)
    scheduler.waiting_queue = [FakeReq(list(range(n))) for n in (first, behind) if n]
    assert _prefill(scheduler, _running()) == expected


@pytest.mark.parametrize(
    ("aware", "ttft_params", "waited_s", "expected"),
    [
        ("false", None, 0.0, 16),  # the ITL target alone: 20 + 3 + chunk ms <= 34 ms -> the 16-token minimum
        # 1000 tokens of 1 ms, 23 ms per step, 0.85 x 2000 ms left: 30 steps, chunks of 34 -> 48
        ("true", None, 0.0, 48),
        ("true", {"ttft_target_ms": 1500}, 0.0, 96),  # its own target: 0.85 x 1500 ms, 11 steps, 91 -> 96
        ("true", None, 0.5, 96),  # received 0.5 s ago: 0.85 x 1500 ms left, as above
        ("true", {"ttft_target_ms": 900}, 0.0, 16),  # 1000 ms of prefill work cannot fit 765 ms: lost, ITL
    ],
)
def test_the_ttft_deadline_raises_the_chunk(
    monkeypatch: pytest.MonkeyPatch, aware: str, ttft_params: Any, waited_s: float, expected: int
) -> None:
    """Beside decodes, the chunk grows as far as the candidate's TTFT deadline needs (budget.deadline_chunk):
    the server's ttft_target_ms, or the request's own in custom_params, counted from SGLang's receipt."""
    scheduler = FakeScheduler()
    chunker = _started(
        monkeypatch, scheduler, itl_target_ms="40", ttft_target_ms="2000", ttft_aware_chunks=aware
    )
    chunker.cost_model = CostModel(LAW)
    received = SimpleNamespace(scheduler_recv_time=time.perf_counter() - waited_s) if waited_s else None
    params = SimpleNamespace(custom_params=ttft_params)
    scheduler.waiting_queue = [FakeReq(list(range(1000)), sampling_params=params, time_stats=received)]
    assert _prefill(scheduler, _running(10, 10, 10)) == 3 + expected


@pytest.mark.parametrize(
    ("aware", "second_target_ms", "expected"),
    [
        ("true", None, 16),  # no second prompt: the first has an hour, the ITL minimum does
        # both prompts' 500 tokens, 1 ms each, 23 ms per step, 0.85 x 1500 ms: 11 steps, 91 -> 96
        ("true", 1500, 96),
        ("true", 3_600_000, 16),  # the second has an hour too
        ("false", 1500, 16),
    ],
)
def test_the_ttft_floor_counts_the_waiting_queue_behind_the_candidate(
    monkeypatch: pytest.MonkeyPatch, aware: str, second_target_ms: float | None, expected: int
) -> None:
    """The prompt under way has no deadline in reach, but a waiting one behind it does: the floor counts
    both prompts' work before the second one's deadline."""
    scheduler = FakeScheduler()
    chunker = _started(monkeypatch, scheduler, itl_target_ms="40", ttft_aware_chunks=aware)
    chunker.cost_model = CostModel(LAW)
    patient = SimpleNamespace(custom_params={"ttft_target_ms": 3_600_000})
    scheduler.chunked_req = FakeReq(list(range(600)), extend_end=100, sampling_params=patient)
    if second_target_ms is not None:
        params = SimpleNamespace(custom_params={"ttft_target_ms": second_target_ms})
        scheduler.waiting_queue = [FakeReq(list(range(500)), sampling_params=params)]
    assert _prefill(scheduler, _running(10, 10, 10)) == 3 + expected


def test_a_request_target_tightens_the_step(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    scheduler = FakeScheduler()
    _started(monkeypatch, scheduler, itl_target_ms="100000")
    scheduler.waiting_queue = [FakeReq(list(range(1000)))]
    loose = CAP  # the decode + the whole room: it all fits, so the cap bounds the chunk, not the alignment
    assert _prefill(scheduler, _running(10)) == loose
    assert _prefill(scheduler, _running(10, params={"itl_target_ms": 1})) == 1 + 16  # the minimum chunk
    careless = _running(10, params={"itl_target_ms": "soon"})
    with caplog.at_level(logging.WARNING, logger=sglang.__name__):
        for _ in range(3):  # one request over three steps: warned of once
            assert _prefill(scheduler, careless) == loose
    rid = careless.reqs[0].rid
    assert [r.getMessage() for r in caplog.records] == [
        f"request {rid}: ignoring invalid custom_params itl_target_ms='soon'"
    ]


MIXED = SimpleNamespace(forward_mode=FakeMode("mixed"), extend_lens=[48, 1], prefix_lens=[96, 30])


class Learned(CostModel):
    """A cost model that keeps what it is taught."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, float]] = []

    def observe(self, shape: Any, seconds: float) -> None:
        self.seen.append((shape.prefill_tokens, seconds))


def _step(scheduler: FakeScheduler, batch: Any, clock: list[float], forward_s: float, after_s: float) -> None:
    """One iteration of SGLang's loop as the hooks see it, on a fake perf_counter: run_batch, its result
    handled ``forward_s`` later, and ``after_s`` more before the loop's next call (receiving, scheduling)."""
    sglang.run_hook(scheduler, batch)
    clock[0] += forward_s
    sglang.result_hook(None, scheduler, batch, "result")
    clock[0] += after_s


@pytest.mark.parametrize(("step_time", "learned"), [("cycle", [0.030, 0.020]), ("forward", [0.020, 0.020])])
def test_a_step_costs_its_whole_cycle_while_the_loop_runs_on(
    monkeypatch: pytest.MonkeyPatch, step_time: str, learned: list[float]
) -> None:
    """By default the cost model learns each step's cycle: run_batch to the next run_batch, SGLang's own work
    between steps included; and when the loop goes idle, only up to the end of the step's result handling.
    With step_time=forward it learns run_batch to the result's end, as before."""
    clock = [100.0]
    monkeypatch.setattr(sglang.time, "perf_counter", lambda: clock[0])
    scheduler = FakeScheduler()
    chunker = _started(monkeypatch, scheduler, step_time=step_time)
    chunker.cost_model = model = Learned()
    _step(scheduler, MIXED, clock, 0.020, 0.010)
    assert model.seen == []  # its cycle ends at the next step, or when the loop finds nothing to run
    _step(scheduler, MIXED, clock, 0.020, 0.500)  # the loop then idles for 0.5 s
    sglang.idle_hook(scheduler)
    sglang.idle_hook(scheduler)  # idle again: nothing more to learn
    sglang.result_hook(None, scheduler, MIXED, "result")  # a result with no step started is ignored
    # The second step's cycle ends at its result (20 ms), not after the idle wait.
    assert [(tokens, pytest.approx(s)) for tokens, s in model.seen] == [(48, learned[0]), (48, learned[1])]


def test_a_step_is_predicted_only_when_its_chunk_was_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prediction refits the model, so decode-only steps, which asked the policy nothing, are not
    predicted (their ``cycle/predicted`` is not logged)."""
    scheduler = FakeScheduler()
    chunker = _started(monkeypatch, scheduler, log_interval_s="0")
    chunker.cost_model = CostModel(LAW)
    predicted: list[Any] = []
    real = chunker.cost_model.predict
    monkeypatch.setattr(chunker.cost_model, "predict", lambda shape: predicted.append(shape) or real(shape))
    decode = SimpleNamespace(
        forward_mode=FakeMode("decode"), seq_lens_cpu=SimpleNamespace(tolist=lambda: [9])
    )
    sglang.run_hook(scheduler, decode)
    assert predicted == []
    scheduler.waiting_queue = [FakeReq(list(range(1000)))]
    _prefill(scheduler, _running(10))
    before = len(predicted)  # the chunk's search predicts too
    sglang.run_hook(scheduler, MIXED)
    assert len(predicted) == before + 1 and predicted[-1].prefill_tokens == 48


def test_a_failing_hook_falls_back_to_sglang_in_one_log_line(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    scheduler = FakeScheduler()
    chunker = _started(monkeypatch, scheduler, itl_target_ms="1")
    scheduler.waiting_queue = [FakeReq(list(range(1000)))]
    with caplog.at_level(logging.ERROR, logger=sglang.__name__):
        # a running request SGLang's real ones are not like: the adapter fails, SGLang decides
        assert _prefill(scheduler, SimpleNamespace(reqs=[object()])) == CAP
        assert _prefill(scheduler, _running(10)) == CAP  # off for good
        sglang.run_hook(scheduler, object())
    assert not chunker.active
    assert len(caplog.records) == 1 and "SGLang's own chunk size (512)" in caplog.text


@pytest.mark.parametrize(
    ("facts", "named"),
    [
        ({"mixed_chunk": False}, "--enable-mixed-chunk is off"),
        ({"chunk_cap": None}, "--chunked-prefill-size"),
        ({"disaggregation_mode": "prefill"}, "--disaggregation-mode prefill"),
    ],
)
def test_a_server_the_policy_cannot_serve_is_refused(facts: dict[str, Any], named: str) -> None:
    good = compat.ServerFacts(
        chunk_cap=CAP, mixed_chunk=True, overlap=False, disaggregation_mode="null", page_size=1
    )
    assert sglang.refusals(SchedulerSettings(), good) == []
    with pytest.raises(ValueError, match="cannot run on this SGLang server") as raised:
        sglang.SLOChunker(SchedulerSettings(), good._replace(**facts))
    assert named in str(raised.value)
    assert "mode=prefill is not supported" in sglang.refusals(SchedulerSettings(mode=Mode.PREFILL), good)[0]


def test_refusal_happens_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--enable-mixed-chunk"):
        sglang.init_hook(None, FakeScheduler(mixed=False))
    monkeypatch.setenv("PD_SCHED_ITL_TARGET_MS", "-5")
    with pytest.raises(ValueError, match="itl_target_ms"):
        sglang.init_hook(None, FakeScheduler())
    with pytest.raises(RuntimeError, match=r"Scheduler\.page_size"):
        scheduler = FakeScheduler()
        del scheduler.page_size
        compat.server_facts(scheduler)


def test_batch_rows() -> None:
    decode = SimpleNamespace(
        forward_mode=FakeMode("decode"), seq_lens_cpu=SimpleNamespace(tolist=lambda: [5, 9])
    )
    assert compat.batch_rows(decode) == [(1, 4), (1, 8)]
    extend = SimpleNamespace(forward_mode=FakeMode("extend"), extend_lens=[16], prefix_lens=[32])
    assert compat.batch_rows(extend) == [(16, 32)]
    assert compat.batch_rows(SimpleNamespace(forward_mode=FakeMode("idle"))) == []


def test_register_follows_the_switch(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    registered: list[tuple[Any, ...]] = []
    monkeypatch.setattr(compat, "hook_scheduler", lambda *hooks: registered.append(hooks))
    monkeypatch.setattr(compat, "startup_problem", lambda: None)
    sglang.register({})
    assert registered == []
    with caplog.at_level(logging.ERROR, logger=sglang.__name__):
        sglang.register({sglang.ENABLE_ENV: "fast"})
    assert registered == [] and "unknown value" in caplog.text
    sglang.register({sglang.ENABLE_ENV: "slo"})
    hooks = (sglang.init_hook, sglang.prefill_hook, sglang.run_hook, sglang.result_hook, sglang.idle_hook)
    assert registered == [hooks]
    monkeypatch.setattr(compat, "startup_problem", lambda: "sglang 9.9 is not supported")
    with caplog.at_level(logging.ERROR, logger=sglang.__name__):
        sglang.register({sglang.ENABLE_ENV: "slo"})
    assert len(registered) == 1 and "sglang 9.9" in caplog.text


@pytest.mark.parametrize(("tpot", "size"), [(None, CAP), ({"tpot_target_ms": 50}, 1 + 432)])
def test_a_tpot_target_limits_the_step_to_what_the_decode_can_afford(
    monkeypatch: pytest.MonkeyPatch, tpot: Any, size: int
) -> None:
    """A decode with a 50 ms TPOT target (``custom_params``), its first token 200 ms ago, 10 gaps behind and
    10 tokens to come at 21 ms each (LAW): the step may take 0.85 x 50 ms x 20 - 200 - 9 x 21 = 461 ms, so
    the chunk is 432 tokens (20 + 1 + 432 ms); with no TPOT target the loose ITL target allows the cap."""
    clock = [0.0]
    monkeypatch.setattr(sglang.time, "monotonic", lambda: clock[0])
    scheduler = FakeScheduler()
    chunker = _started(monkeypatch, scheduler, itl_target_ms="10000", ttft_target_ms="3600000")
    chunker.cost_model = CostModel(LAW)
    stream = FakeReq(list(range(16)), output_ids=[7], sampling_params=_params(tpot, max_new_tokens=21))
    running = SimpleNamespace(reqs=[stream])
    _prefill(scheduler, running)  # its first token is out: its account starts now
    clock[0] = 0.2
    stream.output_ids = [7] * 11
    scheduler.waiting_queue = [FakeReq(list(range(1000)))]
    assert _prefill(scheduler, running) == size


def test_a_decode_of_unknown_length_keeps_no_tpot_account(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted as one token from its end, a decode with no ``max_new_tokens`` would hold the step to 0.85 x
    50 ms (a 16-token chunk); it keeps no account, and the loose ITL target allows the cap."""
    scheduler = FakeScheduler()
    chunker = _started(monkeypatch, scheduler, itl_target_ms="10000", tpot_target_ms="50")
    chunker.cost_model = CostModel(LAW)
    unbounded = FakeReq(list(range(16)), output_ids=[7], sampling_params=_params(max_new_tokens=None))
    scheduler.waiting_queue = [FakeReq(list(range(1000)))]
    assert _prefill(scheduler, SimpleNamespace(reqs=[unbounded])) == CAP


def test_a_target_the_decodes_and_minimum_chunk_exceed_is_called_out(
    monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """As on vLLM (scheduler_plugins.verdict): once the model has measured enough steps, prefill ones among
    them, a step beside decodes whose cheapest form misses the target is called out in the log."""
    scheduler = FakeScheduler()
    chunker = _started(
        monkeypatch, scheduler, itl_target_ms="10", ttft_target_ms="3600000", verdict_after_steps="4"
    )
    chunker.cost_model = CostModel(LAW)
    for _ in range(4):
        chunker.cost_model.observe(step_shape([(16, 0), (1, 10)]), 0.037)
    scheduler.waiting_queue = [FakeReq(list(range(1000)))]
    with caplog.at_level(logging.WARNING, logger=sglang.__name__):
        assert _prefill(scheduler, _running(10)) == 1 + 16  # the minimum chunk, whatever the verdict
    assert (
        "SLO scheduler cannot hold itl_target_ms=10 here: 1 decodes + the minimum 16-token chunk"
        in caplog.text
    )
