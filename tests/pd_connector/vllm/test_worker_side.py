"""The worker side of PDConnector driving two real transfer engines (P and D) over the TCP transport.

The forward pass is played by the test: it writes KV into P's tensors and calls the hooks in vLLM's order
(bind -> save_kv_layer per layer; start_load_kv; get_transfer_results each step). P's scheduler finishes a
request in a later step than its last push (``FinishedSend``, with P's first token): then ``Done`` goes out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
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
from tests.polling import wait_until

BS = 32
LAYERS = 3
NUM_BLOCKS = 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv(fill: bool) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: [num_blocks, kv_heads, block_size, head_k + head_v]."""
    gen = torch.Generator().manual_seed(1)
    shape = (NUM_BLOCKS, 2, BS, 128)
    return {n: torch.randn(shape, generator=gen) if fill else torch.zeros(shape) for n in NAMES}


class Pair:
    def __init__(
        self,
        p_config: PDConnectorConfig,
        d_config: PDConnectorConfig,
        p_kv: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.p_kv, self.d_kv = p_kv or kv(True), kv(False)
        self.p = WorkerSide(p_config, "p", BS, NUM_BLOCKS, producer=True, consumer=False)
        self.d = WorkerSide(d_config, "d", BS, NUM_BLOCKS, producer=False, consumer=True)
        self.p.register_kv_caches(self.p_kv)
        self.d.register_kv_caches(self.d_kv)
        assert self.p.side_channel_addr is not None
        self.addr = self.p.side_channel_addr
        self.sent: set[str] = set()
        self.recv: set[str] = set()
        self.failed: set[str] = set()

    def p_step(self, sends: list[SendSpec], finished: list[FinishedSend] | None = None) -> None:
        meta = PDConnectorMetadata(sends=sends, finished_sends=finished or [])
        self.p.bind(meta)
        for name in NAMES:
            self.p.save_kv_layer(meta, name, self.p_kv[name])

    def p_finish(self, first_token: int | None = None) -> None:
        """P's scheduler finished request p1 (the step after its last push)."""
        self.p_step([], [FinishedSend("p1", ok=True, report=True, first_token=first_token)])

    def d_step(self, recvs: list[RecvSpec] | None = None, aborted: list[str] | None = None) -> None:
        self.d.start_load_kv(PDConnectorMetadata(recvs=recvs or [], aborted_recvs=aborted or []))

    def poll(self) -> None:
        sending, _, _ = self.p.transfer_results()
        _, recving, failed = self.d.transfer_results()
        self.sent |= sending
        self.recv |= recving
        self.failed |= failed

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 15.0) -> float:
        """Poll both workers (as vLLM does each step) until ``predicate``; the seconds it took."""
        return wait_until(lambda: self.poll() or predicate(), timeout_s, "the pair's transfers")

    def close(self) -> None:
        self.p.shutdown()
        self.d.shutdown()


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    pairs: list[Pair] = []

    def make(
        p: PDConnectorConfig | None = None,
        d: PDConnectorConfig | None = None,
        p_kv: dict[str, torch.Tensor] | None = None,
    ) -> Pair:
        pair = Pair(p or PDConnectorConfig(lease_s=5), d or PDConnectorConfig(load_timeout_s=5), p_kv)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()


def equal(pair: Pair, p_blocks: list[int], d_blocks: list[int]) -> bool:
    return all(torch.equal(pair.p_kv[n][p_blocks], pair.d_kv[n][d_blocks]) for n in NAMES)


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


