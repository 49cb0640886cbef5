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
    channel) instead of sampling one's own; pd-router sets it only when the client is to get P's token.
    ``pd_stream_first_token`` (with it): D's own stream carries P's token as its first, so the client gets it
    as soon as D has it, without waiting for P's answer; D honours it for a request without logprobs only
    (P's token has its logprobs in P's answer alone), and pd-router sets it only then.
    """

    pd_transfer_id: TransferId
    pd_prefill_addr: PrefillAddr
    pd_role: Literal["decode"] = "decode"
    pd_seed_first_token: bool = False
    pd_stream_first_token: bool = False


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

#: A host as vLLM's NixlConnector names its side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``): a name or address.
Host = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:\[\]-]+$", min_length=1, max_length=255)]
#: A TCP port.
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
#: An index into an engine's KV cache blocks, or a count of tokens.
Index = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
#: A parallel size (tensor, decode-context or pipeline ranks).
Ranks = Annotated[int, msgspec.Meta(ge=1, le=4096)]


class NixlReturned(msgspec.Struct, frozen=True):
    """What vLLM 0.32.0's NixlConnector answers from P in ``kv_transfer_params`` (its scheduler's
    ``request_finished``, pull and push mode alike), which is what D's NixlConnector reads to fetch the prompt's
    blocks from P: pd-router's vllm-standard flow re-encodes exactly these fields onto D's leg, once it checked
    ``remote_host`` against the prefill worker that answered (``router/upstream.py``).

    Parsed strictly (``msgspec.convert(..., strict=True)``), other fields left out. ``remote_block_ids``: P's
    blocks per KV cache group; ``remote_blocks_expiry_time``: P answers null (push mode leaves it out). Not a
    shape PDConnector takes, so not in ``Params``.
    """

    remote_engine_id: TransferId
    remote_request_id: TransferId
    remote_host: Host
    remote_port: Port
    remote_block_ids: list[list[Index]]
    remote_num_tokens: Index
    tp_size: Ranks
    dcp_size: Ranks
    pp_size: Ranks
    transfer_mode: Literal["pull", "push"]
    do_remote_prefill: Literal[True]
    do_remote_decode: Literal[False]
    remote_blocks_expiry_time: None = None


_NEEDED: dict[type[Params], tuple[str, ...]] = {
    PushPrefill: ("pd_transfer_id", "pd_test_corrupt"),
    PushDecode: ("pd_transfer_id", "pd_prefill_addr", "pd_seed_first_token", "pd_stream_first_token"),
    PrefillReturned: ("pd_transfer_id", "pd_prefill_addr", "pd_seed_first_token", "pd_first_token"),
}
#: Optional fields left out of ``encode``'s output while unset (False or None), so legs that do not use them
#: stay as they were.
_QUIET_FIELDS = ("pd_test_corrupt", "pd_seed_first_token", "pd_stream_first_token", "pd_first_token")


def encode(params: Params | NixlReturned) -> dict[str, Any]:
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
