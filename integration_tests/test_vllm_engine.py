"""A real vLLM CPU server on the tiny model produces exactly the tokens transformers produces."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from pd_disagg.engines import base_url, vllm_server
from pd_disagg.servers import ManagedServer, process_group_members

PROMPTS = [
    "def hello(world):",
    "import os\nimport sys\n\nclass Foo:",
    "The quick brown fox " * 20,
]
MAX_TOKENS = 24


def _complete(url: str, model: str, prompt: str) -> list[int]:
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
    ).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return list(json.load(resp)["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def servers(start_servers, tiny_model: Path, log_dir: Path) -> list[ManagedServer]:
    """The served model's server (core 0) and one for the harness's stop test (core 1), started together:
    two engines load in parallel in about the time of one."""
    return start_servers(
        vllm_server(tiny_model, log_dir=log_dir, name="vllm-f32", dtype="float32", cpu_core=0),
        vllm_server(tiny_model, log_dir=log_dir, name="vllm-stop", dtype="float32", cpu_core=1),
    )


def test_greedy_tokens_match_transformers(servers: list[ManagedServer], tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    server_url = base_url(servers[0])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for prompt in PROMPTS:
        served = _complete(server_url, str(tiny_model), prompt)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            reference = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1] :]
        assert served == reference.tolist(), f"prompt {prompt[:30]!r}"
        assert len(served) == MAX_TOKENS


def test_stopped_server_leaves_no_process(servers: list[ManagedServer]) -> None:
    """The harness kills the whole process group (API server + EngineCore + worker) on stop."""
    server = servers[1]
    pgid = server.pid
    assert process_group_members(pgid), "a running server has processes"
    server.stop()
    assert process_group_members(pgid) == []
