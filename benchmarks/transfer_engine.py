"""What the transfer engine costs on top of its data plane: a KV-shaped prompt and a tiny one, two processes.

For each data path (UCX shared memory, our TCP fallback) a receiver process (``--serve``) owns the decode
side's memory, either as a bare transport (``raw``: the ceiling) or inside a ``TransferEngine`` (``engine``).
This process is the prefill side. Per repetition it moves one prompt:
- raw: ``attach`` once, then one ``write`` per layer, all posted back to back, timed until every future
  resolved (the data is in the peer's memory), watched by the same polling loop as the engine's ``poll()``;
- engine: the peer ``expect``s, this side ``offer``s, ``push_layer``s every layer and ``finish``es, timed
  from the first push until the prefill side's result is DONE (every write landed and ``Done`` sent: P
  waits for no acknowledgement in the push model), i.e. the writes plus what the engine adds on P's side.

KV shape: 32 layers, K and V split, 4 KV heads x 128 x bf16, 16-token blocks (16 KiB per block and region),
a 4096-token prompt (256 blocks per region, 256 MiB in all) scattered over a 384-block pool on both sides;
the tiny prompt is one block per region. Medians of ``--reps``; progress on stderr; the last stdout line
is the JSON summary (docs/performance.md ``## pd_connector transfer engine``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

import msgspec
import numpy as np

from benchmarks.helper_process import Helper, wait_for_exit
from pd_connector.block_mapping import BlockMapping
from pd_connector.layout import KVLayout
from pd_connector.transfer import TransferConfig, TransferEngine, TransferState
from pd_connector.transport.base import Transport
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.ucx import UcxConfig

LAYOUT = KVLayout(
    num_layers=32,
    block_tokens=16,
    num_kv_heads=4,
    head_dim=128,
    dtype="bfloat16",
    kv_split=True,
    token_major=True,
)
POOL_BLOCKS, PROMPT_TOKENS = 384, 4096
PATHS = {"ucx_sm": ("ucx", "sm,self"), "tcp": ("tcp", "")}
CLEAN_ENV = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_transport(kind: str, tls: str) -> Transport:
    options = {"RNDV_SCHEME": "put_zcopy"}
    return create_transport(TransportConfig(kind=kind, ucx=UcxConfig(tls=tls, options=options)))  # type: ignore[arg-type]


def buffers(seed: int | None) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    n = LAYOUT.num_layers * LAYOUT.buffers_per_layer
    size = POOL_BLOCKS * LAYOUT.block_bytes
    rng = np.random.default_rng(seed)
    arrays = [
        np.zeros(size, np.uint8) if seed is None else rng.integers(0, 256, size, np.uint8) for _ in range(n)
    ]
    return arrays, [(a.ctypes.data, a.nbytes) for a in arrays]


def scattered(rng: np.random.Generator, count: int) -> list[int]:
    """Block ids as an allocator leaves them: runs of mean length 8 from a shuffled pool."""
    runs = [list(range(i, min(i + 8, POOL_BLOCKS))) for i in range(0, POOL_BLOCKS, 8)]
    rng.shuffle(runs)
    return [b for run in runs for b in run][:count]


def serve(mode: str, kind: str, tls: str, integrity: bool = False) -> None:
    """Receiver process: print READY + descriptor/address, then obey ``expect`` lines, print RESULT.
    ``integrity``: the decode engine runs with ``integrity_check`` (verifies P's checksums before DONE)."""
    _arrays, bufs = buffers(None)
    transport = make_transport(kind, tls)
    if mode == "raw":
        print("READY", transport.register(LAYOUT.regions(bufs)).hex(), flush=True)
        wait_for_exit()
        transport.close()
        return
    config = TransferConfig(
        engine_id=f"bench-d-{uuid.uuid4().hex[:6]}", load_timeout_s=120, integrity_check=integrity
    )
    engine = TransferEngine(config, LAYOUT, bufs, transport)
    print("READY -", flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        cmd = msgspec.json.decode(line)
        engine.expect(cmd["id"], cmd["addr"], cmd["dst"], cmd["tokens"])
        while not (results := engine.poll()):
            time.sleep(0.0005)
        print("RESULT", results[0].state.value, flush=True)
    engine.close()


def receiver(mode: str, kind: str, tls: str, integrity: bool = False) -> Helper:
    """The decode side's process (``serve``), once it printed READY."""
    argv = [sys.executable, "-m", "benchmarks.transfer_engine", "--serve", mode, "--kind", kind, "--tls", tls]
    argv += ["--integrity"] if integrity else []
    return Helper(argv, f"{mode} receiver", env=CLEAN_ENV)


Map = tuple[list[int], list[int], int]  # (P blocks, D blocks, tokens)


class RawSide:
    """The ceiling: our transport alone, writes posted back to back and polled like the engine's results."""

    def __init__(self, kind: str, tls: str) -> None:
        self.receiver = receiver("raw", kind, tls)
        self.arrays, bufs = buffers(1)
        self.transport = make_transport(kind, tls)
        self.transport.register(LAYOUT.regions(bufs))
        self.transport.attach("d", self.receiver.descriptor).result(30)
        self.mapping = BlockMapping(LAYOUT, LAYOUT)

    def once(self, m: Map, tid: str) -> float:
        src, dst, tokens = m
        copies = [self.mapping.copies(layer, src, dst, 0, tokens) for layer in range(LAYOUT.num_layers)]
        t0 = time.perf_counter()
        futures = [self.transport.write("d", c) for c in copies]
        while not all(f.done() for f in futures):
            time.sleep(0.0002)
        for f in futures:
            f.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.transport.close()
        self.receiver.stop()


class EngineSide:
    """Prefill ``TransferEngine`` here, decode engine in the receiver; timed from first push to DONE.

    ``integrity``: both engines run with ``integrity_check``. ``decode_s``: the last ``once`` timed until the
    decode side's result came back (what D's verification, in integrity mode, adds to is in it)."""

    def __init__(self, kind: str, tls: str, integrity: bool = False) -> None:
        self.receiver = receiver("engine", kind, tls, integrity)
        self.arrays, bufs = buffers(1)
        self.decode_s = 0.0
        config = TransferConfig(engine_id="bench-p", listen_port=0, lease_s=120, integrity_check=integrity)
        self.engine = TransferEngine(config, LAYOUT, bufs, make_transport(kind, tls))
        assert self.engine.address is not None
        self.address = self.engine.address

    def once(self, m: Map, tid: str) -> float:
        src, dst, tokens = m
        command = {"cmd": "expect", "id": tid, "addr": self.address, "dst": dst, "tokens": tokens}
        self.receiver.send(msgspec.json.encode(command).decode())
        deadline = time.monotonic() + 60
        while self.engine.table_sizes()["orphan_destinations"] == 0:  # D's destinations are here
            if time.monotonic() > deadline:
                raise TimeoutError("destinations never arrived")
            time.sleep(0.001)
        t0 = time.perf_counter()
        self.engine.offer(tid, src)
        for layer in range(LAYOUT.num_layers):
            self.engine.push_layer(tid, layer)
        self.engine.finish(tid)
        while not (results := self.engine.poll()):
            time.sleep(0.0002)
        elapsed = time.perf_counter() - t0
        decoded = self.receiver.expect("RESULT")
        self.decode_s = time.perf_counter() - t0
        if results[0].state is not TransferState.DONE or decoded != ["done"]:
            raise RuntimeError(f"transfer {tid} did not complete: {results[0]}, decode {decoded}")
        return elapsed

    def close(self) -> None:
        self.engine.close()
        self.receiver.stop()


def measure(kind: str, tls: str, maps: list[Map], reps: int) -> dict[str, list[list[float]]]:
    """Raw and engine repetitions interleaved, so load drift on a shared host hits both alike."""
    sides: dict[str, RawSide | EngineSide] = {"raw": RawSide(kind, tls), "engine": EngineSide(kind, tls)}
    times: dict[str, list[list[float]]] = {name: [[] for _ in maps] for name in sides}
    try:
        for rep in range(reps):
            for i, m in enumerate(maps):
                for name, side in sides.items():
                    times[name][i].append(side.once(m, f"r{rep}m{i}"))
        return times
    finally:
        for side in sides.values():
            side.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS)
    )
    parser.add_argument("--serve", choices=["raw", "engine"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="tcp", help=argparse.SUPPRESS)
    parser.add_argument("--tls", default="", help=argparse.SUPPRESS)
    parser.add_argument("--integrity", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.kind, args.tls, args.integrity)
        return
    rng = np.random.default_rng(7)
    blocks = PROMPT_TOKENS // LAYOUT.block_tokens
    maps = [
        (scattered(rng, blocks), scattered(rng, blocks), PROMPT_TOKENS),
        (scattered(rng, 1), scattered(rng, 1), LAYOUT.block_tokens),
    ]
    kv_bytes = blocks * LAYOUT.block_bytes * LAYOUT.num_layers * LAYOUT.buffers_per_layer
    summary: dict[str, dict[str, float]] = {"kv_gbps": {}, "tiny_ms": {}, "engine_over_raw": {}}
    for name in args.paths.split(","):
        log(f"{name} ...")
        times = measure(*PATHS[name], maps, args.reps)
        for variant, (kv, tiny) in times.items():
            summary["kv_gbps"][f"{name}_{variant}"] = round(kv_bytes / statistics.median(kv) / 1e9, 3)
            summary["tiny_ms"][f"{name}_{variant}"] = round(statistics.median(tiny) * 1e3, 3)
        ratios = [raw_t / eng_t for raw_t, eng_t in zip(times["raw"][0], times["engine"][0], strict=True)]
        summary["engine_over_raw"][name] = round(statistics.median(ratios), 3)  # throughput ratio, paired
        log(f"  {summary}")
    print(json.dumps({"kv_bytes": kv_bytes, "reps": args.reps, **summary}))


if __name__ == "__main__":
    main()
