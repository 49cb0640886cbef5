"""Data-plane throughput and idle cost: our transports vs memcpy, a raw asyncio socket and NIXL (UCX backend).

Two processes on loopback: this one sends, a receiver started per data path (``--serve``) owns the target
memory. For each message size S (4 KiB .. 16 MiB) one repetition moves 64 MiB as 64 MiB / S separate
S-byte messages whose destinations are reversed, so nothing can be merged: it measures per-message cost.
The KV-shaped case moves one 4096-token prompt of a Llama-3-8B-like cache as a TP=2 rank holds it
(32 layers, K and V in separate regions, 4 of 8 KV heads x 128 x bf16, 16-token blocks -> 16 KiB per block,
256 blocks per region, 64 regions = 256 MiB), with source and destination block ids taken from fragmented
free lists (runs of mean length 8, shuffled), layer by layer as a connector pushes them.

Every figure is the median of ``--reps`` repetitions, all paths measured in the same run. Progress goes to
stderr; the last stdout line is the JSON summary (see docs/performance.md ``## transport``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from pd_connector.transport.base import BlockCopy, MemoryRegion, Transport
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.ucx import UcxConfig

#: The environment before anything imported ucxx, which sets UCX_RNDV_FRAG_MEM_TYPE=cuda and UCX_RNDV_THRESH
#: in os.environ at import: child processes (receivers, the NIXL sender) must not inherit those.
CLEAN_ENV = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
MESSAGE_BYTES = 64 << 20  # moved per repetition of a message-size test
LAYERS, KV_BLOCK = 32, 16 << 10
PROMPT_BLOCKS = 4096 // 16
POOL_BLOCKS = 384  # blocks per region on each side; the prompt's 256 are scattered in it
KV_REGIONS = 2 * LAYERS
IDLE_S = 3.0

# UCX variants of our transport: shared memory (posix + cma) and tcp, as UCX_TLS selects them.
UCX_TLS = {"ucx_sm": "sm,self", "ucx_tcp": "tcp,self"}
UCX_TUNING = {"RNDV_SCHEME": "put_zcopy", "TCP_TX_SEG_SIZE": "256K", "TCP_RX_SEG_SIZE": "1M"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- memory layout shared by sender and receiver ---------------------------------------------------------------
class Memory:
    """One 64 MiB message buffer (aliased by one region per size) and the KV pool (64 regions)."""

    def __init__(self, fill: bool) -> None:
        rng = np.random.default_rng(1)
        shape_kv = (KV_REGIONS, POOL_BLOCKS, KV_BLOCK)
        self.messages = (
            rng.integers(0, 256, MESSAGE_BYTES, dtype=np.uint8) if fill else np.zeros(MESSAGE_BYTES, np.uint8)
        )
        self.kv = rng.integers(0, 256, shape_kv, dtype=np.uint8) if fill else np.zeros(shape_kv, np.uint8)

    def regions(self) -> list[MemoryRegion]:
        out = [
            MemoryRegion(i, self.messages.ctypes.data, MESSAGE_BYTES, size) for i, size in enumerate(SIZES)
        ]
        base = len(SIZES)
        out += [
            MemoryRegion(base + r, self.kv[r].ctypes.data, self.kv[r].nbytes, KV_BLOCK)
            for r in range(KV_REGIONS)
        ]
        return out


def fragmented_blocks(seed: int) -> list[int]:
    """256 block ids as an allocator's free list leaves them after churn: short runs in shuffled order."""
    rng = np.random.default_rng(seed)
    runs, start = [], 0
    while start < POOL_BLOCKS:
        length = int(min(rng.geometric(1 / 8), POOL_BLOCKS - start))
        runs.append(list(range(start, start + length)))
        start += length
    order = rng.permutation(len(runs))
    return [b for i in order for b in runs[i]][:PROMPT_BLOCKS]


KV_SRC, KV_DST = fragmented_blocks(11), fragmented_blocks(12)


