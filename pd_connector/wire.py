"""The router <-> engine wire contract: the request-body fields that carry P/D transfer instructions.

One definition for every party (docs/wire-contract.md is its prose): pd-router builds each leg's body from
these (``router/upstream.py``) and strips ``TRANSFER_FIELDS`` from every client body; the vLLM connector's
scheduler side parses a request's ``kv_transfer_params`` with ``parse_params``; ``pd_disagg.pd_client``,
the benchmarks and the tests speak it through the same constructors. Importing it does not import vLLM.

These fields instruct an engine to hold blocks, dial a peer or push KV, so nothing a client sends may carry
them (docs/architecture.md ``## Trust model``): a router sets its own, and the connector still checks each
request's role against its ``kv_role`` and each prefill address against its allow-list.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

#: The body field vLLM hands to the KV connector (``Request.kv_transfer_params``).
KV_TRANSFER_PARAMS = "kv_transfer_params"
#: The body fields SGLang's disaggregation reads (where P's bootstrap server is, which request to pair).
SGLANG_BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")
#: Top-level body fields only a router may set: pd-router drops them from every client request.
TRANSFER_FIELDS = frozenset({KV_TRANSFER_PARAMS, *SGLANG_BOOTSTRAP_FIELDS})

#: A transfer id: pd-router's uuid4 hex, or P's vLLM request id in the standard flow.
TransferId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:-]+$", min_length=1, max_length=200)]
#: ``host:port`` of a prefill side channel (IPv6 hosts in brackets).
PrefillAddr = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$", max_length=300)]
#: A token id; the engine that uses one also checks it against its vocabulary.
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class PushPrefill(msgspec.Struct, frozen=True):
    """P's leg in our push flow: prefill, keep the blocks for the D that asks for ``pd_transfer_id``."""

    pd_transfer_id: TransferId
    pd_role: Literal["prefill"] = "prefill"
    #: Test only: honoured when P runs with ``test_allow_corruption`` (zeroes the pushed KV).
    pd_test_corrupt: bool = False


class PushDecode(msgspec.Struct, frozen=True):
    """D's leg in our push flow: load the prompt of ``pd_transfer_id`` from P's side channel.

    ``pd_seed_first_token``: continue from P's first sampled token (which P's ``Done`` carries over the side
    channel) instead of sampling one's own; pd-router sets it only when it streams P's token to the client.
    """

    pd_transfer_id: TransferId
    pd_prefill_addr: PrefillAddr
    pd_role: Literal["decode"] = "decode"
    pd_seed_first_token: bool = False


class StandardPrefill(msgspec.Struct, frozen=True):
    """P's leg in vLLM's standard flow (what vLLM's own proxies send): prefill for a remote decode."""

    do_remote_decode: Literal[True] = True
    do_remote_prefill: Literal[False] = False
    remote_engine_id: None = None
    remote_block_ids: None = None
    remote_host: None = None
    remote_port: None = None


class PrefillReturned(msgspec.Struct, frozen=True):
    """What P answers in ``kv_transfer_params`` (both flows); in vLLM's standard flow it is D's leg.

    ``pd_seed_first_token``: as in ``PushDecode``; P never sets it, pd-router does on D's leg.
    ``pd_first_token``: the token P sampled after the prompt (P sets it when it has one). A seeded D takes it
    from P's ``Done``, and from here when ``Done`` never came (P died after answering, the connection broke):
    it then prefills the prompt itself and still continues from the token the client was streamed.
    """

    pd_transfer_id: TransferId
    pd_prefill_addr: PrefillAddr
    do_remote_prefill: Literal[True] = True
    do_remote_decode: Literal[False] = False
    remote_engine_id: None = None
    remote_block_ids: None = None
    remote_host: None = None
    remote_port: None = None
    pd_seed_first_token: bool = False
    pd_first_token: TokenId | None = None


#: Every shape an engine may receive; ``parse_params`` says which one a request carries.
Params = PushPrefill | PushDecode | StandardPrefill | PrefillReturned


_NEEDED: dict[type[Params], tuple[str, ...]] = {
    PushPrefill: ("pd_transfer_id", "pd_test_corrupt"),
    PushDecode: ("pd_transfer_id", "pd_prefill_addr", "pd_seed_first_token"),
    PrefillReturned: ("pd_transfer_id", "pd_prefill_addr", "pd_seed_first_token", "pd_first_token"),
}
#: Optional fields left out of ``encode``'s output while unset (False or None), so legs that do not use them
#: stay as they were.
_QUIET_FIELDS = ("pd_test_corrupt", "pd_seed_first_token", "pd_first_token")


def encode(params: Params) -> dict[str, Any]:
    """The JSON-ready dict for a body's ``kv_transfer_params`` (the optional fields only when set)."""
    out: dict[str, Any] = msgspec.to_builtins(params)
    for name in _QUIET_FIELDS:
        if name in out and (out[name] is False or out[name] is None):
            del out[name]
    return out


class BadParams(ValueError):
    """``kv_transfer_params`` that name no valid role; the message says what is wrong (no values echoed)."""


def parse_params(raw: Any) -> Params | None:
    """Which P/D instruction ``raw`` (a request's ``kv_transfer_params``) carries; None when it carries none.

    Decided by ``pd_role`` when present, else by vLLM's ``do_remote_decode`` / ``do_remote_prefill``. Raises
    ``BadParams`` for a dict that asks for a role but lacks or mistypes what the role needs, and for anything
    that is not a dict: the caller serves such a request locally and counts it, never crashes.
    """
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise BadParams(f"kv_transfer_params must be an object, got {type(raw).__name__}")
    role = raw.get("pd_role")
    shape: type[Params]
    if role == "prefill":
        shape = PushPrefill
    elif role == "decode":
        shape = PushDecode
    elif role is not None:
        raise BadParams("unknown pd_role (expected 'prefill' or 'decode')")
    elif raw.get("do_remote_decode") is True:
        return StandardPrefill()
    elif raw.get("do_remote_prefill") is True:
        shape = PrefillReturned
    else:
        return None
    # Only the fields the role needs: the rest (other connectors' remote_* values) is not ours to check.
    fields = {f: raw[f] for f in _NEEDED[shape] if f in raw}
    try:
        return msgspec.convert(fields, shape, strict=True)
    except msgspec.ValidationError as e:
        raise BadParams(f"kv_transfer_params for {shape.__name__}: {e}") from None
