"""Foreign bytes on the TCP data port: that connection is dropped and logged, every other one keeps working."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from pd_connector.transport.base import BlockCopy, MemoryRegion
from pd_connector.transport.tcp import TcpTransport
from pd_connector.transport.tcp_wire import PROTOCOL_VERSION, Hello, Put, PutBlocks, encode_frame
from tests.polling import wait_until

BLOCKS, BLOCK_BYTES = 16, 1024


def _hello(token: bytes) -> bytes:
    return encode_frame(Hello(PROTOCOL_VERSION, token))


ATTACKS: dict[str, bytes | Callable[[bytes], bytes]] = {
    "http request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "huge header length": struct.pack("!I", 1 << 30),
    "undecodable header": struct.pack("!I", 3) + b"\xc1\xc1\xc1",
    "put before hello": encode_frame(Put(0, 0, 8)) + b"\0" * 8,
    "wrong token": _hello(b"x" * 16),
    "put outside the region": lambda token: _hello(token) + encode_frame(Put(0, BLOCKS * BLOCK_BYTES, 8)),
    "oversized frame": lambda token: _hello(token) + encode_frame(Put(0, 0, 1 << 40)),
    "blocks of the wrong size": lambda token: _hello(token) + encode_frame(PutBlocks(0, 512, 1)),
    "block index out of range": lambda token: (
        _hello(token)
        + encode_frame(PutBlocks(0, BLOCK_BYTES, 1))
        + struct.pack("<i", BLOCKS)
        + b"\1" * BLOCK_BYTES
    ),
}


def test_garbage_connections_are_dropped_and_others_keep_working(caplog: pytest.LogCaptureFixture) -> None:
    receiver, sender = TcpTransport(), TcpTransport()
    dst = np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    src = np.random.default_rng(3).integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    try:
        descriptor = receiver.register([MemoryRegion(0, dst.ctypes.data, dst.nbytes, BLOCK_BYTES)])
        token = msgspec.msgpack.decode(descriptor)["token"]
        sender.register([MemoryRegion(0, src.ctypes.data, src.nbytes, BLOCK_BYTES)])
        sender.attach("d", descriptor).result(10)  # a good connection, open during the attacks
        caplog.set_level(logging.ERROR, logger="pd_connector.transport.tcp_receiver")
        for name, attack in ATTACKS.items():
            payload = attack(token) if callable(attack) else attack
            with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as sock:
                sock.sendall(payload)
                sock.settimeout(5)
                try:
                    closed = sock.recv(1) == b""
                except ConnectionResetError:  # the receiver aborts (RST) rather than closing politely
                    closed = True
                assert closed, f"{name}: connection was not closed by the receiver"
        wait_until(
            lambda: receiver.dropped_connections == len(ATTACKS), 5, "every attack's connection dropped"
        )
        assert sum("dropping data connection" in r.message for r in caplog.records) == len(ATTACKS)
        assert not dst.any(), "an attack wrote into registered memory"
        assert (
            sender.write("d", [BlockCopy(0, i, BLOCKS - 1 - i) for i in range(BLOCKS)]).result(10)
            == src.nbytes
        )
        assert (dst == src[::-1]).all()
    finally:
        sender.close()
        receiver.close()
