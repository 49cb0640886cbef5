"""Unit tests of the SGLang backend parts that run without SGLang: plugin registration logic, settings,
and the description of an SGLang KV pool for the transfer engine (on real numpy buffers)."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import numpy as np
import pytest

from pd_connector.sglang import compat, plugin
from pd_connector.sglang.compat import read_first_token, write_first_token
from pd_connector.sglang.config import SGLangBackendConfig
from pd_connector.sglang.kv_buffers import UnsupportedPool, describe_pool, resolve_dtype


class Backend(enum.Enum):
    MOONCAKE = "mooncake"
    FAKE = "fake"


def test_unsupported_versions_are_refused_with_reason():
    assert compat.unsupported_reason("0.5.23") is None
    for version in ("0.6.0", "0.5.22", "1.5.23"):
        reason = compat.unsupported_reason(version)
        assert reason is not None and version in reason and "0.5.23" in reason
    assert compat.unsupported_reason(None) == "sglang is not installed"


def test_later_releases_of_the_line_are_checked_by_symbol_and_warned_about():
    assert compat.unsupported_reason("0.5.24") is None  # its internals decide (startup_problem)
    assert compat.unproven_warning("0.5.23") is None and compat.unproven_warning("0.5.23.post1") is None
    warning = compat.unproven_warning("0.5.24")
    assert warning is not None and "0.5.24" in warning and "0.5.23" in warning


def test_missing_parameters_are_named():
    assert compat.missing_parameters({"json:dumps": ("obj", "indent")}) == []
    assert compat.missing_parameters({"json:dumps": ("obj", "no_such_param"), "json:nothing": ("x",)}) == [
        "json:dumps(no_such_param)"  # a missing callable is the symbol check's to name
    ]


def test_extend_enum_adds_a_member_found_by_value_and_is_idempotent():
    member = compat.extend_enum(Backend, "PD", "pd")
    assert Backend("pd") is member
    assert Backend.PD is member  # type: ignore[attr-defined]
    assert member.name == "PD" and member.value == "pd"
    assert compat.extend_enum(Backend, "PD", "pd") is member
    assert [m.value for m in Backend] == ["mooncake", "fake", "pd"]


def test_hook_defers_to_sglang_for_other_backends():
    calls = []

    def original(backend, class_type):
        calls.append((backend, class_type))
        return "sglang-class"

    assert plugin.get_kv_class_hook(original, Backend.MOONCAKE, "manager") == "sglang-class"
    assert calls == [(Backend.MOONCAKE, "manager")]


def test_hook_for_pd_falls_back_to_sglang_when_our_classes_cannot_load():
    # Without SGLang installed our classes cannot import: the hook logs and lets SGLang answer (it raises
    # its own "Unsupported transfer backend" at start-up) instead of raising from inside the hook.
    pd = compat.extend_enum(Backend, "PD", "pd")
    assert plugin.get_kv_class_hook(lambda b, t: ("sglang", b, t), pd, "manager") == ("sglang", pd, "manager")


def test_config_from_env_parses_and_rejects_bad_values():
    cfg = SGLangBackendConfig.from_env(
        {"PD_SGLANG_TRANSPORT": "auto", "PD_SGLANG_LEASE_S": "2.5", "PD_SGLANG_FAULT_WRONG_KV_ROOMS": "1, 22"}
    )
    assert cfg.transport == "auto" and cfg.lease_s == 2.5 and cfg.wrong_kv_rooms == frozenset({1, 22})
    assert SGLangBackendConfig.from_env({}) == SGLangBackendConfig()
    assert SGLangBackendConfig.from_env({"PD_SGLANG_TRANSPORT": "cma"}).transport == "cma"
    with pytest.raises(ValueError, match="PD_SGLANG_LEASE_S"):
        SGLangBackendConfig.from_env({"PD_SGLANG_LEASE_S": "-1"})
    with pytest.raises(ValueError, match="PD_SGLANG_TRANSPORT"):
        SGLangBackendConfig.from_env({"PD_SGLANG_TRANSPORT": "rdma"})
    with pytest.raises(ValueError, match="PD_SGLANG_HEARTBEAT_TIMEOUT_S"):
        SGLangBackendConfig.from_env({"PD_SGLANG_HEARTBEAT_TIMEOUT_S": "soon"})
    policy = SGLangBackendConfig.from_env(
        {"PD_SGLANG_ALLOW_INSECURE": "1", "PD_SGLANG_ALLOWED_PREFILL_ADDRS": "10.0.0.0/8, p0:7600"}
    )
    assert policy.allow_insecure and policy.allowed_prefill_addrs == ("10.0.0.0/8", "p0:7600")
    with pytest.raises(ValueError, match="PD_SGLANG_ALLOW_INSECURE"):
        SGLangBackendConfig.from_env({"PD_SGLANG_ALLOW_INSECURE": "yes"})


def test_resolve_dtype():
    assert resolve_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_dtype("torch.float16", "auto") == "float16"
    assert resolve_dtype(None, "half") == "float16"
    with pytest.raises(UnsupportedPool, match="--dtype"):
        resolve_dtype("auto", "auto")


def _pool(layers=3, pages=10, page_size=2, heads=2, head_dim=4):
    """Buffers shaped like SGLang's MHA pool: K of every layer, then V of every layer."""
    k = [np.zeros((pages * page_size, heads, head_dim), np.float16) for _ in range(layers)]
    v = [np.zeros((pages * page_size, heads, head_dim), np.float16) for _ in range(layers)]
    bufs = k + v
    args = SimpleNamespace(
        kv_data_ptrs=[b.ctypes.data for b in bufs],
        kv_data_lens=[b.nbytes for b in bufs],
        kv_item_lens=[page_size * heads * head_dim * 2] * len(bufs),
        page_size=page_size,
        num_draft_entries=0,
        state_data_ptrs=[],
    )
    return args, k, v


