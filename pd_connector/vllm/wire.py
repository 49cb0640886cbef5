"""Messages and framing of the worker-to-worker side channel (one TCP connection per transfer).

D's worker opens a connection to P's side channel and sends ``Hello``; P answers with ``Layer`` messages
(each followed by the raw bytes of its blocks) as soon as each layer is computed, then ``Done``; D replies
``Ack`` once the bytes are in its KV cache, which lets P free its blocks. Either side may send ``Error``
and close; a closed connection means abort. Control messages are msgspec msgpack Structs behind a 4-byte
length prefix (never pickle); bulk KV bytes travel unframed right after their ``Layer`` header.

D's block ids never leave D: P addresses blocks by their index in the request's block table and D maps the
index to its own block.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

import msgspec

PROTOCOL_VERSION = 1
_LEN = struct.Struct("!I")
MAX_CONTROL_BYTES = 1 << 20


class Hello(msgspec.Struct, tag=True, frozen=True):
    """D -> P: "push transfer ``transfer_id``'s blocks ``start_block..end_block-1`` to me", plus layout."""

    version: int
    transfer_id: str
    auth: str
    start_block: int
    end_block: int
    num_layers: int
    block_bytes: int
    dtype: str


class Layer(msgspec.Struct, tag=True, frozen=True):
    """P -> D: ``len(block_indices) * block_bytes`` raw bytes of layer ``layer`` follow this header."""

    layer: int
    block_indices: list[int]


class Done(msgspec.Struct, tag=True, frozen=True):
    """P -> D: every requested block of every layer was sent; ``num_tokens`` prompt tokens are on D."""

    num_tokens: int


class Ack(msgspec.Struct, tag=True, frozen=True):
    """D -> P: all bytes landed; P may free its blocks."""


class Error(msgspec.Struct, tag=True, frozen=True):
    """Either side: the transfer cannot go on (layout mismatch, bad auth, unknown transfer, abort)."""

    reason: str


Message = Hello | Layer | Done | Ack | Error

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def auth_token(secret: str, transfer_id: str) -> str:
    """HMAC-SHA256 of the transfer id under the shared secret ("" when no secret is configured)."""
    if not secret:
        return ""
    return hmac.new(secret.encode(), transfer_id.encode(), hashlib.sha256).hexdigest()


def check_auth(secret: str, transfer_id: str, token: str) -> bool:
    return hmac.compare_digest(auth_token(secret, transfer_id), token)


def send_message(sock: socket.socket, message: Message) -> None:
    body = _encoder.encode(message)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact_into(sock: socket.socket, buf: memoryview) -> None:
    """Fill ``buf`` from the socket; ``ConnectionError`` if the peer closes first."""
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("peer closed the side channel")
        got += n


def recv_message(sock: socket.socket) -> Message:
    head = bytearray(_LEN.size)
    recv_exact_into(sock, memoryview(head))
    (length,) = _LEN.unpack(head)
    if length > MAX_CONTROL_BYTES:
        raise ConnectionError(f"control message of {length} bytes exceeds {MAX_CONTROL_BYTES}")
    body = bytearray(length)
    recv_exact_into(sock, memoryview(body))
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ConnectionError(f"malformed side-channel message: {exc}") from exc
