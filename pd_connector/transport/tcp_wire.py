"""Wire format of the TCP fallback: msgspec frames behind a 4-byte length, and the descriptor peers exchange.

A frame is a 4-byte big-endian header length, a msgspec-msgpack header (one of the Structs below, tagged),
then the payload its header announces (``Put.length`` bytes, or ``PutBlocks.count`` little-endian int32
destination block indices followed by ``count * block_bytes`` bytes). Who uses it: ``tcp_sender`` (P) encodes
what ``tcp_receiver`` (D) decodes, and ``tcp`` puts the descriptor into ``register``'s answer.
"""

from __future__ import annotations

import struct

import msgspec

from .regions import RegionInfo

PROTOCOL_VERSION = 1
#: The 4-byte big-endian length in front of every header.
LENGTH = struct.Struct("!I")
#: Headers are a few dozen bytes; anything larger is garbage.
MAX_HEADER_BYTES = 1024


class TcpDescriptor(msgspec.Struct, frozen=True):
    """What ``register`` publishes: where to connect, the token to present, and the region table."""

    version: int
    host: str
    port: int
    token: bytes
    regions: list[RegionInfo]


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    version: int
    token: bytes


class Put(msgspec.Struct, frozen=True, tag="put"):
    region: int
    offset: int
    length: int


class PutBlocks(msgspec.Struct, frozen=True, tag="blocks"):
    """``count`` blocks of ``block_bytes`` into ``region``: the payload is ``count`` int32 destination block
    indices followed by the blocks themselves. Small runs travel this way, one frame per ~4 MiB, gathered and
    scattered by numpy, so a 4 KiB-block write is not thousands of frames."""

    region: int
    block_bytes: int
    count: int


class Flush(msgspec.Struct, frozen=True, tag="flush"):
    seq: int


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    seq: int


Frame = Hello | Put | PutBlocks | Flush | Ack
encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Frame)


def encode_frame(frame: Frame) -> bytes:
    """Length-prefixed header (the payload of a ``Put`` follows it on the wire)."""
    header = encoder.encode(frame)
    return LENGTH.pack(len(header)) + header


class FrameError(Exception):
    """A peer sent something that is not our protocol (the connection is dropped)."""
