"""Control-plane messages between a decode side (D, the client) and a prefill side channel (P, the server).

Every message is a msgspec Struct in one tagged union (``Message``), encoded as msgpack: never pickle, so a
peer can at worst send a malformed frame, which is rejected. The conversation on one TCP connection:

    D -> P  Hello(version, engine id, KV layout + hash, transport name, D's nonce, integrity mode)
    P -> D  HelloAck(engine id, layout hash, P's nonce, D's nonce echoed) | Refused(reason naming what differs)
            -- from here on, with a shared secret, frames carry the session MAC (below) --
    D -> P  Memory(D's transport descriptor: where and how P may write into D's KV cache)
    P -> D  Ready | Refused(P cannot reach that memory)
    D -> P  Destinations(transfer id, D block ids, tokens wanted, lease, head slice)   (any number, any time)
    P -> D  LayerDone(transfer id, layer, bytes)                          (after that layer's bytes landed)
    P -> D  Done(transfer id, tokens, first token, checksums in integrity mode)
                                                        (after every write landed; P's blocks are free then)
    either  Abort(transfer id, reason) -> the other answers Ack once it will not touch the blocks again
    either  Heartbeat every ``heartbeat_interval_s``: silence longer than the heartbeat timeout = dead peer

Why D sends its memory descriptor only after ``HelloAck``: the descriptor lets its holder write into D's KV
cache (TCP: the data listener and its token; UCX: remote keys), so D reveals it only to a P that proved the
shared secret on a fresh nonce (an echo of D's nonce under the secret's MAC cannot be replayed from another
connection). Which addresses D dials at all is the peer policy's business (``pd_connector.trust``).

Framing (``FrameCodec``): ``MAGIC`` (4 bytes) + payload length (u32 big-endian) + payload, where payload is
``HMAC-SHA256(key, msgpack)`` (32 bytes, only when a shared secret is configured) followed by the msgpack
bytes. The key is the secret for ``Hello`` and ``HelloAck`` and, after them, the session key
``HMAC-SHA256(secret, "pd-session" + D's nonce + P's nonce)``, so no frame of one connection verifies on
another. Foreign bytes fail the magic check, oversized frames the length check, forged or replayed frames the
HMAC check; each is a ``ProtocolError`` and the connection is dropped.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Union

import msgspec

from pd_connector.layout import HeadSlice, KVLayout

#: Bumped on any incompatible change of the messages below; checked in the handshake.
PROTOCOL_VERSION = 2
#: Bytes of each side's handshake nonce.
NONCE_BYTES = 16
MAGIC = b"PDKV"
HEADER = struct.Struct(">4sI")
MAC_BYTES = 32
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024


class ProtocolError(Exception):
    """A frame that is not ours, too large, unauthenticated or undecodable: drop the connection."""


class Hello(msgspec.Struct, tag="hello"):
    """D's handshake: who it is, how its KV cache is laid out, and a fresh nonce P must echo."""

    version: int
    engine_id: str
    layout: KVLayout
    layout_hash: str
    transport: str
    nonce: bytes
    #: D's ``integrity_check``: P refuses a D whose mode differs from its own (``transfer.handshake``), so
    #: with the mode on D always gets checksums and a D that expects them never meets a P that omits them.
    integrity: bool = False


class HelloAck(msgspec.Struct, tag="hello_ack"):
    """P accepts D's Hello; ``echo`` is D's nonce (under the secret's MAC: P knows the secret, now).

    ``layout``: P's own layout, from which D learns P's tensor-parallel split (which rank holds which heads).
    """

    engine_id: str
    layout_hash: str
    nonce: bytes
    echo: bytes
    layout: KVLayout


class Memory(msgspec.Struct, tag="memory"):
    """D's transport descriptor (what ``Transport.register`` returned): only sent to a P that acknowledged."""

    descriptor: bytes


class Ready(msgspec.Struct, tag="ready"):
    """P attached its transport to D's memory; D may now send Destinations."""


class Refused(msgspec.Struct, tag="refused"):
    """P refuses the handshake; ``reason`` says exactly what differs (version, layout fields, transport)."""

    reason: str
    fields: list[str] = []


