"""The handshake that opens a control connection, both sides: what P accepts and what D reveals when.

P (``accept``, on its listener): D's ``Hello`` must speak our protocol version and transport, run the same
integrity mode (``integrity_check``: D expects checksums exactly when P sends them) and carry a layout P can
map onto its own (``layout.check_compatible``, which names every difference); P answers
``HelloAck`` echoing D's nonce (under the shared secret's MAC, when one is set) with its own layout, switches
the connection to the session key, takes D's ``Memory`` (its transport descriptor), attaches its transport to
it and answers ``Ready``. D (``dial``) sends that descriptor only after P's ``HelloAck`` proved it: the
descriptor lets its holder write into D's KV cache. Every read has the connect timeout; anything else drops
the connection with a reason that says what went wrong. Runs on the transfer engine's I/O thread.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

from pd_connector import control
from pd_connector.layout import KVLayout, LayoutMismatch, check_compatible
from pd_connector.protocol import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    Memory,
    ProtocolError,
    Ready,
    Refused,
)
from pd_connector.transfer.context import EngineContext, logger

_READ_ERRORS = (TimeoutError, ProtocolError, asyncio.IncompleteReadError, ConnectionError)


@dataclass(frozen=True)
class Accepted:
    """A decode side P attached its transport to: its engine id, transport peer id and layout."""

    engine_id: str
    peer_id: str
    layout: KVLayout


def refusal(ctx: EngineContext, hello: Hello) -> Refused | None:
    """Why P refuses D's Hello (naming what differs), or None."""
    if hello.version != PROTOCOL_VERSION:
        return Refused(
            f"protocol version mismatch: decode speaks {hello.version}, prefill {PROTOCOL_VERSION}",
            ["version"],
        )
    if hello.transport != ctx.transport.name:
        return Refused(
            f"transport mismatch: decode uses {hello.transport!r}, prefill {ctx.transport.name!r}",
            ["transport"],
        )
    if hello.integrity != ctx.config.integrity_check:
        return Refused(
            f"integrity_check mismatch: decode {'on' if hello.integrity else 'off'}, prefill "
            f"{'on' if ctx.config.integrity_check else 'off'} (set it alike on both)",
            ["integrity"],
        )
    if len(hello.nonce) != NONCE_BYTES:
        return Refused(f"hello nonce must be {NONCE_BYTES} bytes, got {len(hello.nonce)}", ["nonce"])
    if hello.layout_hash != hello.layout.compat_hash():
        return Refused("layout_hash does not match the layout sent", ["layout_hash"])
    try:
        check_compatible(ctx.layout, hello.layout)
    except LayoutMismatch as e:
        return Refused(str(e), list(e.fields))
    return None


async def accept(ctx: EngineContext, conn: control.Connection) -> Accepted | None:
    """P's side: the decode side behind ``conn`` once attached and told ``Ready``; None when it was refused or
    dropped (logged and counted in ``rejected_connections``)."""
    timeout = ctx.config.connect_timeout_s
    hello: object = None
    try:
        hello = await conn.read_message(timeout)
        if not isinstance(hello, Hello):
            raise ProtocolError(f"expected hello, got {type(hello).__name__}")
        refused = refusal(ctx, hello)
        memory: Memory | None = None
        if refused is None:
            nonce = secrets.token_bytes(NONCE_BYTES)
            conn.send(
                HelloAck(ctx.config.engine_id, ctx.layout.compat_hash(), nonce, hello.nonce, ctx.layout)
            )
            conn.codec = conn.codec.session(hello.nonce, nonce)
            reply = await conn.read_message(timeout)
            if not isinstance(reply, Memory):
                raise ProtocolError(f"expected memory, got {type(reply).__name__}")
            memory = reply
    except _READ_ERRORS as e:
        if isinstance(e, asyncio.IncompleteReadError) and not e.partial and hello is None:
            # Connected and left without a byte: a decode's liveness probe (``Receiver._probe``), not a peer.
            logger.debug("control: %s connected and closed without a hello", conn.peer)
            return None
        ctx.count(rejected_connections=1)
        logger.error("control: rejecting connection from %s: %r", conn.peer, e)
        return None
    peer_id = f"{hello.engine_id}#{conn.id}"
    if memory is not None:
        try:
            attach = ctx.transport.attach(peer_id, memory.descriptor)
            await asyncio.wait_for(asyncio.wrap_future(attach), timeout)
        except Exception as e:
            ctx.transport.detach(peer_id)
            refused = Refused(f"cannot attach {ctx.transport.name} transport to decode memory: {e!r}")
    if refused is not None:
        ctx.count(rejected_connections=1)
        logger.error("control: refusing %s (%s): %s", hello.engine_id, conn.peer, refused.reason)
        conn.send(refused)
        return None
    conn.send(Ready())
    logger.info("control: decode %s connected from %s", hello.engine_id, conn.peer)
    return Accepted(hello.engine_id, peer_id, hello.layout)


async def dial(ctx: EngineContext, addr: str, conn: control.Connection, memory: bytes) -> KVLayout | str:
    """D's side on a fresh connection to P at ``addr``: P's layout once P is ready for Destinations, or why
    not (refused, unproven, timed out). ``memory`` (our transport descriptor) goes out only after P's proof."""
    cfg, layout = ctx.config, ctx.layout
    nonce = secrets.token_bytes(NONCE_BYTES)
    conn.send(
        Hello(
            PROTOCOL_VERSION,
            cfg.engine_id,
            layout,
            layout.compat_hash(),
            ctx.transport.name,
            nonce,
            cfg.integrity_check,
        )
    )
    try:
        reply = await conn.read_message(cfg.connect_timeout_s)
        if isinstance(reply, HelloAck):
            if reply.echo != nonce or len(reply.nonce) != NONCE_BYTES:
                return f"prefill {addr} answered the handshake without echoing our nonce"
            prefill = reply.layout
            conn.codec = conn.codec.session(nonce, reply.nonce)
            conn.send(Memory(memory))
            reply = await conn.read_message(cfg.connect_timeout_s)
            if isinstance(reply, Ready):
                return prefill
    except _READ_ERRORS as e:
        return f"handshake with prefill {addr} failed: {e!r}"
    if isinstance(reply, Refused):
        return f"prefill {addr} refused the handshake: {reply.reason}"
    return f"prefill {addr} answered the handshake with {type(reply).__name__}"
