"""The worker side of PDConnector driving two real transfer engines (P and D) over the TCP transport.

The forward pass is played by the test: it writes KV into P's tensors and calls the hooks in vLLM's order
(bind -> save_kv_layer per layer; start_load_kv; get_transfer_results each step). P's scheduler finishes a
request in a later step than its last push (``FinishedSend``, with P's first token): then ``Done`` goes out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pd_connector.timeline import RECV_STAGES, SEND_STAGES
from pd_connector.trace import read_trace
from pd_connector.transfer import TransferState
from pd_connector.vllm.compat import kv_layout
from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.metadata import FinishedSend, PDConnectorMetadata, RecvSpec, SendSpec
from pd_connector.vllm.worker_side import WorkerSide
from tests.pd_connector.vllm.worker_pair import BS, LAYERS, NAMES, NUM_BLOCKS, Pair, equal, kv
from tests.polling import wait_until


def test_chunked_prefill_lands_block_for_block(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    p_blocks, d_blocks = [4, 5, 6, 9], [11, 2, 3, 7]
    pair.d_step([RecvSpec("d1", "T", pair.addr, d_blocks, start_block=0, num_tokens=100)])
    for start, end in ((0, 40), (40, 80), (80, 100)):  # chunks end in the middle of blocks
        pair.p_step([SendSpec("p1", "T", p_blocks[: -(-end // BS)], start, end, 100)])
    wait_until(lambda: equal(pair, p_blocks, d_blocks), 10, "the prompt's bytes landed in D")
    pair.poll()
    assert pair.recv == set() and pair.sent == set(), "Done and the report wait for P's scheduler"
    assert pair.d.first_tokens() is None
    pair.p_finish(first_token=4242)
    pair.wait(lambda: "d1" in pair.recv and pair.sent == {"p1"})
    assert pair.failed == set() and equal(pair, p_blocks, d_blocks)
    tokens = pair.d.first_tokens()
    assert tokens is not None and tokens.tokens == {"d1": 4242}, "Done carried P's first token"
    assert pair.d.first_tokens() is None, "reported once"
    stats = pair.p.stats()
    assert stats is not None and stats.data["transfers_sent"] == 1 and stats.data["bytes_sent"] > 0


def test_standard_flow_decode_arrives_after_prefill(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.p_step([SendSpec("p1", "T", [1, 2, 3], 0, 70, 70)], [])
    pair.p_step([], [FinishedSend("p1", ok=True, report=True)])
    pair.d_step([RecvSpec("d1", "T", pair.addr, [8, 9, 10], start_block=0, num_tokens=70)])
    pair.wait(lambda: "d1" in pair.recv and pair.sent == {"p1"})
    assert pair.failed == set() and equal(pair, [1, 2, 3], [8, 9, 10])


def test_local_prefix_hit_loads_only_the_tail(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.d_step([RecvSpec("d1", "T", pair.addr, [0, 1, 12], start_block=2, num_tokens=90)])
    pair.p_step([SendSpec("p1", "T", [3, 4, 5], 0, 90, 90)])
    pair.p_finish()
    pair.wait(lambda: "d1" in pair.recv)
    assert equal(pair, [5], [12])
    assert not any(pair.d_kv[n][[0, 1]].any() for n in NAMES), "blocks D had are not overwritten"


def test_lease_expiry_frees_prefill_blocks(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(p=PDConnectorConfig(lease_s=0.5))
    pair.p_step([SendSpec("p1", "T", [1], 0, 10, 10)])
    pair.p_finish()
    took = pair.wait(lambda: pair.sent == {"p1"})
    assert took > 0.3
    stats = pair.p.stats()
    assert stats is not None and stats.data["expired_leases"] == 1


def test_prefill_abort_fails_the_load_and_frees_p(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.d_step([RecvSpec("d1", "T", pair.addr, [2, 3], start_block=0, num_tokens=64)])
    pair.p_step([SendSpec("p1", "T", [1, 4], 0, 32, 64)])  # first chunk only
    pair.p_step([], [FinishedSend("p1", ok=False, report=True)])
    pair.wait(lambda: "d1" in pair.recv and pair.sent == {"p1"})
    assert pair.failed == {"d1"}


def test_decode_abort_frees_both_sides(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.d_step([RecvSpec("d1", "T", pair.addr, [2, 3], start_block=0, num_tokens=64)])
    pair.p_step([SendSpec("p1", "T", [1, 4], 0, 32, 64)])
    landed = lambda: pair.d._eng.state("T") is TransferState.TRANSFERRING  # noqa: E731
    wait_until(landed, 10, "the first chunk landed in D")
    pair.d_step(aborted=["d1"])
    pair.wait(lambda: "d1" in pair.recv)
    assert pair.failed == set(), "an aborted load is finished, not failed"
    # P's transfer ended (D aborted); later chunks are not fed to it, and the finish releases the blocks.
    pair.p_step([SendSpec("p1", "T", [1, 4], 32, 64, 64)])
    pair.p_step([], [FinishedSend("p1", ok=True, report=True)])
    pair.wait(lambda: pair.sent == {"p1"})


def test_decode_times_out_when_prefill_never_delivers(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(d=PDConnectorConfig(load_timeout_s=0.5, abort_grace_s=0.5))
    start = time.monotonic()
    pair.d_step([RecvSpec("d1", "never-offered", pair.addr, [2], start_block=0, num_tokens=10)])
    pair.wait(lambda: "d1" in pair.recv)
    assert pair.failed == {"d1"} and time.monotonic() - start < 5


def test_unreachable_prefill_fails_fast(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.d_step([RecvSpec("d1", "T", "127.0.0.1:1", [2], start_block=0, num_tokens=10)])
    assert pair.wait(lambda: "d1" in pair.recv, timeout_s=5) < 5
    assert pair.failed == {"d1"}


def test_failed_loads_name_their_blocks_once(make_pair: Callable[..., Pair]) -> None:
    """What vLLM builds that call get_finished learn instead of failed_recving: the blocks the load was to
    write (not those D already had), once."""
    pair = make_pair()
    pair.d_step([RecvSpec("d1", "T", "127.0.0.1:1", [4, 5, 6], start_block=1, num_tokens=90)])
    pair.d_step([RecvSpec("d2", "U", "127.0.0.1:1", [7], start_block=0, num_tokens=10)])
    pair.wait(lambda: {"d1", "d2"} <= pair.recv)
    assert pair.d.take_failed_blocks() == {5, 6, 7}
    assert pair.d.take_failed_blocks() == set()


def test_loads_on_a_worker_without_the_consumer_role_fail_instead_of_raising() -> None:
    """A producer-only worker never raises out of start_load_kv (that killed the engine): the load fails."""
    worker = WorkerSide(PDConnectorConfig(), "p", BS, NUM_BLOCKS, producer=True, consumer=False)
    worker.register_kv_caches(kv(False))
    try:
        worker.start_load_kv(PDConnectorMetadata(recvs=[RecvSpec("d1", "T", "127.0.0.1:1", [2], 0, 10)]))
        assert worker.transfer_results() == (set(), {"d1"}, {"d1"})
        assert worker.take_failed_blocks() == {2}
    finally:
        worker.shutdown()


def test_wrong_secret_is_refused(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(p=PDConnectorConfig(secret="a"), d=PDConnectorConfig(secret="b", load_timeout_s=2))
    pair.p_step([SendSpec("p1", "T", [1], 0, 10, 10)])
    pair.d_step([RecvSpec("d1", "T", pair.addr, [2], start_block=0, num_tokens=10)])
    pair.wait(lambda: "d1" in pair.recv)
    assert pair.failed == {"d1"} and not any(pair.d_kv[n].any() for n in NAMES)


def test_a_secret_read_from_the_environment_authenticates_and_stays_out_of_the_config(
    make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``secret_env`` names the variable that holds the key: a P configured so and a D given the same key
    complete a transfer; the key shows in neither config's repr; naming an unset variable, or setting both
    ``secret`` and ``secret_env``, stops the engine at start naming ``secret_env``."""
    monkeypatch.setenv("PD_TEST_SECRET", "s3cr3t-value")
    p = PDConnectorConfig.from_extra_config({"secret_env": "PD_TEST_SECRET"})
    assert p.secret == "s3cr3t-value" and "s3cr3t-value" not in repr(p)
    assert "s3cr3t-value" not in repr(PDConnectorConfig(secret="s3cr3t-value"))
    pair = make_pair(p=p, d=PDConnectorConfig(secret="s3cr3t-value", load_timeout_s=5))
    pair.d_step([RecvSpec("d1", "T", pair.addr, [2], start_block=0, num_tokens=10)])
    pair.p_step([SendSpec("p1", "T", [1], 0, 10, 10)])
    pair.p_finish()
    pair.wait(lambda: "d1" in pair.recv)
    assert pair.failed == set() and all(pair.d_kv[n][2].any() for n in NAMES)
    with pytest.raises(ValueError, match="secret_env names 'PD_TEST_UNSET'"):
        PDConnectorConfig.from_extra_config({"secret_env": "PD_TEST_UNSET"})
    with pytest.raises(ValueError, match="secret_env is set together with secret"):
        PDConnectorConfig.from_extra_config({"secret_env": "PD_TEST_SECRET", "secret": "x"})