def message_copies(size_index: int) -> list[BlockCopy]:
    n = MESSAGE_BYTES // SIZES[size_index]
    return [BlockCopy(size_index, i, n - 1 - i) for i in range(n)]


def layer_copies(layer: int) -> list[BlockCopy]:
    base = len(SIZES)
    return [
        BlockCopy(base + 2 * layer + kv, s, d) for kv in (0, 1) for s, d in zip(KV_SRC, KV_DST, strict=True)
    ]


# -- receiver process ------------------------------------------------------------------------------------------
def serve(kind: str, tls: str) -> None:
    """Receiver: register the memory for ``kind``, print ``READY <hex>``, then wait for ``exit`` on stdin."""
    memory = Memory(fill=False)
    closer: Callable[[], None]
    if kind == "raw":
        descriptor, closer = _serve_raw(memory)
    elif kind == "nixl":
        descriptor, closer = _serve_nixl(memory)
    else:
        transport = _our_transport(kind, tls)
        descriptor, closer = transport.register(memory.regions()), transport.close
    print("READY", descriptor.hex(), flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
    closer()


def _our_transport(kind: str, tls: str) -> Transport:
    return create_transport(TransportConfig(kind=kind, ucx=UcxConfig(tls=tls, options=UCX_TUNING)))  # type: ignore[arg-type]


def _serve_raw(memory: Memory) -> tuple[bytes, Callable[[], None]]:
    """A plain asyncio-streams server: header (count, size), then ``count`` payloads copied into place."""
    from pd_connector.transport.loop_thread import LoopThread

    io = LoopThread("raw-socket")
    view = memory.messages.data

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                count, size = struct.unpack("!QQ", await reader.readexactly(16))
            except asyncio.IncompleteReadError:
                return
            for i in range(count):
                view[(count - 1 - i) * size : (count - i) * size] = await reader.readexactly(size)
            writer.write(b"k")

    async def start() -> int:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=32 << 20)
        return int(server.sockets[0].getsockname()[1])

    port = io.submit(start()).result(10)
    return struct.pack("!H", port), io.stop


def _nixl_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _serve_nixl(memory: Memory) -> tuple[bytes, Callable[[], None]]:
    agent = _nixl_agent("receiver")
    regs = [(memory.messages.ctypes.data, MESSAGE_BYTES, 0, "")]
    regs += [(int(memory.kv[r].ctypes.data), int(memory.kv[r].nbytes), 0, "") for r in range(KV_REGIONS)]
    descs = agent.register_memory(regs, "DRAM")
    addresses = struct.pack(
        f"!{1 + KV_REGIONS}Q",
        memory.messages.ctypes.data,
        *(memory.kv[r].ctypes.data for r in range(KV_REGIONS)),
    )
    meta = agent.get_agent_metadata()
    return struct.pack("!I", len(meta)) + meta + addresses, lambda: agent.deregister_memory(descs)


class Receiver:
    def __init__(self, kind: str, tls: str = "") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.transport", "--serve", kind, "--tls", tls],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=CLEAN_ENV,
        )  # fmt: skip
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("READY "):
                self.descriptor = bytes.fromhex(line.split()[1])
                return
        raise RuntimeError(f"{kind} receiver exited with {self.proc.wait()}")

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(30)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


# -- measurements ------------------------------------------------------------------------------------------------
def median_gbps(nbytes: int, run: Callable[[], object], reps: int) -> float:
    run()  # warm-up: connection set-up, registration caches, page faults
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def idle_cpu_percent(receiver: Receiver) -> float:
    """CPU of both ends of an idle, connected pair over ``IDLE_S`` seconds, in % of one core."""
    mine, theirs = time.process_time(), receiver.cpu_seconds()
    time.sleep(IDLE_S)
    used = time.process_time() - mine + receiver.cpu_seconds() - theirs
    return 100.0 * used / IDLE_S


