"""A minimal blocking control-plane peer built on the real ``protocol`` module, for adversarial tests.

Used in-process (foreign bytes, version mismatch, a peer that goes silent) and as a subprocess that the
tests kill mid-transfer: ``python -m tests.pd_connector.raw_peer decode HOST:PORT LAYOUT_JSON DESCRIPTOR_HEX``
handshakes as a decode side (Hello, HelloAck, Memory, Ready), sends Destinations for transfer ``killme`` and prints every message it receives,
one per line, until it is killed. ``python -m tests.pd_connector.raw_peer prefill LAYOUT_JSON`` listens as a
prefill side, prints ``listening PORT``, accepts one decode, acknowledges its handshake, answers its
Destinations with ``LayerDone`` for layer 0 and then sends heartbeats until it is killed.
"""

from __future__ import annotations

import secrets
import socket
import sys
import threading
import time

import msgspec

from pd_connector.layout import KVLayout
from pd_connector.protocol import (
    HEADER,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Destinations,
    FrameCodec,
    Heartbeat,
    Hello,
    HelloAck,
    LayerDone,
    Memory,
    Message,
    Ready,
)


class RawPeer:
    """One blocking TCP connection speaking framed control messages."""

    def __init__(self, sock: socket.socket, secret: bytes | None = None) -> None:
        self.sock = sock
        self.codec = FrameCodec(secret)
        self.lock = threading.Lock()

    @classmethod
    def connect(cls, addr: str, secret: bytes | None = None) -> RawPeer:
        host, port = addr.rsplit(":", 1)
        return cls(socket.create_connection((host, int(port)), timeout=5), secret)

    def send(self, message: Message) -> None:
        with self.lock:
            self.sock.sendall(self.codec.encode(message))

    def recv(self) -> Message | None:
        """Next message, or None when the other side closed the connection."""
        header = self.read_exactly(HEADER.size)
        if header is None:
            return None
        payload = self.read_exactly(self.codec.parse_header(header))
        return None if payload is None else self.codec.decode(payload)

    def handshake(self, hello: Hello, memory: bytes) -> Message | None:
        """As a decode side: ``hello``, then (once acknowledged) ``memory``; returns P's last answer (``Ready``
        when accepted, ``Refused`` or the unexpected message otherwise, None when P closed)."""
        self.send(hello)
        ack = self.recv()
        if not isinstance(ack, HelloAck):
            return ack
        self.codec = self.codec.session(hello.nonce, ack.nonce)
        self.send(Memory(memory))
        return self.recv()

    def closed_by_peer(self, timeout_s: float = 5.0) -> bool:
        """True once the other side closed the connection (reads EOF or a reset) within ``timeout_s``."""
        self.sock.settimeout(timeout_s)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def read_exactly(self, n: int) -> bytes | None:
        """``n`` raw bytes, or None when the other side closed first."""
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def hello(layout: KVLayout, transport: str = "loopback", version: int = PROTOCOL_VERSION) -> Hello:
    return Hello(
        version, "raw-decode", layout, layout.compat_hash(), transport, secrets.token_bytes(NONCE_BYTES)
    )


def _heartbeats(peer: RawPeer) -> None:
    while True:
        peer.send(Heartbeat(time.monotonic()))
        time.sleep(0.1)


def main() -> None:
    role = sys.argv[1]
    if role == "decode":
        addr, layout_json, descriptor = sys.argv[2], sys.argv[3], bytes.fromhex(sys.argv[4])
        layout = msgspec.json.decode(layout_json, type=KVLayout)
        peer = RawPeer.connect(addr)
        peer.sock.settimeout(None)
        ready = peer.handshake(hello(layout), descriptor)
        print(type(ready).__name__, flush=True)
        if isinstance(ready, Ready):
            threading.Thread(target=_heartbeats, args=(peer,), daemon=True).start()
            peer.send(Destinations("killme", 8, 30.0, block_ids=[1, 2]))
        while (msg := peer.recv()) is not None:
            print(type(msg).__name__, flush=True)
    else:
        layout = msgspec.json.decode(sys.argv[2], type=KVLayout)
        server = socket.create_server(("127.0.0.1", 0))
        print("listening", server.getsockname()[1], flush=True)
        sock, _ = server.accept()
        peer = RawPeer(sock)
        peer.sock.settimeout(None)
        while (msg := peer.recv()) is not None:
            if isinstance(msg, Hello):
                nonce = secrets.token_bytes(NONCE_BYTES)
                peer.send(HelloAck("raw-prefill", layout.compat_hash(), nonce, msg.nonce, layout))
                peer.codec = peer.codec.session(msg.nonce, nonce)
            elif isinstance(msg, Memory):
                peer.send(Ready())
                threading.Thread(target=_heartbeats, args=(peer,), daemon=True).start()
            elif isinstance(msg, Destinations):
                peer.send(LayerDone(msg.transfer_id, 0, 1))
            print(type(msg).__name__, flush=True)


if __name__ == "__main__":
    main()
