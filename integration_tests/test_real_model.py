"""SmolLM2-135M-Instruct (``pd_disagg.smollm2``, the demo's model) on real vLLM CPU servers, in float32.

The converted weights must be the model and not noise: vLLM's greedy tokens equal those transformers generates
from the same directory, and the model knows that Paris is the capital of France. Then P->D on a real model:
each answer equals the colocated one (a plain request to P, whose prefix cache holds only KV P computed), and
``pd_checks.Transfers`` proves the KV moved (exact bytes on both sides, one load per request, nothing failed,
refused or recomputed). The conversion itself is pinned: the same wheel gives the same bytes, and converting
again is a no-op.

One P (core 0) and one D (core 1) serve the whole module, and generations are short: CI time stays small.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integration_tests.pd_checks import BLOCK_TOKENS, Transfers, blocks_to_load
from pd_disagg import pd_client, smollm2
from pd_disagg.demo import LONG_PROMPT
from pd_disagg.engines import base_url, vllm_server
from pd_disagg.servers import ManagedServer, free_port

#: SHA-256 of the converted weights: what ``make smollm2`` wrote on the machine that pinned it.
MODEL_SHA256 = "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"
QUESTION = "What is the capital of France?"
# ~40, ~40 and ~300 tokens: one and two KV blocks, and ten (the demo's long prompt).
QUESTIONS = [QUESTION, "Write a Python function that adds two numbers.", LONG_PROMPT]
MAX_TOKENS = 16
SECRET = "integration-secret"
SERVED_NAME = "smollm2"


def kv_block_bytes(model: Path, dtype_bytes: int = 4) -> int:
    """Bytes of one KV block of ``model`` (K and V, every layer) in a dtype of ``dtype_bytes``."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes
    return BLOCK_TOKENS * int(per_token)


@dataclass(frozen=True)
class Cluster:
    """The module's P and D servers and the address D dials P at."""

    p_url: str
    d_url: str
    bootstrap: str


def _server(
    model: Path, log_dir: Path, role: str, core: int, kv_transfer_config: dict[str, Any]
) -> ManagedServer:
    return vllm_server(
        model,
        log_dir=log_dir,
        name=f"real-{role}",
        dtype="float32",
        cpu_core=core,
        extra_args=["--served-model-name", SERVED_NAME],
        kv_transfer_config=kv_transfer_config,
    )


@pytest.fixture(scope="module")
def cluster(start_servers, smollm2_model: Path, log_dir: Path) -> Iterator[Cluster]:
    side_channel_port = free_port()
    bootstrap = f"127.0.0.1:{side_channel_port}"
    prefill_config = {
        "kv_connector": "PDConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"side_channel_port": side_channel_port, "secret": SECRET},
    }
    decode_config = {
        "kv_connector": "PDConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"secret": SECRET, "allowed_prefill_addrs": [bootstrap]},
    }
    prefill = _server(smollm2_model, log_dir, "prefill", 0, prefill_config)
    decode = _server(smollm2_model, log_dir, "decode", 1, decode_config)
    start_servers(prefill, decode)
    yield Cluster(base_url(prefill), base_url(decode), bootstrap)


@pytest.fixture(scope="module")
def prompts(smollm2_model: Path) -> list[list[int]]:
    """The chat prompts as token ids, rendered by the model's own chat template (as the engines render it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    texts = [
        str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
        )
        for q in QUESTIONS
    ]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]


def body(prompt: list[int]) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }


def token_ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def colocated(cluster: Cluster, prompt: list[int]) -> list[int]:
    return token_ids(pd_client.post_json(cluster.p_url + "/v1/completions", body(prompt)))


def test_conversion_is_pinned_and_reused(smollm2_model: Path) -> None:
    """A plain Llama config (no GGUF quantization marker), the pinned bytes, and a second convert does nothing."""
    config = json.loads((smollm2_model / "config.json").read_text())
    assert "quantization_config" not in config
    shape = [config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")]
    assert [*shape, config["num_key_value_heads"]] == [30, 576, 9, 3]
    weights = smollm2_model / "model.safetensors"
    marker = json.loads((smollm2_model / smollm2.MARKER).read_text())
    assert marker["files"]["model.safetensors"] == smollm2.sha256(weights) == MODEL_SHA256
    mtime = weights.stat().st_mtime_ns
    said: list[str] = []
    assert smollm2.convert(smollm2_model, say=said.append) == smollm2_model
    assert said == [] and weights.stat().st_mtime_ns == mtime


def test_greedy_tokens_match_transformers(
    cluster: Cluster, smollm2_model: Path, prompts: list[list[int]]
) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32)
    served = [colocated(cluster, prompt) for prompt in prompts]
    for question, prompt, tokens in zip(QUESTIONS, prompts, served, strict=True):
        with torch.no_grad():
            # transformers 5.19 annotates generate's self with a protocol its own models do not match.
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)  # type: ignore[misc]
        assert tokens == out[0, len(prompt) :].tolist(), f"question {question[:30]!r}"
    answer = AutoTokenizer.from_pretrained(smollm2_model).decode(served[0])
    assert "Paris" in answer, answer


def test_disaggregated_equals_colocated(
    cluster: Cluster, smollm2_model: Path, prompts: list[list[int]]
) -> None:
    """P computed each prompt before (the reference), so its prefix cache covers it and D holds none of it:
    D loads every block of every prompt from P."""
    references = [colocated(cluster, p) for p in prompts]
    transfers = Transfers(cluster.p_url, cluster.d_url, block_bytes=kv_block_bytes(smollm2_model))
    for prompt, reference in zip(prompts, references, strict=True):
        answer, p_answer = pd_client.disaggregated(
            cluster.p_url, cluster.d_url, cluster.bootstrap, body(prompt)
        )
        assert isinstance(p_answer, dict), f"P leg failed: {p_answer!r}"
        assert token_ids(answer) == reference, f"{len(prompt)} tokens"
    transfers.check(len(prompts), blocks=sum(blocks_to_load(len(p)) for p in prompts))
