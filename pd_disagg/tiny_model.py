"""Build a deterministic random-weight Llama and a byte-level BPE tokenizer, entirely offline.

No model hub is reachable from the machines this project is tested on, so tests, benchmarks and the demo use a
model built here: weights drawn from a fixed seed (std ~0.08, so greedy decoding is not degenerate), saved as
bf16 safetensors, and a tokenizer trained on the Python standard library's sources (always on disk), with
bos/eos/pad tokens and a small chat template. The same arguments always give the same files.

Called by ``make model`` (CLI ``pd-tiny-model``) and by benchmarks that need a larger model. The CLI's
``--preset smollm2`` instead converts the real SmolLM2-135M-Instruct (``pd_disagg.smollm2``, ``make smollm2``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pd_disagg import smollm2

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass(frozen=True)
class _Spec:
    """What every random model has, whatever its attention: its size, and the seed and spread of its weights."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    seed: int = 0
    init_std: float = 0.08


@dataclass(frozen=True)
class ModelSpec(_Spec):
    """Shape of the random Llama. Defaults are the test model; ``PRESETS`` names the larger ones."""

    num_kv_heads: int = 2
    head_dim: int = 64

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """Bytes of K and V per token over all layers (the quantity the connector moves)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_elem


@dataclass(frozen=True)
class MLASpec(_Spec):
    """Shape of a random DeepSeek-V2-style model with multi-head latent attention (MLA): its KV cache is one
    latent vector per token and layer (``kv_lora_rank + qk_rope_head_dim``), no K/V heads. vLLM's CPU MLA
    kernel takes latents of 576 only (DeepSeek's 512 + 64), so those two stay; the rest is small. MoE layers
    are left out (every layer dense): the test is about the cache, not the experts."""

    num_layers: int = 2
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """Bytes of the latent per token over all layers (the quantity the connector moves)."""
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_elem


PRESETS: dict[str, ModelSpec | MLASpec] = {
    "tiny": ModelSpec(),
    # Large enough that a ~2k-token prefill takes seconds on a CPU (head-of-line blocking, layer overlap).
    "bench": ModelSpec(
        num_layers=12,
        hidden_size=1024,
        num_heads=8,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=2816,
        vocab_size=4096,
        max_position_embeddings=4096,
        init_std=0.04,
    ),
    "tiny-mla": MLASpec(),
}


def bench_model() -> Path:
    """The model benchmarks use: ``PD_BENCH_MODEL`` if set, else the ``bench`` preset built (once) into this
    checkout's ``.cache/models/bench-llama``. Called by ``python -m benchmarks.*`` in the harness process."""
    env = os.environ.get("PD_BENCH_MODEL")
    if env:
        return Path(env)
    return build(
        Path(__file__).resolve().parent.parent / ".cache" / "models" / "bench-llama", PRESETS["bench"]
    )


def _training_files(limit: int = 400) -> list[str]:
    """Python standard library sources, sorted so training sees the same text in the same order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[:limit]


def build_tokenizer(vocab_size: int) -> object:
    """Train a byte-level BPE on local text; returns a ``PreTrainedTokenizerFast`` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: Path, spec: ModelSpec | MLASpec) -> Path:
    """Write config, bf16 safetensors and tokenizer to ``out`` atomically; reuse it if already built."""
    marker = out / "pd_tiny_model.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    import torch

    tokenizer = build_tokenizer(spec.vocab_size)
    torch.manual_seed(spec.seed)
    model = _llama(spec, tokenizer) if isinstance(spec, ModelSpec) else _deepseek_v2(spec, tokenizer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, spec.init_std)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
        (tmp / "pd_tiny_model.json").write_text(json.dumps(asdict(spec), indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _config_args(spec: ModelSpec | MLASpec, tokenizer: Any) -> dict[str, Any]:
    """The Hugging Face config arguments every random model takes from its spec and tokenizer."""
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.init_std,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _deepseek_v2(spec: MLASpec, tokenizer: Any) -> Any:
    """A DeepSeek-V2 model of ``spec`` (random weights drawn by the caller)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        **_config_args(spec, tokenizer),
        num_key_value_heads=spec.num_heads,
        kv_lora_rank=spec.kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        first_k_dense_replace=spec.num_layers,  # every layer dense
    )
    return DeepseekV2ForCausalLM(config)


def _llama(spec: ModelSpec, tokenizer: Any) -> Any:
    """A Llama model of ``spec`` (random weights drawn by the caller)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **_config_args(spec, tokenizer), num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        help=f"directory to write the model into (required, except for smollm2: default {smollm2.DEFAULT_DIR})",
    )
    parser.add_argument(
        "--preset",
        choices=[*sorted(PRESETS), "smollm2"],
        default="tiny",
        help="a random model, or smollm2: the real SmolLM2-135M-Instruct converted from PyPI (pd_disagg.smollm2)",
    )
    args = parser.parse_args(argv)
    if args.preset == "smollm2":
        try:
            path = smollm2.convert(args.out or smollm2.DEFAULT_DIR)
        except smollm2.SourceMissing as exc:
            parser.exit(1, f"pd-tiny-model: {exc}\n")
        print(f"model ready at {path} (SmolLM2-135M-Instruct, bf16)")
        return 0
    if args.out is None:
        parser.error(f"--out is required for --preset {args.preset}")
    spec = PRESETS[args.preset]
    path = build(args.out, spec)
    print(
        f"model ready at {path} ({spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.kv_bytes_per_token()} KV bytes/token)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
