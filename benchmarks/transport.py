"""Data-plane throughput and idle cost: our transports (UCX sm/tcp, cma, TCP) vs memcpy, a raw asyncio socket
and NIXL (UCX backend).

Two processes on loopback: this one sends, a receiver started per data path (``--serve``) owns the target
memory. For each message size S (4 KiB .. 16 MiB) one repetition moves 64 MiB as 64 MiB / S separate
S-byte messages whose destinations are reversed, so nothing can be merged: it measures per-message cost.
The KV-shaped case moves one 4096-token prompt of a Llama-3-8B-like cache as a TP=2 rank holds it
(32 layers, K and V in separate regions, 4 of 8 KV heads x 128 x bf16, 16-token blocks -> 16 KiB per block,
256 blocks per region, 64 regions = 256 MiB), with source and destination block ids taken from fragmented
free lists (runs of mean length 8, shuffled), layer by layer as a connector pushes them.

Every figure is the median of ``--reps`` rounds x ``--samples`` timed runs, all paths measured in the same
run: each round starts a fresh sender/receiver pair per path, and one run of a 16 MiB case lasts only ~5 ms,
so a few runs per pair keep one unlucky scheduling slice from deciding a round. ``--paths`` narrows
a run to some paths (``ucx_sm_512k``, on request only, is ``ucx_sm`` with UCX's default cma segments);
``--no-huge-pages`` puts every path, the memcpy ceiling included, on 4 KiB pages. The KV-shaped case is
also timed next to a thread of the sender process that spins in Python (``kv_shaped_gbps_next_to_python``):
an engine's threads run Python while its layers are in flight, and a transport thread that lets go of the GIL
waits up to the switch interval (5 ms) to get it back. ``--tp-pairs`` adds the same prompt over the whole
model's cache, sent from P's TP ranks into D's for pairs of TP sizes (``tp_pairs``: GB/s and the transfer
operations per layer, see ``benchmarks/tp_pairs.py``). ``--integrity-paths`` adds what the integrity mode
(``integrity_check``) costs: the same KV-shaped prompt through a pair of transfer engines (``benchmarks.
transfer_engine``'s ``EngineSide``: P here, D in its own process), one pair with the mode and one without,
transfers alternating, timed from the first push until D reported the load (so D's verification is in it):
``integrity`` gives both GB/s and the run-for-run ratio. Progress goes to stderr; the last stdout line is the
JSON summary (see docs/performance.md ``## transport``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from benchmarks import tp_pairs, transfer_engine
from benchmarks.helper_process import Helper, wait_for_exit
from benchmarks.kv_shapes import (
    KV_DST,
    KV_SRC,
    POOL_BLOCKS,
    PROMPT_BLOCKS,
    PROMPT_TOKENS,
    huge_pages,
    small_pages,
)
from pd_connector.transport.base import BlockCopy, MemoryRegion, Transport
from pd_connector.transport.cma import CmaConfig, build_iovecs, call_bounds, decode_descriptor, vm_call
from pd_connector.transport.coalesce import coalesce_runs
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.regions import RegionIndex, RegionTable, plan
from pd_connector.transport.ucx import UcxConfig
from test_support.spinner import python_spinner

#: The environment before anything imported ucxx, which sets UCX_RNDV_FRAG_MEM_TYPE=cuda and UCX_RNDV_THRESH
#: in os.environ at import: child processes (receivers, the NIXL sender) must not inherit those.
CLEAN_ENV = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
MESSAGE_BYTES = 64 << 20  # moved per repetition of a message-size test
LAYERS, KV_BLOCK = 32, 16 << 10
KV_REGIONS = 2 * LAYERS
IDLE_S = 3.0

# UCX variants of our transport: shared memory (posix + cma) and tcp, as UCX_TLS selects them.
UCX_TLS = {"ucx_sm": "sm,self", "ucx_tcp": "tcp,self"}
UCX_TUNING = {"RNDV_SCHEME": "put_zcopy", "TCP_TX_SEG_SIZE": "256K", "TCP_RX_SEG_SIZE": "1M"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- memory layout shared by sender and receiver ---------------------------------------------------------------
class Memory:
    """One 64 MiB message buffer (aliased by one region per size) and the KV pool (64 regions).

    Every path, the memcpy ceiling included, gets the same kind of pages. ``huge=True``: anonymous mappings
    aligned to 2 MiB and advised ``MADV_HUGEPAGE`` before first touch, so they are transparent huge pages end
    to end, like the memory the UCX transport's ``huge_pages`` setting produces in a KV cache of gigabytes.
    (numpy's own arrays are advised too, but they start anywhere in a huge page: the partial huge pages at
    both ends keep 4 KiB pages, a few per cent of a 64 MiB buffer and a share that a real cache does not have,
    which slowed the pinning paths, cma and UCX shared memory, more than the memcpy ceiling.)
    ``huge=False``: anonymous mappings advised ``MADV_NOHUGEPAGE`` before first touch, i.e. 4 KiB pages as a
    torch-allocated KV cache has them unless advised (and the transport's ``huge_pages`` is switched off).
    """

    def __init__(self, fill: bool, huge: bool) -> None:
        rng = np.random.default_rng(1)
        shape_kv = (KV_REGIONS, POOL_BLOCKS, KV_BLOCK)
        pages = huge_pages if huge else small_pages
        self.messages = pages(MESSAGE_BYTES)
        self.kv = pages(KV_REGIONS * POOL_BLOCKS * KV_BLOCK).reshape(shape_kv)
        if fill:
            self.messages[:] = rng.integers(0, 256, self.messages.shape, dtype=np.uint8)
            self.kv[:] = rng.integers(0, 256, shape_kv, dtype=np.uint8)

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


def message_copies(size_index: int) -> list[BlockCopy]:
    n = MESSAGE_BYTES // SIZES[size_index]
    return [BlockCopy(size_index, i, n - 1 - i) for i in range(n)]


def layer_copies(layer: int) -> list[BlockCopy]:
    base = len(SIZES)
    return [
        BlockCopy(base + 2 * layer + kv, s, d) for kv in (0, 1) for s, d in zip(KV_SRC, KV_DST, strict=True)
    ]


# -- receiver process ------------------------------------------------------------------------------------------
def serve(kind: str, tls: str, huge: bool) -> None:
    """Receiver: register the memory for ``kind``, print ``READY <hex>``, then wait for ``exit`` on stdin."""
    memory = Memory(fill=False, huge=huge)
    closer: Callable[[], None]
    if kind == "raw":
        descriptor, closer = _serve_raw(memory)
    elif kind == "nixl":
        descriptor, closer = _serve_nixl(memory)
    else:
        transport = _our_transport(kind, tls, huge)
        descriptor, closer = transport.register(memory.regions()), transport.close
    print("READY", descriptor.hex(), flush=True)
    wait_for_exit()
    closer()


def _our_transport(kind: str, tls: str, huge: bool, cma_segment_bytes: int | None = None) -> Transport:
    ucx = UcxConfig(tls=tls, options=UCX_TUNING, huge_pages=huge)
    if cma_segment_bytes is not None:
        ucx = dataclasses.replace(ucx, cma_segment_bytes=cma_segment_bytes)
    cma = CmaConfig(huge_pages=huge)
    return create_transport(TransportConfig(kind=kind, ucx=ucx, cma=cma))  # type: ignore[arg-type]


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

    async def handlers_done() -> None:
        """The sender closed its connection before telling us to exit; let the handler see that EOF, so the
        loop stops with no pending task."""
        if handlers := asyncio.all_tasks() - {asyncio.current_task()}:
            await asyncio.wait(handlers, timeout=5)

    def close() -> None:
        io.submit(handlers_done()).result(10)
        io.stop()

    port = io.submit(start()).result(10)
    return struct.pack("!H", port), close


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


def receiver(kind: str, huge: bool, tls: str = "") -> Helper:
    """A receiver process (``serve``) for ``kind``, started and ready: its ``descriptor`` is what to attach."""
    argv = [sys.executable, "-m", "benchmarks.transport", "--serve", kind, "--tls", tls, *_huge_arg(huge)]
    return Helper(argv, f"{kind} receiver", CLEAN_ENV)


# -- senders: one process per data path, driven one repetition at a time ----------------------------------------
KV_BYTES = KV_REGIONS * PROMPT_BLOCKS * KV_BLOCK
CASES = [str(i) for i in range(len(SIZES))] + ["kv"]


def case_bytes(case: str) -> int:
    return KV_BYTES if case == "kv" else MESSAGE_BYTES


class Path:
    """One data path's sender side: ``run(case)`` moves one repetition's bytes and returns when they landed."""

    receiver: Helper | None = None

    def run(self, case: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()

    def idle_cpu_percent(self) -> float:
        """CPU of both ends of the idle, connected pair over ``IDLE_S`` seconds, in % of one core."""
        assert self.receiver is not None
        mine, theirs = time.process_time(), self.receiver.cpu_seconds()
        time.sleep(IDLE_S)
        used = time.process_time() - mine + self.receiver.cpu_seconds() - theirs
        return 100.0 * used / IDLE_S


class MemcpyPath(Path):
    """The ceiling: the same block copies inside one process (numpy gather/scatter)."""

    def __init__(self, memory: Memory, huge: bool) -> None:
        self.memory, self.target = memory, Memory(fill=False, huge=huge)
        self.kv_src, self.kv_dst = np.array(KV_SRC), np.array(KV_DST)

    def run(self, case: str) -> None:
        if case == "kv":
            for r in range(KV_REGIONS):
                self.target.kv[r][self.kv_dst] = self.memory.kv[r][self.kv_src]
            return
        size = SIZES[int(case)]
        n = MESSAGE_BYTES // size
        self.target.messages.reshape(n, size)[::-1] = self.memory.messages.reshape(n, size)


class OursPath(Path):
    """Our transport: each message case is one ``write`` of 64 MiB / S unmergeable copies; KV is 32 layer
    writes in flight (as the connector pushes them), then wait for all."""

    def __init__(
        self, memory: Memory, kind: str, tls: str, huge: bool, cma_segment_bytes: int | None = None
    ) -> None:
        self.memory = memory  # registered, not owned, by the transport: keep it alive
        self.receiver = receiver(kind, huge, tls)
        # puts are one-sided: only the sender's segment size matters (the receiver keeps the default)
        self.sender = _our_transport(kind, tls, huge, cma_segment_bytes)
        self.sender.register(memory.regions())
        self.sender.attach("receiver", self.receiver.descriptor).result(30)
        #: per case, the writes one run issues (one per message set; one per layer for ``kv``)
        self.batches: dict[str, list[list[BlockCopy]]] = {
            **{str(i): [message_copies(i)] for i in range(len(SIZES))},
            "kv": [layer_copies(layer) for layer in range(LAYERS)],
        }

    def run(self, case: str) -> None:
        for future in [self.sender.write("receiver", copies) for copies in self.batches[case]]:
            future.result(120)

    def close(self) -> None:
        self.sender.close()
        super().close()


class CmaSyscallPath(Path):
    """The bare system call under our ``cma`` path: the same iovecs, planned before the clock starts, and
    ``process_vm_writev`` in a loop on this thread (no I/O thread, no futures). What any CMA-based transport,
    UCX's shared-memory path included, can reach; ``cma`` / this is what our transport costs on top."""

    def __init__(self, ours: OursPath) -> None:
        desc = decode_descriptor(ours.receiver.descriptor) if ours.receiver else None
        assert desc is not None
        self.pid = desc.pid
        table = RegionTable()
        table.add(ours.memory.regions())
        local, remote = table.index(), RegionIndex(desc.regions)
        segment = CmaConfig().segment_bytes
        self.iovecs = {
            case: [build_iovecs(plan(copies, local, remote), segment) for copies in batches]
            for case, batches in ours.batches.items()
        }
        self.calls = {
            case: [call_bounds(iov.local[:, 1], segment) for iov in iovecs]
            for case, iovecs in self.iovecs.items()
        }

    def run(self, case: str) -> None:
        for iovecs, calls in zip(self.iovecs[case], self.calls[case], strict=True):
            for start, stop, nbytes in calls:
                if vm_call(True, self.pid, iovecs, start, stop) != nbytes:
                    raise RuntimeError(
                        "process_vm_writev moved fewer bytes than asked (the bare loop does not resume)"
                    )


class RawSocketPath(Path):
    """A plain asyncio-streams client: header, then each message with ``writer.write``, then wait for 1 byte."""

    def __init__(self, memory: Memory, huge: bool) -> None:
        self.memory = memory
        self.receiver = receiver("raw", huge)
        (port,) = struct.unpack("!H", self.receiver.descriptor)
        self.view = memory.messages.data
        self.loop = asyncio.new_event_loop()
        self.reader, self.writer = self.loop.run_until_complete(asyncio.open_connection("127.0.0.1", port))

    async def _send(self, size: int) -> None:
        n = MESSAGE_BYTES // size
        self.writer.write(struct.pack("!QQ", n, size))
        for i in range(n):
            self.writer.write(self.view[i * size : (i + 1) * size])
            if self.writer.transport.get_write_buffer_size() > (8 << 20):
                await self.writer.drain()
        await self.writer.drain()
        await self.reader.readexactly(1)

    def run(self, case: str) -> None:
        self.loop.run_until_complete(self._send(SIZES[int(case)]))

    def close(self) -> None:
        self.writer.close()  # the loop only runs inside run_until_complete: let it carry out the close
        self.loop.run_until_complete(self.writer.wait_closed())
        self.loop.close()
        super().close()


class NixlPath(Path):
    """NIXL's UCX backend with its defaults: per-block descriptors prepared once (as vLLM's NixlConnector does
    at start-up); per repetition ``make_prepped_xfer`` + ``transfer`` per message set / per layer, then poll."""

    def __init__(self, memory: Memory, huge: bool) -> None:
        self.memory = memory
        self.receiver = receiver("nixl", huge)
        self.agent = agent = _nixl_agent("sender")
        regs = [(memory.messages.ctypes.data, MESSAGE_BYTES, 0, "")]
        regs += [(int(memory.kv[r].ctypes.data), int(memory.kv[r].nbytes), 0, "") for r in range(KV_REGIONS)]
        self.registered = agent.register_memory(regs, "DRAM")
        desc = self.receiver.descriptor
        (meta_len,) = struct.unpack("!I", desc[:4])
        self.peer = agent.add_remote_agent(desc[4 : 4 + meta_len])
        remote_base = struct.unpack(f"!{1 + KV_REGIONS}Q", desc[4 + meta_len :])
        self.dlists: dict[str, tuple[object, object, np.ndarray, np.ndarray]] = {}
        for i, size in enumerate(SIZES):
            n = MESSAGE_BYTES // size
            local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _blocks(memory.messages.ctypes.data, size, n), "DRAM"
            )
            remote = agent.prep_xfer_dlist(self.peer, _blocks(remote_base[0], size, n), "DRAM")
            self.dlists[str(i)] = (
                local,
                remote,
                np.arange(n, dtype=np.int32),
                np.arange(n - 1, -1, -1, dtype=np.int32),
            )
        local_kv = np.concatenate(
            [_blocks(int(memory.kv[r].ctypes.data), KV_BLOCK, POOL_BLOCKS) for r in range(KV_REGIONS)]
        )
        remote_kv = np.concatenate(
            [_blocks(remote_base[1 + r], KV_BLOCK, POOL_BLOCKS) for r in range(KV_REGIONS)]
        )
        self.kv_local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_kv, "DRAM")
        self.kv_remote = agent.prep_xfer_dlist(self.peer, remote_kv, "DRAM")
        src, dst = np.array(KV_SRC, dtype=np.int32), np.array(KV_DST, dtype=np.int32)
        self.per_layer = [
            (
                np.concatenate([(2 * layer + kv) * POOL_BLOCKS + src for kv in (0, 1)]),
                np.concatenate([(2 * layer + kv) * POOL_BLOCKS + dst for kv in (0, 1)]),
            )
            for layer in range(LAYERS)
        ]

    def _post(self, local: object, remote: object, lidx: np.ndarray, ridx: np.ndarray) -> object:
        handle = self.agent.make_prepped_xfer("WRITE", local, lidx, remote, ridx)
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError("nixl transfer failed")
        return handle

    def _finish(self, handle: object) -> None:
        while (state := self.agent.check_xfer_state(handle)) == "PROC":
            pass
        if state != "DONE":
            raise RuntimeError(f"nixl transfer state {state}")
        self.agent.release_xfer_handle(handle)

    def run(self, case: str) -> None:
        if case == "kv":
            handles = [self._post(self.kv_local, self.kv_remote, src, dst) for src, dst in self.per_layer]
        else:
            handles = [self._post(*self.dlists[case])]
        for handle in handles:
            self._finish(handle)

    def close(self) -> None:
        for local, remote, _, _ in self.dlists.values():
            self.agent.release_dlist_handle(local)
            self.agent.release_dlist_handle(remote)
        self.agent.release_dlist_handle(self.kv_local)
        self.agent.release_dlist_handle(self.kv_remote)
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.registered)
        super().close()


