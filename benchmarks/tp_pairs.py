"""KV-shaped transfers across tensor parallelism: one prompt from P's TP ranks into D's, for P/D TP pairs.

Called by ``benchmarks.transport`` (``measure``; its JSON line gets the ``tp_pairs`` key and ``tp_*`` ratios)
and run as its own processes: ``--pair P,D`` is one round of one pair (it starts D's ranks as ``--serve D,RANK``
receivers, builds P's ranks, times ``--samples`` transfers and prints ``RESULT <json>``).

The prompt is ``kv_shapes``' 4096 tokens in fragmented 16-token blocks, over the whole cache of a
Llama-3-8B-like model: 8 KV heads x 128 dims x bf16, 32 layers, K and V in separate regions, heads-major
blocks (``[heads, tokens, dim]``, vLLM's HND layout: a head's part of a block is contiguous, which is what lets
different TP sizes exchange head ranges). Each rank holds its share of the heads (``layout.rank_heads``), and
the copies are what the connector issues: ``layout.head_plan`` says which P rank sends which heads to which D
rank, ``block_mapping.BlockMapping`` turns that into coalesced runs, and each P rank posts one write per layer per D
rank it feeds, all layers in flight, then waits. Bytes are the model's KV of the prompt, each head once.

On this machine all P ranks share one process (one transport each) and its two cores; on real hardware each
rank has its own. The figures compare pairs with each other and with ``1,1``, not with a GPU cluster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks.helper_process import Helper, wait_for_exit
from benchmarks.kv_shapes import (
    BLOCK_TOKENS,
    KV_DST,
    KV_SRC,
    POOL_BLOCKS,
    PROMPT_TOKENS,
    huge_pages,
    small_pages,
)
from pd_connector.block_mapping import BlockMapping
from pd_connector.layout import KVLayout, head_plan, rank_heads
from pd_connector.transport.base import BlockCopy, Transport
from pd_connector.transport.cma import CmaConfig
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.ucx import UcxConfig

MODEL_KV_HEADS, HEAD_DIM, LAYERS = 8, 128, 32
#: (P TP, D TP): same TP, P larger (several P ranks write disjoint heads of one D block), P smaller (one P rank's
#: heads split over D ranks), and DESIGN.md's deployments (P at TP 8, D at TP 1-2).
PAIRS = [(1, 1), (2, 2), (2, 1), (1, 2), (4, 1), (8, 1), (8, 2)]


def rank_layout(tp: int, rank: int) -> KVLayout:
    return KVLayout(
        num_layers=LAYERS,
        block_tokens=BLOCK_TOKENS,
        num_kv_heads=len(rank_heads(tp, rank, MODEL_KV_HEADS)),
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        kv_split=True,
        token_major=False,
        tp_size=tp,
        tp_rank=rank,
        total_kv_heads=MODEL_KV_HEADS,
    )


def plan_copies(p_tp: int, d_tp: int) -> dict[tuple[int, int], list[list[BlockCopy]]]:
    """Per (P rank, D rank) that exchange heads, the copies of each layer (K and V), as the connector plans
    them for the prompt's block tables."""
    out: dict[tuple[int, int], list[list[BlockCopy]]] = {}
    for d in range(d_tp):
        decode = rank_layout(d_tp, d)
        for part in head_plan(p_tp, decode):
            mapping = BlockMapping(rank_layout(p_tp, part.prefill_rank), decode)
            runs = mapping.runs(KV_SRC, KV_DST, 0, PROMPT_TOKENS, part)
            out[part.prefill_rank, d] = [mapping.layer_copies(layer, runs) for layer in range(LAYERS)]
    return out


def block_runs() -> int:
    """Maximal runs of the prompt's blocks that are consecutive on both P and D (what whole blocks coalesce to)."""
    return 1 + sum(
        not (KV_SRC[i + 1] == KV_SRC[i] + 1 and KV_DST[i + 1] == KV_DST[i] + 1)
        for i in range(len(KV_SRC) - 1)
    )