def test_staged_caches_land_block_for_block_through_host_slots(make_pair: Callable[..., Pair]) -> None:
    """``kv_staging = always`` (default pool: a slot per cache block here): the transport moves host slots, P
    fills its slots per pushed layer and D copies a finished load out of its slots: the path a CUDA cache
    takes with tcp or cma, same code."""
    pair = make_pair(
        p=PDConnectorConfig(lease_s=5, kv_staging="always"),
        d=PDConnectorConfig(load_timeout_s=5, kv_staging="always"),
    )
    p_blocks, d_blocks = [4, 5, 6], [11, 2, 3]
    pair.p_step([SendSpec("p1", "T", p_blocks, 0, 70, 70)], [])
    pair.p_step([], [FinishedSend("p1", ok=True, report=True)])
    pair.d_step([RecvSpec("d1", "T", pair.addr, d_blocks, start_block=0, num_tokens=70)])
    pair.wait(lambda: "d1" in pair.recv and pair.sent == {"p1"})
    assert pair.failed == set() and equal(pair, p_blocks, d_blocks)
    stats = pair.p.stats()
    block_bytes = 2 * BS * 128 * 4  # heads x tokens x (K|V) float32
    assert stats is not None and stats.data["bytes_sent"] == LAYERS * len(p_blocks) * block_bytes


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


def staged(**kw: object) -> tuple[PDConnectorConfig, PDConnectorConfig]:
    """P and D configs staging through a 1 MiB pool: 10 slots of 96 KiB (3 layers of a 32 KiB block each)."""
    common: dict[str, object] = {"kv_staging": "always", "kv_staging_pool_mib": 1, **kw}
    return (
        PDConnectorConfig(**{"lease_s": 5, **common}),  # type: ignore[arg-type]
        PDConnectorConfig(**{"load_timeout_s": 5, **common}),  # type: ignore[arg-type]
    )


def free_slots(worker: WorkerSide) -> int:
    assert worker._staging is not None
    return worker._staging.table.free


# Three requests of 4 blocks (120 tokens) each: 12 blocks, more than the pool's 10 slots on either side.
P_TABLES = {f"p{i}": [4 * i + 3, 4 * i + 2, 4 * i + 1, 4 * i] for i in range(3)}
D_TABLES = {"d0": [15, 5, 12, 3], "d1": [11, 6, 8, 2], "d2": [7, 13, 4, 1]}


@pytest.mark.parametrize("transport", ["tcp", "cma", "ucx"])
def test_staged_transfers_larger_than_the_pool_take_turns_and_land_every_byte(
    make_pair: Callable[..., Pair], transport: str
) -> None:
    """The staged path through every transport with a pool smaller than the transfers in flight (12 blocks,
    10 slots on each side): D queues the third load and P holds the third push back until the first two
    return their slots, then they reuse them; every block lands, nothing fails, every slot comes back."""
    pair = make_pair(*staged(transport=transport))
    assert free_slots(pair.p) == free_slots(pair.d) == 10
    pair.d_step([RecvSpec(f"d{i}", f"T{i}", pair.addr, D_TABLES[f"d{i}"], 0, 120) for i in range(3)])
    assert free_slots(pair.d) == 2, "the third load waits"
    pair.p_step([SendSpec(f"p{i}", f"T{i}", P_TABLES[f"p{i}"], 0, 120, 120) for i in range(3)])
    pair.p_step([], [FinishedSend(f"p{i}", ok=True, report=True, first_token=i) for i in range(3)])
    pair.wait(lambda: len(pair.recv) == 3 and len(pair.sent) == 3)
    assert pair.failed == set()
    for i in range(3):
        assert equal(pair, P_TABLES[f"p{i}"], D_TABLES[f"d{i}"]), f"request {i}"
    assert free_slots(pair.p) == free_slots(pair.d) == 10, "every slot came back"
    stats = pair.p.stats()
    block_bytes = 2 * BS * 128 * 4
    assert stats is not None and stats.data["bytes_sent"] == 3 * LAYERS * 4 * block_bytes
    tokens = pair.d.first_tokens()
    assert tokens is not None and tokens.tokens == {"d0": 0, "d1": 1, "d2": 2}


