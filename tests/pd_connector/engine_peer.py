"""A real ``TransferEngine`` in its own process, driven by JSON commands on stdin, for cross-process tests.

``python -m tests.pd_connector.engine_peer --role decode|prefill --kind tcp|cma|ucx [--tls T] [--layout JSON]``
builds the KV cache (prefill: seeded random bytes, decode: zeros; the same ``KVCache`` as the tests), the
transport through the factory and the engine, then prints ``READY <side-channel address or ->`` and obeys one
JSON command per line: ``expect`` / ``offer`` / ``push`` / ``finish`` / ``abort`` (the engine calls, same
argument names), ``exit``. Every ended transfer is printed as ``RESULT <json>`` with, on the decode side, the
sha256 of the tokens it holds for that transfer (so the test compares bytes without shared memory).
"""

from __future__ import annotations

import argparse
import hashlib
import queue
import sys
import threading
import uuid

import msgspec

from pd_connector.layout import KVLayout
from pd_connector.transfer import TransferConfig, TransferEngine
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.ucx import UcxConfig
from tests.pd_connector.engines import KVCache

FAST = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.5, "abort_grace_s": 1.0}


def token_digest(cache: KVCache, blocks: list[int], num_tokens: int, start_token: int) -> str:
    """sha256 over every region's bytes of tokens ``[start_token, num_tokens)`` held in ``blocks``."""
    h = hashlib.sha256()
    cut = start_token * cache.layout.token_bytes
    for region in range(len(cache.arrays)):
        h.update(cache.tokens(region, blocks, num_tokens)[cut:])
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["decode", "prefill"], required=True)
    parser.add_argument("--kind", choices=["tcp", "cma", "ucx"], required=True)
    parser.add_argument("--tls", default="")
    parser.add_argument("--layout", required=True)
    parser.add_argument("--blocks", type=int, default=64)
    args = parser.parse_args()
    layout = msgspec.json.decode(args.layout, type=KVLayout)
    cache = KVCache(layout, args.blocks, seed=1 if args.role == "prefill" else None)
    transport = create_transport(TransportConfig(kind=args.kind, ucx=UcxConfig(tls=args.tls)))
    config = TransferConfig(
        engine_id=f"{args.role}-{uuid.uuid4().hex[:6]}",
        listen_port=0 if args.role == "prefill" else None,
        **FAST,  # type: ignore[arg-type]
    )
    engine = TransferEngine(config, layout, cache.buffers(), transport)
    print("READY", engine.address or "-", flush=True)
    commands: queue.Queue[dict[str, object] | None] = queue.Queue()
    expected: dict[str, tuple[list[int], int, int]] = {}

    def read_stdin() -> None:
        for line in sys.stdin:
            commands.put(msgspec.json.decode(line))
        commands.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    while True:
        try:
            cmd = commands.get(timeout=0.01)
        except queue.Empty:
            cmd = {}
        if cmd is None or cmd.get("cmd") == "exit":
            break
        name = cmd.pop("cmd", None)
        if name == "expect":
            expected[str(cmd["transfer_id"])] = (
                list(cmd["dst_blocks"]),  # type: ignore[call-overload]
                int(cmd["num_tokens"]),  # type: ignore[call-overload]
                int(cmd.get("start_token", 0)),  # type: ignore[call-overload]
            )
        if name is not None:
            getattr(engine, str(name))(**cmd)
        for result in engine.poll():
            out = msgspec.json.decode(msgspec.json.encode(result))
            if result.transfer_id in expected:
                out["digest"] = token_digest(cache, *expected.pop(result.transfer_id))
            print("RESULT", msgspec.json.encode(out).decode(), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