@dataclass(frozen=True)
class Operations:
    """Transfer operations per layer for one pair, and its bounds (see ``operations``)."""

    ops_per_layer: int
    ops_bound: int
    per_token_head_ops: int
    parts: int  # (P rank, D rank) pairs that exchange heads


def operations(p_tp: int, d_tp: int) -> Operations:
    """Transfer operations per layer for the pair, against two bounds.

    ``ops_bound``: contiguous runs — per (P rank, D rank) and buffer, one per run of consecutive blocks when the
    pair exchanges whole blocks (same heads on both sides), else one per block (a head range of a block is one
    run); ``per_token_head_ops``: what slicing per token and head would issue (the layout SGLang once had).
    """
    copies = plan_copies(p_tp, d_tp)
    bound = 0
    for d in range(d_tp):
        decode = rank_layout(d_tp, d)
        for part in head_plan(p_tp, decode):
            whole = part.num_heads == decode.num_kv_heads == rank_layout(p_tp, part.prefill_rank).num_kv_heads
            bound += 2 * (block_runs() if whole else len(KV_SRC))
    return Operations(
        ops_per_layer=sum(len(layers[0]) for layers in copies.values()),
        ops_bound=bound,
        per_token_head_ops=2 * PROMPT_TOKENS * MODEL_KV_HEADS,
        parts=len(copies),
    )


def prompt_bytes() -> int:
    """The model's KV of the prompt, each head once (what every pair moves)."""
    return 2 * LAYERS * PROMPT_TOKENS * MODEL_KV_HEADS * HEAD_DIM * 2


class RankMemory:
    """One rank's KV cache: 64 regions (K and V of 32 layers) of ``POOL_BLOCKS`` blocks, registered in head
    granules."""

    def __init__(self, layout: KVLayout, kind: str, huge: bool, fill: bool) -> None:
        pages = huge_pages if huge else small_pages
        regions = LAYERS * layout.buffers_per_layer
        self.cache = pages(regions * POOL_BLOCKS * layout.block_bytes).reshape(regions, -1)
        if fill:
            self.cache.fill(1)  # fault every page in before the clock starts
        self.transport: Transport = create_transport(
            TransportConfig(kind=kind, ucx=UcxConfig(huge_pages=huge), cma=CmaConfig(huge_pages=huge))  # type: ignore[arg-type]
        )
        self.descriptor = self.transport.register(
            layout.regions([(r.ctypes.data, r.nbytes) for r in self.cache])
        )


def serve(d_tp: int, rank: int, kind: str, huge: bool) -> None:
    """A D rank: register its cache, print ``READY <hex>``, wait for ``exit`` on stdin."""
    memory = RankMemory(rank_layout(d_tp, rank), kind, huge, fill=False)
    print("READY", memory.descriptor.hex(), flush=True)
    wait_for_exit()
    memory.transport.close()


def run_pair(p_tp: int, d_tp: int, samples: int, kind: str, huge: bool) -> list[float]:
    """One round of one pair: D's ranks in their own processes, P's ranks here; ``samples`` timed transfers."""
    flags = ["--transport", kind] + ([] if huge else ["--no-huge-pages"])
    receivers: list[Helper] = []
    senders: list[RankMemory] = []
    try:
        for rank in range(d_tp):
            argv = [sys.executable, "-m", "benchmarks.tp_pairs", "--serve", f"{d_tp},{rank}", *flags]
            receivers.append(Helper(argv, f"D rank {rank}"))
        descriptors = [r.descriptor for r in receivers]
        copies = plan_copies(p_tp, d_tp)
        senders = [RankMemory(rank_layout(p_tp, r), kind, huge, fill=True) for r in range(p_tp)]
        for p, d in copies:
            senders[p].transport.attach(f"D{d}", descriptors[d]).result(30)

        def transfer() -> float:
            start = time.perf_counter()
            posted: list[Future[int]] = [
                senders[p].transport.write(f"D{d}", layer)
                for layer_index in range(LAYERS)
                for (p, d), layers in copies.items()
                for layer in [layers[layer_index]]
            ]
            moved = sum(f.result(120) for f in posted)
            if moved != prompt_bytes():
                raise RuntimeError(f"{p_tp}->{d_tp} moved {moved} bytes, the prompt's KV is {prompt_bytes()}")
            return time.perf_counter() - start

        transfer()  # warm-up: connections, registration caches, page faults on D
        return [transfer() for _ in range(samples)]
    finally:
        for sender in senders:
            sender.transport.close()
        for helper in receivers:
            helper.stop()