class Destinations(msgspec.Struct, tag="destinations"):
    """Where P should write transfer ``transfer_id``: D's block ids in token order.

    ``block_ids`` applies to every layer; ``layer_block_ids`` (one list per layer) overrides it for caches
    whose layers have different block tables. P writes tokens ``[start_token, num_tokens)``: D already holds
    the first ``start_token`` (a local prefix-cache hit, block-aligned) and the tables still start at token 0.
    ``lease_s``: how long from sending D keeps these blocks reserved; P must not write after it.
    ``prompt_hash``: digest of D's prompt tokens (``prompt_digest``; empty: unchecked): P refuses to write a
    transfer whose prompt differs from its own, so a mispaired request never decodes another prompt's KV.
    ``heads``: the KV heads this P rank writes and where they go in D's cache (None: every head, when P and D
    hold the same ones). ``fanout``: how many D ranks send this P rank Destinations for the transfer; P ends it
    once all of them are served.
    """

    transfer_id: str
    num_tokens: int
    lease_s: float
    block_ids: list[int] = []
    layer_block_ids: list[list[int]] | None = None
    start_token: int = 0
    prompt_hash: bytes = b""
    heads: HeadSlice | None = None
    fanout: int = 1


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """16-byte BLAKE2b of a prompt's token ids (both sides compute it the same way from their own prompt)."""
    return hashlib.blake2b(array.array("q", token_ids).tobytes(), digest_size=16).digest()


class LayerDone(msgspec.Struct, tag="layer_done"):
    """P's writes of ``layer`` for this transfer have landed in D's memory (progress and metrics)."""

    transfer_id: str
    layer: int
    bytes: int


class Checksums(msgspec.Struct, array_like=True):
    """Integrity mode: xxh3-64 digests of the KV P wrote into one D rank (``transfer.integrity``).

    ``runs``: per D block table (one shared by every layer, or one per layer) the destination granule runs
    hashed, in hashing order, as little-endian int64 pairs (first granule, granules). ``digests``: one per KV
    buffer (region ids in order: layer by layer, K then V when split), over its table's runs.
    """

    runs: list[bytes]
    digests: list[int]


class Done(msgspec.Struct, tag="done"):
    """Every write of the transfer has landed; ``num_tokens`` were covered; optional first sampled token;
    ``checksums`` of what was written, in integrity mode (D verifies them before it reports the load done)."""

    transfer_id: str
    num_tokens: int
    first_token: int | None = None
    checksums: Checksums | None = None


class Abort(msgspec.Struct, tag="abort"):
    """Give up a transfer; the receiver stops using the blocks and answers ``Ack``.

    ``failure``: True when the sender hit an error (timeout, lease, bad input, write error) rather than
    being asked to abort; the other side then reports FAILED instead of ABORTED.
    """

    transfer_id: str
    reason: str
    failure: bool = False


class Ack(msgspec.Struct, tag="ack"):
    """Answers ``Abort``: the sender of Ack will not touch the transfer's blocks again."""

    transfer_id: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Liveness; ``sent_at`` is the sender's monotonic clock (for logs only, clocks are not compared)."""

    sent_at: float


Message = Union[  # noqa: UP007
    Hello, HelloAck, Memory, Ready, Refused, Destinations, LayerDone, Done, Abort, Ack, Heartbeat
]


class FrameCodec:
    """Encodes and decodes frames for one connection; optional HMAC-SHA256 with a shared secret."""

    def __init__(self, secret: bytes | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._secret = secret or None
        self.max_frame_bytes = max_frame_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    def session(self, decode_nonce: bytes, prefill_nonce: bytes) -> FrameCodec:
        """The codec for the rest of a connection after its handshake: keyed with the session key derived
        from the secret and both nonces (no key without a secret)."""
        if self._secret is None:
            return self
        key = hmac.new(self._secret, b"pd-session" + decode_nonce + prefill_nonce, hashlib.sha256).digest()
        return FrameCodec(key, self.max_frame_bytes)

    def encode(self, message: Message) -> bytes:
        """Full frame (header + optional MAC + msgpack) for ``message``."""
        body = self._encoder.encode(message)
        if self._secret is not None:
            body = hmac.new(self._secret, body, hashlib.sha256).digest() + body
        if len(body) > self.max_frame_bytes:
            raise ProtocolError(f"frame of {len(body)} bytes exceeds max_frame_bytes {self.max_frame_bytes}")
        return HEADER.pack(MAGIC, len(body)) + body

    def parse_header(self, header: bytes) -> int:
        """Validate the 8-byte header; return the payload length to read next."""
        magic, length = HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}: not a pd_connector control frame")
        if length > self.max_frame_bytes:
            raise ProtocolError(f"frame of {length} bytes exceeds max_frame_bytes {self.max_frame_bytes}")
        return int(length)

    def decode(self, payload: bytes) -> Message:
        """Check the MAC (when a secret is set) and decode; raise ``ProtocolError`` on any defect."""
        if self._secret is not None:
            mac, payload = payload[:MAC_BYTES], payload[MAC_BYTES:]
            expected = hmac.new(self._secret, payload, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, expected):
                raise ProtocolError(
                    "HMAC mismatch: peer does not share our secret (or the frame was altered)"
                )
        try:
            return self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(f"undecodable control message: {e}") from e