def _blocks(base: int, size: int, count: int) -> np.ndarray:
    return np.array([(base + i * size, size, 0) for i in range(count)], dtype=np.int64)


#: name -> (cases it runs, whether its idle cost is reported)
PATHS: dict[str, tuple[list[str], bool]] = {
    "memcpy": (CASES, False),
    "ucx_sm": (CASES, True),
    "cma": (CASES, True),
    "ucx_tcp": (CASES, False),
    "tcp": (CASES, False),
    "raw_socket": (CASES[:-1], False),
    "nixl": (CASES, True),
    # only on request (--paths): ucx_sm with UCX's own 512 KiB cma segments instead of ucx.cma_segment_bytes
    "ucx_sm_512k": (CASES, False),
}
DEFAULT_PATHS = [name for name in PATHS if name != "ucx_sm_512k"]
#: Same-host paths whose sender also times, run for run on the same source memory, the memcpy ceiling and
#: (``cma``) the bare system call underneath.
PAIRED: dict[str, list[str]] = {
    "ucx_sm": ["ceiling"],
    "cma": ["ceiling", "syscall"],
    "ucx_sm_512k": ["ceiling"],
}


def make_path(name: str, memory: Memory, huge: bool) -> Path:
    if name == "memcpy":
        return MemcpyPath(memory, huge)
    if name in UCX_TLS:
        return OursPath(memory, "ucx", UCX_TLS[name], huge)
    if name == "ucx_sm_512k":
        return OursPath(memory, "ucx", UCX_TLS["ucx_sm"], huge, cma_segment_bytes=0)
    if name in ("tcp", "cma"):
        return OursPath(memory, name, "", huge)
    if name == "raw_socket":
        return RawSocketPath(memory, huge)
    return NixlPath(memory, huge)