@dataclass(frozen=True)
class PairResult(Operations):
    """One pair's median GB/s over every sample of every round, with its operations."""

    gbps: float


def measure(
    pairs: list[tuple[int, int]], reps: int, samples: int, kind: str, huge: bool, log: Callable[[str], None]
) -> dict[str, PairResult]:
    """Every pair, ``reps`` rounds in shuffled order (a fresh process per pair and round); keyed ``"P->D"``.
    ``log`` reports progress (the caller's stderr)."""
    seconds: dict[tuple[int, int], list[float]] = {pair: [] for pair in pairs}
    order = np.random.default_rng(1)
    for rep in range(reps):
        for index in order.permutation(len(pairs)).tolist():
            p_tp, d_tp = pairs[index]
            flags = ["--samples", str(samples), "--transport", kind] + ([] if huge else ["--no-huge-pages"])
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.tp_pairs", "--pair", f"{p_tp},{d_tp}", *flags],
                stdout=subprocess.PIPE, text=True, check=True, timeout=600,
            ).stdout  # fmt: skip
            seconds[p_tp, d_tp] += json.loads(out.rsplit("RESULT ", 1)[1])
        log(f"tp pairs: round {rep + 1}/{reps} done")
    return {
        f"{p}->{d}": PairResult(
            **asdict(operations(p, d)), gbps=round(prompt_bytes() / statistics.median(seconds[p, d]) / 1e9, 3)
        )
        for p, d in pairs
    }


def ratios(results: dict[str, PairResult]) -> dict[str, float | bool]:
    """``tp_P->D_vs_1->1``: each pair's GB/s against same-TP 1->1 in the same run; ``tp_ops_within_bound``."""
    out: dict[str, float | bool] = {}
    if "1->1" in results:
        for name, result in results.items():
            if name != "1->1":
                out[f"tp_{name}_vs_1->1"] = round(result.gbps / results["1->1"].gbps, 3)
    out["tp_ops_within_bound"] = all(r.ops_per_layer <= r.ops_bound for r in results.values())
    return out


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"2,1;1,2"`` -> ``[(2, 1), (1, 2)]``; an empty string: no pairs."""
    pairs = []
    for item in filter(None, text.split(";")):
        p, d = (int(x) for x in item.split(","))
        pairs.append((p, d))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", help="P_TP,D_TP: one round of one pair; last line RESULT <json>")
    parser.add_argument("--serve", help="D_TP,RANK: a D rank's receiver (started by --pair)")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--transport", default="cma", choices=["cma", "ucx", "tcp"])
    parser.add_argument("--no-huge-pages", action="store_true")
    args = parser.parse_args()
    huge = not args.no_huge_pages
    if args.serve:
        d_tp, rank = (int(x) for x in args.serve.split(","))
        serve(d_tp, rank, args.transport, huge)
    elif args.pair:
        ((p_tp, d_tp),) = parse_pairs(args.pair)
        print("RESULT", json.dumps(run_pair(p_tp, d_tp, args.samples, args.transport, huge)), flush=True)
    else:
        parser.error("run through `python -m benchmarks.transport` (or give --pair / --serve)")


if __name__ == "__main__":
    main()
