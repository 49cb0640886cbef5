"""KV-cache size per token and per request from a Hugging Face ``config.json``, and its transfer time.

Called by ``pd-plan kv`` to tell users how many bytes a P node ships to a D node and how long that takes on
their link (the main part of the TTFT overhead in the profile). Standard attention stores K and V:
``2 * layers * kv_heads * head_dim * bytes``; MLA models (DeepSeek-V2/V3: ``kv_lora_rank`` in the config)
store one compressed latent plus the decoupled RoPE key: ``layers * (kv_lora_rank + qk_rope_head_dim) * bytes``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec

DTYPE_BYTES = {
    "float32": 4.0,
    "fp32": 4.0,
    "float16": 2.0,
    "fp16": 2.0,
    "half": 2.0,
    "bfloat16": 2.0,
    "bf16": 2.0,
    "float8": 1.0,
    "fp8": 1.0,
    "float8_e4m3fn": 1.0,
    "float8_e5m2": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
_LINK_UNITS = {
    "bps": 1 / 8,
    "kbps": 1e3 / 8,
    "mbps": 1e6 / 8,
    "gbps": 1e9 / 8,
    "tbps": 1e12 / 8,
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "tb/s": 1e12,
}


class KVConfigError(ValueError):
    """The model config cannot be read or lacks what the KV size needs."""


class KVSize(msgspec.Struct, frozen=True):
    """Result of ``kv_size``: the layout that was used and the sizes it gives."""

    attention: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_token: float
    tokens: int
    bytes_per_request: float
    link_bytes_per_s: float | None = None
    transfer_s: float | None = None


def load_config(model: str | Path) -> dict[str, Any]:
    """The HF config dict from a model folder or a config.json path (multimodal: its ``text_config``)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise KVConfigError(f"{path}: cannot read model config: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise KVConfigError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise KVConfigError(f"{path}: expected a JSON object")
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _require_int(config: dict[str, Any], *names: str) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and value > 0:
            return value
    raise KVConfigError(f"model config has no positive integer {' / '.join(names)}")


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype.lower().removeprefix("torch.")]
    except KeyError:
        raise KVConfigError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}") from None


def parse_link(text: str) -> float:
    """Link speed to bytes/s: ``400Gbps``, ``400Gb/s`` (bits) or ``50GB/s`` (bytes), case of b/B matters."""
    match = re.fullmatch(
        r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(bps|b/s|B/s|Bps)\s*", text
    )
    if not match:
        raise ValueError(f"link speed {text!r}: expected e.g. 400Gbps, 100Gb/s or 50GB/s")
    value, prefix, unit = match.groups()
    bits = unit in ("bps", "b/s")
    key = prefix.lower() + ("bps" if bits else "b/s")
    return float(value) * _LINK_UNITS[key]


def kv_size(
    config: dict[str, Any], tokens: int, dtype: str | None = None, link_bytes_per_s: float | None = None
) -> KVSize:
    """KV bytes per token and for ``tokens`` tokens; ``dtype`` overrides the config's (e.g. an fp8 KV cache)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    layers = _require_int(config, "num_hidden_layers", "n_layer", "num_layers")
    dtype_name = dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    element = dtype_bytes(dtype_name)
    if config.get("kv_lora_rank"):
        latent = _require_int(config, "kv_lora_rank")
        rope = int(config.get("qk_rope_head_dim") or 0)
        attention, kv_heads, head_dim = "mla", 1, latent + rope
        per_token = layers * head_dim * element
    else:
        heads = _require_int(config, "num_attention_heads", "n_head")
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or 0) or _require_int(config, "hidden_size", "n_embd") // heads
        attention = "mha" if kv_heads == heads else "gqa"
        per_token = 2 * layers * kv_heads * head_dim * element
    per_request = per_token * tokens
    return KVSize(
        attention=attention,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype_name,
        bytes_per_token=per_token,
        tokens=tokens,
        bytes_per_request=per_request,
        link_bytes_per_s=link_bytes_per_s,
        transfer_s=per_request / link_bytes_per_s if link_bytes_per_s else None,
    )