def _huge_arg(huge: bool) -> list[str]:
    return [] if huge else ["--no-huge-pages"]


def drive(name: str, huge: bool) -> None:
    """Sender process for one path: ``READY``, then per stdin line ``run CASE`` -> ``SECONDS t``,
    ``ceiling CASE`` / ``syscall CASE`` -> ``SECONDS t`` (the memcpy ceiling / the bare system call in this
    process, on the same source memory, for ``PAIRED`` paths), ``spin CASE`` -> ``SECONDS t`` (``run`` next to
    ``python_spinner``), ``idle`` -> ``IDLE percent``, ``exit``. Each process loads only its own UCX (NIXL
    bundles UCX 1.23, ucxx uses 1.21: they must not share a process)."""
    memory = Memory(fill=True, huge=huge)
    path = make_path(name, memory, huge)
    runners: dict[str, Path] = {"run": path}
    if name in PAIRED:
        runners["ceiling"] = MemcpyPath(memory, huge)
    if isinstance(path, OursPath) and "syscall" in PAIRED.get(name, []):
        runners["syscall"] = CmaSyscallPath(path)
    try:
        for case in PATHS[name][0]:
            for runner in runners.values():
                runner.run(case)  # warm-up: connection set-up, registration caches, page faults
        print("READY", flush=True)
        for line in sys.stdin:
            command = line.split()
            if command[0] in runners or command[0] == "spin":
                spin = command[0] == "spin"
                with python_spinner() if spin else contextlib.nullcontext():
                    start = time.perf_counter()
                    (path if spin else runners[command[0]]).run(command[1])
                    print("SECONDS", time.perf_counter() - start, flush=True)
            elif command[0] == "idle":
                print("IDLE", path.idle_cpu_percent(), flush=True)
            else:
                break
    finally:
        path.close()


