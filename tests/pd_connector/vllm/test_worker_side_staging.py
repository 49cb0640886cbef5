"""The vLLM worker side's staged path: KV through a bounded pool of host slots (``kv_staging``), and caches
in kernel blocks smaller than the KV manager's, on two real transfer engines (see ``worker_pair``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pd_connector.vllm.compat import kv_layout
from pd_connector.vllm.config import PDConnectorConfig
from pd_connector.vllm.metadata import FinishedSend, RecvSpec, SendSpec
from pd_connector.vllm.worker_side import WorkerSide
from tests.pd_connector.vllm.worker_pair import BS, LAYERS, NAMES, NUM_BLOCKS, Pair, equal


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


def staged(**kw: object) -> tuple[PDConnectorConfig, PDConnectorConfig]:
    """P and D configs staging through a 1 MiB pool: 10 slots of 96 KiB (3 layers of a 32 KiB block each)."""
    common: dict[str, object] = {"kv_staging": "always", "kv_staging_pool_mib": 1, **kw}
    return (
        PDConnectorConfig(**{"lease_s": 5, **common}),  # type: ignore[arg-type]
        PDConnectorConfig(**{"load_timeout_s": 5, **common}),  # type: ignore[arg-type]
    )


def free_slots(worker: WorkerSide) -> int:
    assert worker._tables.pool is not None
    return worker._tables.pool.table.free


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
    pair.wait(
        lambda: (push := pair.p._p.push("p3")) is not None and push.ended is not None
    )  # the lease expired
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