def test_corrupt_flag_zeroes_what_d_receives(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.d_step([RecvSpec("d1", "T", pair.addr, [2], start_block=0, num_tokens=10)])
    pair.p_step([SendSpec("p1", "T", [1], 0, 10, 10, corrupt=True)])
    pair.p_finish()
    pair.wait(lambda: "d1" in pair.recv)
    assert pair.failed == set() and not any(pair.d_kv[n][2].any() for n in NAMES)


def test_layout_check_and_config_validation() -> None:
    with pytest.raises(ValueError, match="is not vLLM's"):
        kv_layout({"l": torch.zeros(2, NUM_BLOCKS, BS, 128)}, NUM_BLOCKS)
    described = kv_layout(kv(False), NUM_BLOCKS)
    layout, buffers = described.layout, described.buffers
    assert described.memory == "host" and not layout.token_major and not layout.kv_split
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_tokens) == (
        LAYERS,
        2,
        64,
        BS,
    )
    assert len(buffers) == LAYERS
    assert PDConnectorConfig.from_extra_config({"lease_s": 3, "side_channel_port": 7000}).lease_s == 3.0
    with pytest.raises(ValueError, match="unknown"):
        PDConnectorConfig.from_extra_config({"lease": 3})
    with pytest.raises(ValueError, match="float"):
        PDConnectorConfig.from_extra_config({"lease_s": "3"})
    with pytest.raises(ValueError, match="positive"):
        PDConnectorConfig.from_extra_config({"load_timeout_s": 0})
    with pytest.raises(ValueError, match="transport"):
        PDConnectorConfig.from_extra_config({"transport": "carrier-pigeon"})
    assert PDConnectorConfig.from_extra_config({"transport": "cma"}).transport_config().kind == "cma"