#: Transfer-engine data paths whose integrity-mode cost is measured: (transport kind, UCX_TLS).
INTEGRITY_PATHS = {"tcp": ("tcp", ""), "cma": ("cma", ""), "ucx_sm": ("ucx", UCX_TLS["ucx_sm"])}


def integrity_round(path: str, samples: int) -> dict[str, list[float]]:
    """One round of the integrity cost on ``path``: an engine pair with the mode and one without (fresh
    processes), a warm-up transfer each, then ``samples`` transfers each, alternating which goes first; seconds
    from the first push until D reported DONE."""
    if transfer_engine.LAYOUT.block_bytes != KV_BLOCK or transfer_engine.POOL_BLOCKS != POOL_BLOCKS:
        raise RuntimeError("benchmarks.transfer_engine's KV shape is not this benchmark's")
    kind, tls = INTEGRITY_PATHS[path]
    sides = {mode: transfer_engine.EngineSide(kind, tls, integrity=mode == "on") for mode in ("off", "on")}
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for mode, side in sides.items():
            side.once((KV_SRC, KV_DST, PROMPT_TOKENS), f"warm-{mode}")
        for sample in range(samples):
            for mode in ("off", "on") if sample % 2 == 0 else ("on", "off"):
                sides[mode].once((KV_SRC, KV_DST, PROMPT_TOKENS), f"s{sample}-{mode}")
                times[mode].append(sides[mode].decode_s)
        return times
    finally:
        for side in sides.values():
            side.close()


