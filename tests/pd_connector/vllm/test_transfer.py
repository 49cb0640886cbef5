"""P's PushServer and D's KVLoader over real loopback TCP, in one process, with real KV-shaped tensors.

The same objects run inside vLLM's workers (see integration_tests/test_pd_connector.py); here the forward
pass is played by the test: it writes blocks, then calls offer/push_layer/finish_prompt like the hooks do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.kv_layout import KVLayers, contiguous_runs
from pd_connector.vllm.metadata import RecvSpec, SendSpec
from pd_connector.vllm.receiver import KVLoader, parse_addr
from pd_connector.vllm.sender import PushServer
from pd_connector.vllm.stats import StatsRecorder

pytestmark = pytest.mark.unit

BS = 32
LAYERS = 3
NUM_BLOCKS = 16


def kv(seed: int | None, head: int = 128) -> dict[str, torch.Tensor]:
    """CPU layout: [num_blocks, kv_heads, block_size, head_k + head_v]; zeros when ``seed`` is None."""
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (NUM_BLOCKS, 2, BS, head)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.zeros(shape) if seed is None else torch.randn(shape, generator=gen)
        )
        for i in range(LAYERS)
    }


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


class Pair:
    """A P side (server over ``p_kv``) and a D side (loader into ``d_kv``)."""

    def __init__(self, p_config: PDConnectorConfig, d_config: PDConnectorConfig, d_head: int = 128) -> None:
        self.p_kv, self.d_kv = kv(1), kv(None, d_head)
        self.p_stats, self.d_stats = StatsRecorder(), StatsRecorder()
        self.server = PushServer(p_config, KVLayers(self.p_kv, NUM_BLOCKS), BS, self.p_stats)
        self.loader = KVLoader(d_config, KVLayers(self.d_kv, NUM_BLOCKS), BS, self.d_stats)
        self.addr = f"127.0.0.1:{self.server.port}"
        self.finished: set[str] = set()
        self.failed: set[str] = set()

    def prefill(self, spec: SendSpec) -> None:
        """One engine step of P: register, 'compute' every layer and push it, then end the step."""
        self.server.offer(spec)
        for layer in range(LAYERS):
            self.server.push_layer(spec, layer)
        if spec.completes_prompt:
            self.server.finish_prompt(spec)

    def load_done(self, req_id: str) -> bool:
        finished, failed = self.loader.poll()
        self.finished |= finished
        self.failed |= failed
        return req_id in self.finished

    def close(self) -> None:
        self.server.close()
        self.loader.close()


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    pairs: list[Pair] = []

    def make(p: PDConnectorConfig | None = None, d: PDConnectorConfig | None = None, d_head: int = 128) -> Pair:
        pair = Pair(p or PDConnectorConfig(lease_s=5), d or PDConnectorConfig(load_timeout_s=5), d_head)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()


def assert_blocks_equal(pair: Pair, p_blocks: list[int], d_blocks: list[int]) -> None:
    for name in pair.p_kv:
        assert torch.equal(pair.p_kv[name][p_blocks], pair.d_kv[name][d_blocks]), name


def test_chunked_prefill_arrives_block_for_block(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    p_blocks, d_blocks = [4, 5, 6, 9], [11, 2, 3, 7]
    pair.loader.start(RecvSpec("d1", "T", pair.addr, d_blocks, start_block=0, num_tokens=100))
    for start, end in ((0, 40), (40, 80), (80, 100)):  # chunks split blocks in the middle
        pair.prefill(SendSpec("p1", "T", p_blocks, start, end, 100))
    wait_for(lambda: pair.load_done("d1"))
    assert pair.failed == set()
    assert_blocks_equal(pair, p_blocks, d_blocks)
    pair.server.request_finished("p1", ok=True, report=True)
    wait_for(lambda: pair.server.poll_released() == {"p1"})
    sent = pair.p_stats.drain()
    assert sent is not None and sent.data["transfers_sent"] == 1
    assert sent.data["bytes_sent"] >= 4 * LAYERS * pair.server._layers.block_bytes


def test_decode_connecting_after_prefill_gets_everything(make_pair: Callable[..., Pair]) -> None:
    """vLLM's standard flow: P finished long before D asks."""
    pair = make_pair()
    pair.prefill(SendSpec("p1", "T", [1, 2, 3], 0, 70, 70))
    pair.server.request_finished("p1", ok=True, report=True)
    assert pair.server.poll_released() == set(), "held for D until ack or lease"
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [8, 9, 10], start_block=0, num_tokens=70))
    wait_for(lambda: pair.load_done("d1"))
    assert_blocks_equal(pair, [1, 2, 3], [8, 9, 10])
    wait_for(lambda: pair.server.poll_released() == {"p1"})


def test_local_prefix_hit_loads_only_the_tail(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [0, 1, 12], start_block=2, num_tokens=90))
    pair.prefill(SendSpec("p1", "T", [3, 4, 5], 0, 90, 90))
    wait_for(lambda: pair.load_done("d1"))
    assert_blocks_equal(pair, [5], [12])
    for name in pair.d_kv:
        assert not pair.d_kv[name][[0, 1]].any(), "blocks D already had are not overwritten"


def test_prefix_cached_blocks_on_prefill_are_pushed_too(make_pair: Callable[..., Pair]) -> None:
    """P's first step starts at token 64 (its own prefix cache): blocks 0-1 are pushed from the cache."""
    pair = make_pair()
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [7, 8, 9], start_block=0, num_tokens=80))
    pair.prefill(SendSpec("p1", "T", [1, 2, 3], 64, 80, 80))
    wait_for(lambda: pair.load_done("d1"))
    assert_blocks_equal(pair, [1, 2, 3], [7, 8, 9])