def test_the_data_listener_port_and_the_port_peers_dial_follow_the_tp_rank() -> None:
    """``data_port`` / ``data_advertise_port`` (a proxy or a NAT in front of D's listener): rank k gets each
    plus k; unset, the listener picks a free port and advertises its own."""
    config = PDConnectorConfig.from_extra_config({"data_port": 7100, "data_advertise_port": 7200})
    tcp = config.transport_config(tp_rank=1).tcp
    assert (tcp.port, tcp.advertise_port) == (7101, 7201)
    tcp = PDConnectorConfig.from_extra_config({}).transport_config(tp_rank=1).tcp
    assert (tcp.port, tcp.advertise_port) == (0, None)
    with pytest.raises(ValueError, match="data_advertise_port"):
        PDConnectorConfig.from_extra_config({"data_advertise_port": 70000})


def test_each_side_traces_its_stages_in_order_under_its_request_id(
    make_pair: Callable[..., Pair], tmp_path: Path
) -> None:
    """Where a P/D request's time went: P and D append one record each to the trace (joined by transfer id,
    each under its own engine's request id) with every stage, and export the spans between them as histograms
    (named in the order the stages happened: here D's table may reach P before or after P's prefill ended)."""
    trace = tmp_path / "trace.jsonl"
    pair = make_pair(
        PDConnectorConfig(lease_s=5, trace_path=str(trace)),
        PDConnectorConfig(load_timeout_s=5, trace_path=str(trace)),
    )
    pair.d_step([RecvSpec("d1", "T", pair.addr, [8, 9, 10], start_block=0, num_tokens=70)])
    pair.p_step([SendSpec("p1", "T", [1, 2, 3], 0, 70, 70)], [])
    pair.p_finish()
    pair.wait(lambda: "d1" in pair.recv and pair.sent == {"p1"})
    records = {r.component: r for r in read_trace(str(trace))}
    assert set(records) == {"prefill", "decode"}
    p, d = records["prefill"], records["decode"]
    assert (p.transfer_id, p.request_id, p.state) == ("T", "p1", "done")
    assert (d.transfer_id, d.request_id, d.state) == ("T", "d1", "done")
    assert set(p.stages) == set(SEND_STAGES) and list(d.stages) == list(RECV_STAGES)
    assert max(p.stages.values()) == p.stages["done"] and min(p.stages.values()) == p.stages["offered"]
    stamps = list(d.stages.values())
    assert stamps == sorted(stamps), d.stages
    assert d.stages["expected"] <= p.stages["destinations"] <= p.stages["done"] <= d.stages["done"]
    assert p.bytes == d.bytes > 0
    p_stats, d_stats = pair.p.stats(), pair.d.stats()
    assert p_stats is not None and d_stats is not None
    p_spans = dict(p_stats.data["stage_s"])
    assert len(p_spans) == 3 and all(s >= 0 for s in p_spans.values())
    assert sum(p_spans.values()) == pytest.approx(p.stages["done"] - p.stages["offered"])
    assert {name for name, _ in d_stats.data["stage_s"]} == {
        "expected->destinations_sent",
        "destinations_sent->first_layer",
        "first_layer->done",
        "done->reported",
    }


def test_an_idle_step_ends_as_soon_as_a_load_finishes(
    make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's engine steps while it waits for KV with nothing to compute: such a step waits for the load to end
    (bounded), not a fixed timer, so the finished load reaches vLLM without a pause after P's Done."""
    monkeypatch.setattr("pd_connector.vllm.worker_side.IDLE_STEP_PAUSE_S", 30.0)
    pair = make_pair()
    idle = PDConnectorMetadata(idle_step=True)
    pair.d_step([RecvSpec("d1", "T", pair.addr, [8, 9, 10], start_block=0, num_tokens=70)])

    def prefill() -> None:
        pair.p_step([SendSpec("p1", "T", [1, 2, 3], 0, 70, 70)])
        pair.p_finish()

    pusher = threading.Timer(0.3, prefill)
    pusher.start()
    start = time.monotonic()
    _, recving, failed = pair.d.transfer_results(idle)
    waited = time.monotonic() - start
    pusher.join()
    assert recving == {"d1"} and failed == set()
    assert 0.2 < waited < 10, f"the idle step took {waited:.2f} s"