def bench_memcpy(memory: Memory, target: Memory, reps: int) -> tuple[list[float], float]:
    out = []
    for size in SIZES:
        n = MESSAGE_BYTES // size
        src, dst = memory.messages.reshape(n, size), target.messages.reshape(n, size)
        order = np.arange(n - 1, -1, -1)
        out.append(median_gbps(MESSAGE_BYTES, partial(dst.__setitem__, order, src), reps))
    src_idx, dst_idx = np.array(KV_SRC), np.array(KV_DST)

    def kv() -> None:
        for r in range(KV_REGIONS):
            target.kv[r][dst_idx] = memory.kv[r][src_idx]

    return out, median_gbps(KV_REGIONS * PROMPT_BLOCKS * KV_BLOCK, kv, reps)


def _write_and_wait(sender: Transport, copies: list[BlockCopy]) -> int:
    return sender.write("receiver", copies).result(120)


def bench_ours(
    name: str, kind: str, tls: str, memory: Memory, reps: int
) -> tuple[list[float], float, float | None]:
    receiver = Receiver(kind, tls)
    sender = _our_transport(kind, tls)
    try:
        sender.register(memory.regions())
        sender.attach("receiver", receiver.descriptor).result(30)
        sizes = []
        for i in range(len(SIZES)):
            copies = message_copies(i)
            sizes.append(median_gbps(MESSAGE_BYTES, partial(_write_and_wait, sender, copies), reps))
            log(f"  {name} {SIZES[i] >> 10} KiB: {sizes[-1]:.2f} GB/s")
        layers = [layer_copies(layer) for layer in range(LAYERS)]

        def kv() -> None:
            futures = [sender.write("receiver", copies) for copies in layers]
            for f in futures:
                f.result(120)

        kv_gbps = median_gbps(KV_REGIONS * PROMPT_BLOCKS * KV_BLOCK, kv, reps)
        log(f"  {name} kv-shaped: {kv_gbps:.2f} GB/s")
        idle = idle_cpu_percent(receiver) if name == "ucx_sm" else None
        return sizes, kv_gbps, idle
    finally:
        sender.close()
        receiver.stop()


