"""Control-plane framing: round trips, foreign bytes, size limits, HMAC."""

from __future__ import annotations

import msgspec
import pytest

from pd_connector.layout import KVLayout
from pd_connector.protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Destinations,
    Done,
    FrameCodec,
    Heartbeat,
    Hello,
    HelloAck,
    LayerDone,
    Memory,
    Message,
    ProtocolError,
    Ready,
    Refused,
)

LAYOUT = KVLayout(
    num_layers=2,
    block_tokens=16,
    num_kv_heads=1,
    head_dim=8,
    dtype="float32",
    kv_split=True,
    token_major=True,
)
MESSAGES: list[Message] = [
    Hello(PROTOCOL_VERSION, "d0", LAYOUT, LAYOUT.compat_hash(), "tcp", b"n" * 16),
    HelloAck("p0", LAYOUT.compat_hash(), b"p" * 16, b"n" * 16, LAYOUT),
    Memory(b"\x00\x01desc"),
    Ready(),
    Refused("dtype differs", ["dtype"]),
    Destinations("t", 40, 3.5, block_ids=[4, 2, 9]),
    Destinations("t", 40, 3.5, layer_block_ids=[[1, 2, 3], [4, 5, 6]]),
    LayerDone("t", 1, 4096),
    Done("t", 40, first_token=17),
    Done("t", 40),
    Abort("t", "client went away"),
    Abort("t", "timed out", failure=True),
    Ack("t"),
    Heartbeat(12.5),
]


def _roundtrip(codec: FrameCodec, frame: bytes) -> Message:
    length = codec.parse_header(frame[: HEADER.size])
    assert length == len(frame) - HEADER.size
    return codec.decode(frame[HEADER.size :])


@pytest.mark.parametrize("secret", [None, b"s3cret"])
@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: Message, secret: bytes | None) -> None:
    codec = FrameCodec(secret)
    assert _roundtrip(codec, codec.encode(message)) == message


def test_foreign_bytes_fail_the_magic_check() -> None:
    with pytest.raises(ProtocolError, match="bad magic"):
        FrameCodec().parse_header(b"GET / HT")


def test_oversized_frames_are_refused_both_ways() -> None:
    codec = FrameCodec(max_frame_bytes=64)
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes"):
        codec.parse_header(HEADER.pack(MAGIC, 65))
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes"):
        codec.encode(Destinations("t", 1, 1.0, block_ids=list(range(100))))


def test_undecodable_payloads_are_protocol_errors() -> None:
    codec = FrameCodec()
    with pytest.raises(ProtocolError, match="undecodable"):
        codec.decode(b"\xc1garbage")
    with pytest.raises(ProtocolError, match="undecodable"):
        codec.decode(msgspec.msgpack.encode({"type": "nonsense"}))
    with pytest.raises(ProtocolError, match="undecodable"):  # right tag, wrong field type
        codec.decode(msgspec.msgpack.encode({"type": "ack", "transfer_id": 5}))


def test_wrong_or_missing_hmac_is_rejected() -> None:
    frame = FrameCodec(b"right").encode(Ack("t"))
    with pytest.raises(ProtocolError, match="HMAC mismatch"):
        FrameCodec(b"wrong").decode(frame[HEADER.size :])
    unsigned = FrameCodec().encode(Ack("t"))
    with pytest.raises(ProtocolError, match="HMAC mismatch"):
        FrameCodec(b"right").decode(unsigned[HEADER.size :])
    tampered = bytearray(frame)
    tampered[-1] ^= 1
    with pytest.raises(ProtocolError, match="HMAC mismatch"):
        FrameCodec(b"right").decode(bytes(tampered[HEADER.size :]))


def test_session_keys_bind_frames_to_one_connection() -> None:
    """After the handshake both sides MAC with a key from the secret and both nonces: a frame recorded on
    one connection (or signed with the bare secret) fails on any other; without a secret nothing changes."""
    secret = FrameCodec(b"s3cret")
    one, same = secret.session(b"d" * 16, b"p" * 16), secret.session(b"d" * 16, b"p" * 16)
    other = secret.session(b"d" * 16, b"q" * 16)
    frame = one.encode(Ack("t"))
    assert same.decode(frame[HEADER.size :]) == Ack("t")
    for codec in (other, secret):
        with pytest.raises(ProtocolError, match="HMAC mismatch"):
            codec.decode(frame[HEADER.size :])
    with pytest.raises(ProtocolError, match="HMAC mismatch"):
        one.decode(secret.encode(Ack("t"))[HEADER.size :])
    plain = FrameCodec()
    assert plain.session(b"d" * 16, b"p" * 16) is plain
