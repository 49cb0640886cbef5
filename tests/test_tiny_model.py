"""The tiny model builder is deterministic and reuses what it built."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_disagg.tiny_model import PRESETS, ModelSpec, build, main

TINY = PRESETS["tiny"]  # the model the tests and the demo use


def test_build_is_deterministic_and_cached(tmp_path: Path) -> None:
    a = build(tmp_path / "a", TINY)
    b = build(tmp_path / "b", TINY)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    build(tmp_path / "a", TINY)
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime


def test_tokenizer_round_trips_and_has_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build(tmp_path / "m", TINY))
    text = "def f(x):\n    return x + 1  # ünïcode"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_kv_bytes_per_token() -> None:
    assert ModelSpec().kv_bytes_per_token() == 2 * 4 * 2 * 64 * 2


def test_cli_needs_out_except_for_smollm2(capsys) -> None:
    """Random presets have no default directory (only the converted SmolLM2 has one)."""
    with pytest.raises(SystemExit) as exit_:
        main(["--preset", "tiny"])
    assert exit_.value.code == 2
    assert "--out is required for --preset tiny" in capsys.readouterr().err