def test_describe_pool_orders_buffers_per_layer_k_then_v():
    args, k, v = _pool()
    layout, buffers = describe_pool(args, "float16", kv_heads=2)
    assert (layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim) == (3, 2, 2, 4)
    assert layout.kv_split and layout.token_major and layout.dtype == "float16"
    assert buffers == [
        (k[0].ctypes.data, k[0].nbytes),
        (v[0].ctypes.data, v[0].nbytes),
        (k[1].ctypes.data, k[1].nbytes),
        (v[1].ctypes.data, v[1].nbytes),
        (k[2].ctypes.data, k[2].nbytes),
        (v[2].ctypes.data, v[2].nbytes),
    ]
    assert len(layout.regions(buffers)) == 6


def test_describe_pool_refuses_what_it_cannot_move():
    args, _k, _v = _pool()
    with pytest.raises(UnsupportedPool, match="heads"):
        describe_pool(args, "float16", kv_heads=3)
    args.num_draft_entries = 2
    with pytest.raises(UnsupportedPool, match="speculative"):
        describe_pool(args, "float16", kv_heads=2)
    args, _k, _v = _pool()
    args.kv_item_lens[-1] = 8  # MLA-like: pages of different sizes
    with pytest.raises(UnsupportedPool, match="MLA"):
        describe_pool(args, "float16", kv_heads=2)


def test_first_token_round_trip_through_metadata_rows():
    # Like SGLang's MetadataBuffers: output_ids int32 [rows, 16] first, bootstrap_room int64 [rows, 8] last.
    output_ids = np.zeros((4, 16), np.int32)
    other = np.zeros((4, 16), np.float32)
    rooms = np.zeros((4, 8), np.int64)
    bufs = [output_ids, other, rooms]
    args = SimpleNamespace(
        aux_data_ptrs=[b.ctypes.data for b in bufs],
        aux_data_lens=[b.nbytes for b in bufs],
        aux_item_lens=[b[0].nbytes for b in bufs],
    )
    compat.require_metadata_rows(args)
    output_ids[2, 0] = 1234
    assert read_first_token(args, 2) == 1234
    write_first_token(args, 1, 777, (1 << 62) + 5)
    assert output_ids[1, 0] == 777 and rooms[1, 0] == (1 << 62) + 5
    assert not other.any() and rooms[[0, 2, 3]].sum() == 0
    for row in (4, -1):  # never an address outside the buffers
        with pytest.raises(IndexError):
            read_first_token(args, row)
        with pytest.raises(IndexError):
            write_first_token(args, row, 1, 1)


def test_metadata_rows_laid_out_otherwise_are_refused_at_start():
    bufs = [np.zeros((4, 8), np.int32), np.zeros((4, 8), np.int64)]  # output_ids rows of 32 bytes
    args = SimpleNamespace(aux_item_lens=[b[0].nbytes for b in bufs])
    with pytest.raises(RuntimeError, match="output_ids"):
        compat.require_metadata_rows(args)
