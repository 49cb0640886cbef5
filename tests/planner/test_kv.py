"""KV sizes from HF configs against hand-computed values (GQA, MHA, MLA) and link parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner import kv

LLAMA3_70B = {
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_size": 8192,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}


def test_llama3_70b_is_320_kib_per_token() -> None:
    size = kv.kv_size(LLAMA3_70B, 4096, link_bytes_per_s=50e9)
    # 2 (K, V) * 80 layers * 8 KV heads * 128 dims * 2 bytes = 327680 B = 320 KiB
    assert (size.attention, size.bytes_per_token) == ("gqa", 327680)
    assert size.bytes_per_request == 327680 * 4096  # 1.34 GB
    assert size.transfer_s == pytest.approx(1342177280 / 50e9)  # 26.8 ms


def test_mla_stores_latent_plus_rope_key() -> None:
    size = kv.kv_size(DEEPSEEK_V3, 1)
    # 61 layers * (512 + 64) * 2 bytes = 70272 B, not 2 * 61 * 128 * 192 * 2
    assert (size.attention, size.bytes_per_token, size.head_dim) == ("mla", 70272, 576)
    assert kv.kv_size(DEEPSEEK_V3, 1, dtype="fp8").bytes_per_token == 35136


def test_tiny_model_config_file(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_size": 256,
        "dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    # 2 * 4 * 2 * 64 * 2 = 2048 B/token, read from the folder or the file
    assert kv.kv_size(kv.load_config(tmp_path), 10).bytes_per_token == 2048
    assert kv.kv_size(kv.load_config(tmp_path / "config.json"), 10).bytes_per_request == 20480


def test_mha_default_kv_heads_and_multimodal_text_config(tmp_path: Path) -> None:
    text = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text}))
    size = kv.kv_size(kv.load_config(tmp_path), 1)
    # no num_key_value_heads: MHA, head_dim 64 / 4 = 16 -> 2 * 2 * 4 * 16 * 4 bytes
    assert (size.attention, size.bytes_per_token) == ("mha", 2 * 2 * 4 * 16 * 4)


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [("400Gbps", 50e9), ("100Gb/s", 12.5e9), ("50GB/s", 50e9), ("12.5 GBps", 12.5e9), ("1e3Mbps", 125e6)],
)
def test_parse_link(text: str, bytes_per_s: float) -> None:
    assert kv.parse_link(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["fast", "400", "400Gbit", "-1Gbps"])
def test_parse_link_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected e\.g\. 400Gbps"):
        kv.parse_link(text)


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(kv.KVConfigError, match="cannot read model config"):
        kv.load_config(tmp_path)
    (tmp_path / "config.json").write_text("[")
    with pytest.raises(kv.KVConfigError, match="not valid JSON"):
        kv.load_config(tmp_path)
    with pytest.raises(kv.KVConfigError, match="unknown dtype 'int3'"):
        kv.kv_size({**LLAMA3_70B, "torch_dtype": "int3"}, 1)