def bench_raw(memory: Memory, reps: int) -> list[float]:
    receiver = Receiver("raw")
    (port,) = struct.unpack("!H", receiver.descriptor)
    view = memory.messages.data

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int) -> None:
        n = MESSAGE_BYTES // size
        writer.write(struct.pack("!QQ", n, size))
        for i in range(n):
            writer.write(view[i * size : (i + 1) * size])
            if writer.transport.get_write_buffer_size() > (8 << 20):
                await writer.drain()
        await writer.drain()
        await reader.readexactly(1)

    async def run_all() -> list[float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        out = []
        for size in SIZES:
            await one(reader, writer, size)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                await one(reader, writer, size)
                times.append(time.perf_counter() - start)
            out.append(MESSAGE_BYTES / statistics.median(times) / 1e9)
            log(f"  raw_socket {size >> 10} KiB: {out[-1]:.2f} GB/s")
        writer.close()
        return out

    try:
        return asyncio.run(run_all())
    finally:
        receiver.stop()


def bench_nixl(memory: Memory, reps: int) -> tuple[list[float], float, float]:
    receiver = Receiver("nixl")
    agent = _nixl_agent("sender")
    regs = [(memory.messages.ctypes.data, MESSAGE_BYTES, 0, "")]
    regs += [(int(memory.kv[r].ctypes.data), int(memory.kv[r].nbytes), 0, "") for r in range(KV_REGIONS)]
    registered = agent.register_memory(regs, "DRAM")
    try:
        (meta_len,) = struct.unpack("!I", receiver.descriptor[:4])
        peer = agent.add_remote_agent(receiver.descriptor[4 : 4 + meta_len])
        remote_base = struct.unpack(f"!{1 + KV_REGIONS}Q", receiver.descriptor[4 + meta_len :])

        def blocks(base: int, size: int, count: int) -> np.ndarray:
            return np.array([(base + i * size, size, 0) for i in range(count)], dtype=np.int64)

        def transfer(local: object, remote: object, lidx: np.ndarray, ridx: np.ndarray) -> object:
            handle = agent.make_prepped_xfer("WRITE", local, lidx, remote, ridx)
            if agent.transfer(handle) == "ERR":
                raise RuntimeError("nixl transfer failed")
            return handle

        def finish(handle: object) -> None:
            while (state := agent.check_xfer_state(handle)) == "PROC":
                pass
            if state != "DONE":
                raise RuntimeError(f"nixl transfer state {state}")
            agent.release_xfer_handle(handle)

        sizes = []
        for size in SIZES:
            n = MESSAGE_BYTES // size
            local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", blocks(memory.messages.ctypes.data, size, n), "DRAM"
            )
            remote = agent.prep_xfer_dlist(peer, blocks(remote_base[0], size, n), "DRAM")
            lidx, ridx = np.arange(n, dtype=np.int32), np.arange(n - 1, -1, -1, dtype=np.int32)
            sizes.append(
                median_gbps(
                    MESSAGE_BYTES,
                    partial(lambda *a: finish(transfer(*a)), local, remote, lidx, ridx),
                    reps,
                )
            )
            log(f"  nixl {size >> 10} KiB: {sizes[-1]:.2f} GB/s")
            agent.release_dlist_handle(local)
            agent.release_dlist_handle(remote)
        # KV: one descriptor per block of every region, prepared once (as vLLM's NixlConnector does at start-up);
        # per layer one transfer of 512 block descriptors (K and V), all layers in flight, then wait.
        local_kv = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            np.concatenate(
                [blocks(int(memory.kv[r].ctypes.data), KV_BLOCK, POOL_BLOCKS) for r in range(KV_REGIONS)]
            ),
            "DRAM",
        )
        remote_kv = agent.prep_xfer_dlist(
            peer,
            np.concatenate([blocks(remote_base[1 + r], KV_BLOCK, POOL_BLOCKS) for r in range(KV_REGIONS)]),
            "DRAM",
        )
        src, dst = np.array(KV_SRC, dtype=np.int32), np.array(KV_DST, dtype=np.int32)
        per_layer = [
            (
                np.concatenate([(2 * layer + kv) * POOL_BLOCKS + src for kv in (0, 1)]),
                np.concatenate([(2 * layer + kv) * POOL_BLOCKS + dst for kv in (0, 1)]),
            )
            for layer in range(LAYERS)
        ]

        def kv() -> None:
            handles = [transfer(local_kv, remote_kv, lidx, ridx) for lidx, ridx in per_layer]
            for handle in handles:
                finish(handle)

        kv_gbps = median_gbps(KV_REGIONS * PROMPT_BLOCKS * KV_BLOCK, kv, reps)
        log(f"  nixl kv-shaped: {kv_gbps:.2f} GB/s")
        idle = idle_cpu_percent(receiver)
        agent.release_dlist_handle(local_kv)
        agent.release_dlist_handle(remote_kv)
        agent.remove_remote_agent(peer)
        return sizes, kv_gbps, idle
    finally:
        agent.deregister_memory(registered)
        receiver.stop()


