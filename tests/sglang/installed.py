"""Run a check script in the SGLang virtualenv (the main one has no SGLang): the unit tests that need the
installed SGLang's real classes (``test_compat.py``, with ``scheduler_check.py``) call ``run_in_sglang``."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from pd_disagg.engines import sglang_python
from pd_disagg.sglang_cpu import STAND_INS_DIR

ROOT = Path(__file__).resolve().parents[2]


def run_in_sglang(code: str, env: Mapping[str, str] | None = None) -> None:
    """Run ``code`` with the SGLang virtualenv's interpreter (repository and stand-ins on the path); it must
    exit 0 and print ``ok`` last. A missing virtualenv fails, never skips (``make unit`` builds it)."""
    python = sglang_python()
    assert os.path.exists(python), f"no SGLang virtualenv at {python}: run `make sglang-env` (make unit does)"
    path = os.pathsep.join(filter(None, [str(STAND_INS_DIR), str(ROOT)]))
    done = subprocess.run(
        [python, "-W", "ignore", "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