def test_staging_slots_come_back_when_transfers_fail_abort_or_expire(make_pair: Callable[..., Pair]) -> None:
    """Every end returns a transfer's slots: D's load timeout, D's abort of a started load and of one still
    queued (finished, not failed, never expected), P's lease expiring after a first chunk, P's abort. P takes
    slots only once D's destinations arrived."""
    pair = make_pair(*staged(lease_s=0.5, load_timeout_s=1.0, abort_grace_s=0.5))
    pair.d_step(
        [
            RecvSpec("d0", "never-offered", pair.addr, [1, 2], 0, 64),
            RecvSpec("d1", "aborted-by-d", pair.addr, [3], 0, 10),
            RecvSpec("d3", "lease", pair.addr, [4, 5], 0, 64),
            RecvSpec("d4", "aborted-by-p", pair.addr, [6, 7], 0, 64),
            RecvSpec("d2", "queued", pair.addr, [8, 9, 10, 11, 12], 0, 150),  # 3 slots left: queued
        ]
    )
    assert free_slots(pair.d) == 3
    pair.d_step(aborted=["d1", "d2"])
    pair.p_step(
        [SendSpec("p3", "lease", [1, 2], 0, 32, 64), SendSpec("p4", "aborted-by-p", [3, 4], 0, 32, 64)]
    )
    pair.wait(lambda: free_slots(pair.p) == 6, timeout_s=5)  # both took their slots once D's tables came
    pair.p_step([], [FinishedSend("p4", ok=False, report=True)])
    pair.wait(lambda: pair.p._pushes["p3"].ended is not None)  # the lease expired
    pair.p_step([], [FinishedSend("p3", ok=True, report=True)])
    pair.wait(lambda: pair.recv == {"d0", "d1", "d2", "d3", "d4"} and pair.sent == {"p3", "p4"})
    assert pair.failed == {"d0", "d3", "d4"}, "D's aborts are finished, not failed"
    assert free_slots(pair.p) == free_slots(pair.d) == 10


def test_a_load_without_slots_fails_clearly_and_falls_back(make_pair: Callable[..., Pair]) -> None:
    """Back-pressure on D is bounded: a load that gets no slots within ``kv_staging_wait_s`` fails (its
    request then falls back as other failed loads do), one needing more slots than the pool has fails at once;
    neither waits forever nor is dropped silently."""
    pair = make_pair(*staged(kv_staging_wait_s=0.3))
    pair.d_step([RecvSpec("d0", "holder", pair.addr, list(range(9)), 0, 280)])  # holds 9 of D's 10 slots
    pair.d_step([RecvSpec("d1", "waits", pair.addr, [9, 10], 0, 40)])
    pair.d_step([RecvSpec("d2", "too-big", pair.addr, list(range(11)), 0, 350)])
    pair.wait(lambda: {"d1", "d2"} <= pair.recv)
    assert pair.failed == {"d1", "d2"} and pair.d.take_failed_blocks() == set(range(11))
    pair.d_step(aborted=["d0"])
    pair.wait(lambda: "d0" in pair.recv)
    assert free_slots(pair.d) == 10


