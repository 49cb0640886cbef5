"""Does vLLM's CPU MLA backend answer a prompt the same alone and inside a batch? (No transfer involved.)

Why PDConnector refuses MLA on vLLM's CPU platform (docs/architecture.md ``## GPU KV caches and attention
layouts``): a P -> D answer can only be checked against P's if the engine gives one prompt one greedy answer.
This runs the random DeepSeek-V2-style ``tiny-mla`` model (``pd_disagg.tiny_model``, built if missing) in vLLM's
offline ``LLM``, in this process, float32, greedy, and asks the same prompt: alone ``--reps`` times, then twice
in one batch, then beside another prompt. It prints each answer with its top-1 logprob margins (how far each
greedy choice was from a tie) on stderr; the last stdout line is the JSON summary, ``consistent`` true only if
every answer of the prompt is the one it gets alone. The same script on the tiny Llama (``--model``) is the
control: its answers agree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from pd_disagg.tiny_model import PRESETS, build

ROOT = Path(__file__).resolve().parent.parent


def _answers(outputs: list[Any]) -> list[dict[str, Any]]:
    """Token ids and top-1 margins (logprob of the chosen token minus the runner-up's) of each output."""
    rows = []
    for out in outputs:
        o = out.outputs[0]
        margins = []
        for position in o.logprobs:
            best = sorted((lp.logprob for lp in position.values()), reverse=True)
            margins.append(round(best[0] - best[1], 4))
        rows.append({"tokens": list(o.token_ids), "margins": margins})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "models" / "tiny-mla")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--core", default="1", help="VLLM_CPU_OMP_THREADS_BIND for the engine")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: nothing to clean up
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.core)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not (args.model / "config.json").exists():
        print(f"building {args.model}", file=sys.stderr)
        build(args.model, PRESETS["tiny-mla"])
    from pd_connector.vllm.compat import install_version_shim

    install_version_shim()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(args.model),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        distributed_executor_backend="uni",
        seed=0,
    )
    rng = random.Random(5)
    prompt = TokensPrompt(prompt_token_ids=[rng.randrange(10, 1000) for _ in range(args.prompt_tokens)])
    other = TokensPrompt(prompt_token_ids=[rng.randrange(10, 1000) for _ in range(args.prompt_tokens)])
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=2)

    def run(prompts: list[TokensPrompt]) -> list[dict[str, Any]]:
        return _answers(llm.generate(prompts, greedy, use_tqdm=False))

    alone = [run([prompt])[0] for _ in range(args.reps)]
    pair = run([prompt, prompt])
    beside = run([prompt, other])[0]
    for name, row in [
        *((f"alone {i}", a) for i, a in enumerate(alone)),
        ("pair 0", pair[0]),
        ("pair 1", pair[1]),
        ("beside another", beside),
    ]:
        print(f"{name:>15}: {row['tokens']} margins {row['margins']}", file=sys.stderr)
    reference = alone[0]["tokens"]
    answers = [a["tokens"] for a in (*alone, *pair, beside)]
    summary = {
        "model": args.model.name,
        "alone": [a["tokens"] for a in alone],
        "pair": [p["tokens"] for p in pair],
        "beside_another": beside["tokens"],
        "min_margin_alone": min(min(a["margins"]) for a in alone),
        "consistent": all(a == reference for a in answers),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