def test_lease_expiry_releases_blocks_of_an_absent_decode(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(p=PDConnectorConfig(lease_s=0.3))
    pair.prefill(SendSpec("p1", "T", [1], 0, 10, 10))
    pair.server.request_finished("p1", ok=True, report=True)
    assert pair.server.poll_released() == set()
    wait_for(lambda: pair.server.poll_released() == {"p1"})
    stats = pair.p_stats.drain()
    assert stats is not None and stats.data["expired_leases"] == 1
    # A D arriving after the lease is told at once, not after its timeout.
    start = time.monotonic()
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [2], start_block=0, num_tokens=10))
    wait_for(lambda: pair.load_done("d1"))
    assert pair.failed == {"d1"} and time.monotonic() - start < 2


def test_prefill_abort_fails_the_load_and_frees_p(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [2, 3], start_block=0, num_tokens=64))
    pair.prefill(SendSpec("p1", "T", [1, 4], 0, 32, 64))  # first chunk only
    pair.server.request_finished("p1", ok=False, report=True)
    wait_for(lambda: pair.load_done("d1"))
    assert pair.failed == {"d1"}
    wait_for(lambda: pair.server.poll_released() == {"p1"})


def test_decode_abort_frees_both_sides(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [2, 3], start_block=0, num_tokens=64))
    pair.prefill(SendSpec("p1", "T", [1, 4], 0, 32, 64))
    wait_for(lambda: pair.server._by_req["p1"].connected)
    pair.loader.abort("d1")
    wait_for(lambda: pair.load_done("d1"))
    assert pair.failed == set(), "an aborted load is finished, not failed"
    pair.server.request_finished("p1", ok=True, report=True)
    wait_for(lambda: pair.server.poll_released() == {"p1"}, timeout_s=3)


def test_decode_times_out_when_prefill_never_delivers(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(d=PDConnectorConfig(load_timeout_s=0.5))
    start = time.monotonic()
    pair.loader.start(RecvSpec("d1", "unknown", pair.addr, [2], start_block=0, num_tokens=10))
    wait_for(lambda: pair.load_done("d1"))
    assert pair.failed == {"d1"}
    assert 0.4 < time.monotonic() - start < 3


def test_dead_prefill_fails_fast(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.server.close()
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [2], start_block=0, num_tokens=10))
    wait_for(lambda: pair.load_done("d1"), timeout_s=3)
    assert pair.failed == {"d1"}


@pytest.mark.parametrize(
    ("p_config", "d_config", "d_head"),
    [
        (PDConnectorConfig(secret="s3cret"), PDConnectorConfig(secret="wrong"), 128),
        (PDConnectorConfig(), PDConnectorConfig(), 64),  # layout mismatch: different head size
    ],
)
def test_refused_handshakes(
    make_pair: Callable[..., Pair], p_config: PDConnectorConfig, d_config: PDConnectorConfig, d_head: int
) -> None:
    pair = make_pair(p=p_config, d=d_config, d_head=d_head)
    pair.prefill(SendSpec("p1", "T", [1], 0, 10, 10))
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [2], start_block=0, num_tokens=10))
    wait_for(lambda: pair.load_done("d1"), timeout_s=3)
    assert pair.failed == {"d1"}
    for name in pair.d_kv:
        assert not pair.d_kv[name].any()


def test_secret_shared_by_both_sides_works(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(p=PDConnectorConfig(secret="s3cret"), d=PDConnectorConfig(secret="s3cret"))
    pair.prefill(SendSpec("p1", "T", [1], 0, 10, 10))
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [2], start_block=0, num_tokens=10))
    wait_for(lambda: pair.load_done("d1"))
    assert pair.failed == set()
    assert_blocks_equal(pair, [1], [2])


def test_corrupt_flag_sends_zeros(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.loader.start(RecvSpec("d1", "T", pair.addr, [2], start_block=0, num_tokens=10))
    pair.prefill(SendSpec("p1", "T", [1], 0, 10, 10, corrupt=True))
    wait_for(lambda: pair.load_done("d1"))
    for name in pair.d_kv:
        assert pair.p_kv[name][1].any() and not pair.d_kv[name][2].any()


def test_helpers() -> None:
    assert contiguous_runs([0, 1, 2, 3], [5, 6, 9, 10]) == [(5, 2), (9, 2)]
    assert contiguous_runs([2], [5, 6, 9]) == [(9, 1)]
    assert parse_addr("10.1.2.3:80") == ("10.1.2.3", 80)
    assert parse_addr("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError):
        parse_addr("nohost")
    with pytest.raises(ValueError, match="block-major"):
        KVLayers({"l": torch.zeros(2, NUM_BLOCKS, 4)}, NUM_BLOCKS)


def test_config_rejects_unknown_keys_and_wrong_types() -> None:
    assert PDConnectorConfig.from_extra_config({"lease_s": 3, "side_channel_port": 7000}).lease_s == 3.0
    with pytest.raises(ValueError, match="unknown"):
        PDConnectorConfig.from_extra_config({"lease": 3})
    with pytest.raises(ValueError, match="number"):
        PDConnectorConfig.from_extra_config({"lease_s": "3"})
    with pytest.raises(ValueError, match="> 0"):
        PDConnectorConfig.from_extra_config({"load_timeout_s": 0})
    with pytest.raises(ValueError, match="transport"):
        PDConnectorConfig.from_extra_config({"transport": "carrier-pigeon"})