def test_a_push_without_slots_is_aborted_and_its_load_falls_back(make_pair: Callable[..., Pair]) -> None:
    """Back-pressure on P is bounded the same way: a push whose D is ready but that gets no slots within
    ``kv_staging_wait_s`` is aborted (D's load fails and falls back), one needing more slots than the pool has
    at once; the push holding slots goes through and every slot comes back."""
    p_config, _ = staged(kv_staging_wait_s=0.3)
    _, d_config = staged(kv_staging_pool_mib=2)  # 16 slots (one per cache block): room for both loads
    pair = make_pair(p_config, d_config)
    tables = {"holder": list(range(9)), "held": [9, 10], "huge": list(range(11))}
    tokens = {"holder": 280, "held": 40, "huge": 350}
    pair.d_step([RecvSpec(f"d-{t}", t, pair.addr, b, 0, tokens[t]) for t, b in tables.items() if t != "huge"])
    pair.p_step([SendSpec("p-holder", "holder", tables["holder"], 0, 280, 280)])
    pair.wait(lambda: free_slots(pair.p) == 1, timeout_s=5)
    pair.p_step([SendSpec(f"p-{t}", t, tables[t], 0, tokens[t], tokens[t]) for t in ("held", "huge")])
    pair.wait(lambda: "d-held" in pair.recv)
    assert pair.failed == {"d-held"}
    pair.p_step([], [FinishedSend(f"p-{t}", ok=True, report=True) for t in tables])
    pair.wait(lambda: len(pair.sent) == 3 and "d-holder" in pair.recv)
    assert pair.failed == {"d-held"} and equal(pair, tables["holder"], tables["holder"])
    stats = pair.p.stats()
    assert stats is not None and stats.data["transfers_sent"] == 1
    assert free_slots(pair.p) == 10 and free_slots(pair.d) == 16


@pytest.mark.parametrize("staging", ["auto", "always"])
def test_kernel_blocks_smaller_than_manager_blocks_land_token_for_token(
    make_pair: Callable[..., Pair], staging: str
) -> None:
    """P's attention backend uses kernel blocks of half the KV manager's (its cache is 2 x NUM_BLOCKS blocks
    of BS / 2 tokens, manager block b being kernel blocks 2b and 2b + 1, as vLLM splits them); D's cache is in
    manager blocks. Every token lands where D's manager block table puts it, direct and staged."""
    gen = torch.Generator().manual_seed(5)
    p_kv = {n: torch.randn((2 * NUM_BLOCKS, 2, BS // 2, 128), generator=gen) for n in NAMES}
    pair = make_pair(
        PDConnectorConfig(lease_s=5, kv_staging=staging),  # type: ignore[arg-type]
        PDConnectorConfig(load_timeout_s=5, kv_staging=staging),  # type: ignore[arg-type]
        p_kv,
    )
    p_blocks, d_blocks = [6, 1, 3], [11, 2, 9]
    pair.d_step([RecvSpec("d1", "T", pair.addr, d_blocks, start_block=0, num_tokens=70)])
    for start, end in (
        (0, 40),
        (40, 70),
    ):  # the first chunk ends inside a manager block's second kernel block
        pair.p_step([SendSpec("p1", "T", p_blocks[: -(-end // BS)], start, end, 70)])
    pair.p_finish()
    pair.wait(lambda: "d1" in pair.recv and pair.sent == {"p1"})
    assert pair.failed == set()
    for name in NAMES:  # [heads, tokens, C] of the request's 70 tokens on each side
        manager = (
            p_kv[name].unflatten(0, (NUM_BLOCKS, 2)).transpose(1, 2).flatten(2, 3)
        )  # [blocks, heads, BS, C]
        sent = manager[p_blocks].transpose(0, 1).flatten(1, 2)[:, :70]
        landed = pair.d_kv[name][d_blocks].transpose(0, 1).flatten(1, 2)[:, :70]
        assert torch.equal(sent, landed), name


def test_kernel_blocks_that_are_not_a_plain_split_are_refused_naming_both_sizes() -> None:
    """Kernel blocks vLLM lays out another way (a packed cache's, other layers' pages between them): refused at
    registration, naming the kernel and the manager block sizes and the way out."""
    cache = {"l": torch.zeros(2 * NUM_BLOCKS + 1, 2, BS // 2, 128)}
    with pytest.raises(
        ValueError,
        match=f"kernel blocks of {BS // 2} tokens, KV manager blocks hold {BS}.*--block-size {BS // 2}",
    ):
        kv_layout(cache, NUM_BLOCKS, block_size=BS)
    assert (
        kv_layout(
            {"l": torch.zeros(2 * NUM_BLOCKS, 2, BS // 2, 128)}, NUM_BLOCKS, block_size=BS
        ).layout.block_tokens
        == BS // 2
    )