def integrity_cost(paths: list[str], reps: int, samples: int) -> dict[str, dict[str, float]]:
    """Per path, ``reps`` rounds (each its own processes, ``--integrity-round``): the KV-shaped GB/s through
    the engines without and with the mode (medians) and ``on_vs_off``, the median of run-for-run ratios."""
    times: dict[str, dict[str, list[float]]] = {p: {"off": [], "on": []} for p in paths}
    for rep in range(reps):
        for path in paths:
            argv = [sys.executable, "-m", "benchmarks.transport", "--integrity-round", path]
            out = subprocess.run(
                [*argv, "--samples", str(samples)],
                stdout=subprocess.PIPE, text=True, check=True, timeout=600, env=CLEAN_ENV,
            ).stdout  # fmt: skip
            for mode, seconds in json.loads(out.rsplit("RESULT ", 1)[1]).items():
                times[path][mode] += seconds
        log(f"integrity: round {rep + 1}/{reps} done")
    return {
        path: {
            "kv_gbps_off": round(KV_BYTES / statistics.median(t["off"]) / 1e9, 3),
            "kv_gbps_on": round(KV_BYTES / statistics.median(t["on"]) / 1e9, 3),
            "on_vs_off": round(statistics.median(o / n for o, n in zip(t["off"], t["on"], strict=True)), 3),
        }
        for path, t in times.items()
    }