def run_nixl_sender(reps: int) -> tuple[list[float], float, float]:
    """NIXL bundles its own libucp (1.23); this process already loaded ucxx's 1.21, so NIXL sends from a
    fresh process (``--nixl-sender``) that never imports ucxx."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.transport", "--nixl-sender", "--reps", str(reps)],
        stdout=subprocess.PIPE, text=True, env=CLEAN_ENV, timeout=1800, check=True,
    )  # fmt: skip
    line = next(x for x in proc.stdout.splitlines() if x.startswith("NIXL_RESULT "))
    result = json.loads(line.split(" ", 1)[1])
    return result["sizes"], result["kv"], result["idle"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=7, help="repetitions per figure (median reported; >= 5)")
    parser.add_argument("--serve", choices=["ucx", "tcp", "raw", "nixl"], help=argparse.SUPPRESS)
    parser.add_argument("--nixl-sender", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tls", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--skip-nixl", action="store_true", help="when the bench extra (nixl) is not installed"
    )
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.tls)
        return
    if args.nixl_sender:
        sizes, kv, idle_nixl = bench_nixl(Memory(fill=True), args.reps)
        print("NIXL_RESULT", json.dumps({"sizes": sizes, "kv": kv, "idle": idle_nixl}), flush=True)
        return
    memory, target = Memory(fill=True), Memory(fill=False)
    log(f"kv-shaped: {LAYERS} layers x K,V x {PROMPT_BLOCKS} blocks x {KV_BLOCK >> 10} KiB = "
        f"{KV_REGIONS * PROMPT_BLOCKS * KV_BLOCK >> 20} MiB, {len(layer_copies(0))} block copies per layer")  # fmt: skip
    gbps: dict[str, list[float]] = {}
    kv_gbps: dict[str, float] = {}
    idle: dict[str, float] = {}
    gbps["memcpy"], kv_gbps["memcpy"] = bench_memcpy(memory, target, args.reps)
    log(f"  memcpy: {gbps['memcpy']} kv {kv_gbps['memcpy']:.2f}")
    del target
    for name, kind, tls in (
        ("ucx_sm", "ucx", UCX_TLS["ucx_sm"]),
        ("ucx_tcp", "ucx", UCX_TLS["ucx_tcp"]),
        ("tcp", "tcp", ""),
    ):
        gbps[name], kv_gbps[name], idle_ours = bench_ours(name, kind, tls, memory, args.reps)
        if idle_ours is not None:
            idle["ours"] = idle_ours
    gbps["raw_socket"] = bench_raw(memory, args.reps)
    if not args.skip_nixl:
        gbps["nixl"], kv_gbps["nixl"], idle["nixl"] = run_nixl_sender(args.reps)
    summary = {
        "sizes": SIZES,
        "gbps": {k: [round(x, 3) for x in v] for k, v in gbps.items()},
        "kv_shaped_gbps": {k: round(v, 3) for k, v in kv_gbps.items()},
        "idle_cpu_percent": {k: round(v, 2) for k, v in idle.items()},
        "reps": args.reps,
        "kv_shape": {
            "layers": LAYERS,
            "regions": KV_REGIONS,
            "blocks_per_region": PROMPT_BLOCKS,
            "block_bytes": KV_BLOCK,
        },
    }
    if "nixl" in gbps:
        summary["ratios"] = ratios(gbps, kv_gbps, idle)
    print(json.dumps(summary))


def ratios(
    gbps: dict[str, list[float]], kv: dict[str, float], idle: dict[str, float]
) -> dict[str, float | bool]:
    """The issue's targets as ratios of figures from this run."""
    i64, i1m, i16m = SIZES.index(64 << 10), SIZES.index(1 << 20), SIZES.index(16 << 20)
    sm, nixl = gbps["ucx_sm"], gbps["nixl"]
    tcp_vs_raw = min(t / r for t, r in zip(gbps["tcp"], gbps["raw_socket"], strict=True))
    return {
        "ucx_sm_vs_memcpy_16MiB": round(sm[i16m] / gbps["memcpy"][i16m], 3),
        "ucx_sm_vs_nixl_16MiB": round(sm[i16m] / nixl[i16m], 3),
        "ucx_sm_vs_nixl_64KiB": round(sm[i64] / nixl[i64], 3),
        "ucx_sm_vs_nixl_1MiB": round(sm[i1m] / nixl[i1m], 3),
        "kv_ucx_sm_vs_nixl": round(kv["ucx_sm"] / kv["nixl"], 3),
        "tcp_vs_raw_socket_min": round(tcp_vs_raw, 3),
        "idle_ours_le_2pct": idle.get("ours", 100.0) <= 2.0,
    }


if __name__ == "__main__":
    main()