class Driver:
    """The orchestrator's handle on one sender process (``drive``)."""

    def __init__(self, name: str, huge: bool) -> None:
        self.name = name
        argv = [sys.executable, "-m", "benchmarks.transport", "--drive", name, *_huge_arg(huge)]
        self._helper = Helper(argv, f"{name} sender", CLEAN_ENV, stop_wait_s=60)

    def ask(self, command: str, tag: str) -> float:
        self._helper.send(command)
        return float(self._helper.expect(tag)[0])

    def stop(self) -> None:
        self._helper.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=7, help="rounds: fresh process pairs per path (>= 5)")
    parser.add_argument(
        "--samples", type=int, default=3, help="timed runs of every case per round (median over all reported)"
    )
    parser.add_argument(
        "--skip-nixl", action="store_true", help="when the bench extra (nixl) is not installed"
    )
    parser.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        help=f"comma-separated data paths to measure, of {','.join(PATHS)} (default: all but ucx_sm_512k)",
    )
    parser.add_argument(
        "--no-huge-pages",
        action="store_true",
        help="4 KiB pages everywhere (MADV_NOHUGEPAGE, transport huge_pages off) instead of THP-advised memory",
    )
    parser.add_argument(
        "--tp-pairs",
        default=";".join(f"{p},{d}" for p, d in tp_pairs.PAIRS),
        help="P_TP,D_TP pairs for the KV-shaped transfer across tensor parallelism, ';'-separated ('' skips)",
    )
    parser.add_argument(
        "--tp-transport", default="cma", choices=["cma", "ucx", "tcp"], help="data path of the TP pairs"
    )
    parser.add_argument(
        "--integrity-paths",
        default=",".join(INTEGRITY_PATHS),
        help="engine data paths to measure the integrity mode's cost on, comma-separated ('' skips)",
    )
    parser.add_argument("--integrity-round", choices=list(INTEGRITY_PATHS), help=argparse.SUPPRESS)
    parser.add_argument("--serve", choices=["ucx", "tcp", "cma", "raw", "nixl"], help=argparse.SUPPRESS)
    parser.add_argument("--tls", default="", help=argparse.SUPPRESS)
    parser.add_argument("--drive", choices=list(PATHS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.tls, not args.no_huge_pages)
        return
    if args.drive:
        drive(args.drive, not args.no_huge_pages)
        return
    if args.integrity_round:
        print("RESULT", json.dumps(integrity_round(args.integrity_round, args.samples)), flush=True)
        return
    integrity_paths = [p for p in args.integrity_paths.split(",") if p]
    if unknown := set(integrity_paths) - INTEGRITY_PATHS.keys():
        parser.error(f"unknown --integrity-paths {sorted(unknown)}; choose from {','.join(INTEGRITY_PATHS)}")
    wanted = args.paths.split(",")
    if unknown := set(wanted) - PATHS.keys():
        parser.error(f"unknown --paths {sorted(unknown)}; choose from {','.join(PATHS)}")
    names = [n for n in PATHS if n in wanted and not (args.skip_nixl and n == "nixl")]
    log(
        f"kv-shaped: {LAYERS} layers x K,V x {PROMPT_BLOCKS} blocks x {KV_BLOCK >> 10} KiB = {KV_BYTES >> 20} MiB, "
        f"{len(layer_copies(0))} block copies per layer, {len(coalesce_runs(layer_copies(0)))} runs after coalescing"
    )
    seconds: dict[tuple[str, str], list[float]] = {}
    paired: dict[tuple[str, str], list[float]] = {}  # memcpy seconds / ours seconds, run for run
    idle: dict[str, float] = {}
    # Rounds: every repetition starts each path's sender/receiver pair alone (so NIXL's spinning progress
    # threads do not slow the others down), measures every case once, and stops it; the order of paths is
    # shuffled per round, so drifting load from other processes on this shared machine hits all paths alike.
    order = np.random.default_rng(0)
    for rep in range(args.reps):
        for name in order.permutation(names).tolist():
            driver = Driver(name, not args.no_huge_pages)
            try:
                for case in PATHS[name][0]:
                    for sample in range(args.samples):
                        # paired kinds take turns going first, so none always inherits another's caches
                        kinds = ["run", *PAIRED.get(name, [])]
                        kinds = kinds[sample % len(kinds) :] + kinds[: sample % len(kinds)]
                        timed = {kind: driver.ask(f"{kind} {case}", "SECONDS") for kind in kinds}
                        seconds.setdefault((name, case), []).append(timed.pop("run"))
                        for kind, t in timed.items():
                            seconds.setdefault((f"{name}/{kind}", case), []).append(t)
                            paired.setdefault((f"{name}/{kind}", case), []).append(
                                t / seconds[name, case][-1]
                            )
                if "kv" in PATHS[name][0]:
                    for _ in range(args.samples):
                        seconds.setdefault((name, "kv_spin"), []).append(driver.ask("spin kv", "SECONDS"))
                if rep == args.reps - 1 and PATHS[name][1]:
                    idle["ours" if name == "ucx_sm" else name] = driver.ask("idle", "IDLE")
            finally:
                driver.stop()
        log(f"round {rep + 1}/{args.reps} done")
    pairs = tp_pairs.measure(
        tp_pairs.parse_pairs(args.tp_pairs),
        args.reps,
        args.samples,
        args.tp_transport,
        not args.no_huge_pages,
        log,
    )
    integrity = integrity_cost(integrity_paths, args.reps, args.samples)
    gbps = {
        name: [round(MESSAGE_BYTES / statistics.median(seconds[name, c]) / 1e9, 3) for c in CASES[:-1]]
        for name in names
    }
    kv_gbps, kv_spin_gbps = (
        {
            name: round(KV_BYTES / statistics.median(seconds[name, case]) / 1e9, 3)
            for name in names
            if (name, case) in seconds
        }
        for case in ("kv", "kv_spin")
    )
    summary: dict[str, object] = {
        "sizes": SIZES,
        "gbps": gbps,
        "kv_shaped_gbps": kv_gbps,
        # the same KV-shaped runs next to a thread of the sender spinning in Python (see the module doc)
        "kv_shaped_gbps_next_to_python": kv_spin_gbps,
        # what each same-host path's sender timed run for run besides itself (see ``ratios``)
        "paired_gbps": {
            f"{name}/{kind}": [
                round(case_bytes(c) / statistics.median(seconds[f"{name}/{kind}", c]) / 1e9, 3) for c in CASES
            ]
            for name in names
            for kind in PAIRED.get(name, [])
        },
        "idle_cpu_percent": {k: round(v, 2) for k, v in idle.items()},
        # the whole model's KV of the prompt from P's TP ranks into D's (see benchmarks/tp_pairs.py)
        "tp_pairs": {name: dataclasses.asdict(result) for name, result in pairs.items()},
        "tp_transport": args.tp_transport,
        # the KV-shaped prompt through transfer engines with and without integrity_check (see the module doc)
        "integrity": integrity,
        "reps": args.reps,
        "samples": args.samples,
        "huge_pages": not args.no_huge_pages,
        "kv_shape": {
            "layers": LAYERS,
            "regions": KV_REGIONS,
            "blocks_per_region": PROMPT_BLOCKS,
            "block_bytes": KV_BLOCK,
        },
    }
    summary["ratios"] = (
        ratios(gbps, kv_gbps, idle, paired, kv_spin_gbps)
        | tp_pairs.ratios(pairs)
        | {f"integrity_on_vs_off_kv_{path}": r["on_vs_off"] for path, r in integrity.items()}
    )
    for name in names:
        log(
            f"{name:>10}: "
            + "  ".join(f"{g:7.3f}" for g in gbps[name])
            + f"   kv {kv_gbps.get(name, float('nan')):.3f} GB/s"
        )
    for path, r in integrity.items():
        log(f"integrity {path:>6}: off {r['kv_gbps_off']:.3f} GB/s, on {r['kv_gbps_on']:.3f} GB/s")
    for name, result in pairs.items():
        log(f"tp {name:>5}: {result.gbps:7.3f} GB/s, {result.ops_per_layer} operations per layer")
    print(json.dumps(summary))


def ratios(
    gbps: dict[str, list[float]],
    kv: dict[str, float],
    idle: dict[str, float],
    paired: dict[tuple[str, str], list[float]],
    kv_spin: dict[str, float],
) -> dict[str, float | bool]:
    """The issue's targets as ratios of figures from this run (those whose paths were measured), and, without a
    target, ``kv_next_to_python_*``: the KV-shaped transfer next to a thread spinning in Python.

    ``X_vs_memcpy_*``: median of the run-for-run ratios against the memcpy ceiling timed in the same sender
    process on the same source memory (``paired``, keyed ``X/ceiling``); ``X_vs_memcpy_*_separate``: the
    same ratio from the two medians of separate processes (the ``memcpy`` row), which adds their
    process-to-process spread. ``cma_syscall_*``: the bare ``process_vm_writev`` loop, against the ceiling
    and as what our ``cma`` reaches of it (what the transport itself costs).
    """
    i64, i1m, i16m = SIZES.index(64 << 10), SIZES.index(1 << 20), SIZES.index(16 << 20)
    out: dict[str, float | bool] = {}
    for label, case in (("16MiB", str(i16m)), ("1MiB", str(i1m)), ("kv", "kv")):
        for name in ("ucx_sm", "cma"):
            if (f"{name}/ceiling", case) in paired:
                out[f"{name}_vs_memcpy_{label}"] = round(
                    statistics.median(paired[f"{name}/ceiling", case]), 3
                )
        if ("cma/syscall", case) in paired and ("cma/ceiling", case) in paired:
            bare = [
                c / s for c, s in zip(paired["cma/ceiling", case], paired["cma/syscall", case], strict=True)
            ]
            out[f"cma_syscall_vs_memcpy_{label}"] = round(statistics.median(bare), 3)
            out[f"cma_vs_syscall_{label}"] = round(statistics.median(paired["cma/syscall", case]), 3)
    for name in ("ucx_sm", "cma"):
        if name in gbps and "memcpy" in gbps:
            out[f"{name}_vs_memcpy_16MiB_separate"] = round(gbps[name][i16m] / gbps["memcpy"][i16m], 3)
            out[f"{name}_vs_memcpy_kv_separate"] = round(kv[name] / kv["memcpy"], 3)
    if "cma" in gbps and "ucx_sm" in gbps:
        out["cma_vs_ucx_sm_16MiB"] = round(gbps["cma"][i16m] / gbps["ucx_sm"][i16m], 3)
    if "ucx_sm" in gbps and "nixl" in gbps:
        sm, nixl = gbps["ucx_sm"], gbps["nixl"]
        out["ucx_sm_vs_nixl_16MiB"] = round(sm[i16m] / nixl[i16m], 3)
        out["ucx_sm_vs_nixl_64KiB"] = round(sm[i64] / nixl[i64], 3)
        out["ucx_sm_vs_nixl_1MiB"] = round(sm[i1m] / nixl[i1m], 3)
        out["kv_ucx_sm_vs_nixl"] = round(kv["ucx_sm"] / kv["nixl"], 3)
    for name in ("ucx_sm", "cma"):
        if name in kv_spin and "nixl" in kv_spin:
            out[f"kv_next_to_python_{name}_vs_nixl"] = round(kv_spin[name] / kv_spin["nixl"], 3)
    if "tcp" in gbps and "raw_socket" in gbps:
        tcp_vs_raw = min(t / r for t, r in zip(gbps["tcp"], gbps["raw_socket"], strict=True))
        out["tcp_vs_raw_socket_min"] = round(tcp_vs_raw, 3)
    if "ours" in idle:
        out["idle_ours_le_2pct"] = idle["ours"] <= 2.0
    if "cma" in idle:
        out["idle_cma_le_2pct"] = idle["cma"] <= 2.0
    return out


if __name__ == "__main__":
    main()
