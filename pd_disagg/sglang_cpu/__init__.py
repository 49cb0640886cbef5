"""What SGLang needs to run on a CPU-only machine (tests, benchmarks, the demo; never production GPUs).

SGLang imports packages at module level all over ``sglang.srt`` that have no working CPU build on PyPI: its
CUDA kernel package ``sgl_kernel``, and ``torchvision`` (the PyPI wheel is built against CUDA torch and fails
to import next to torch+cpu; SGLang only needs it for vision models). The CPU code paths this project
exercises (text models, no Intel AMX, ``torch_native`` attention) are plain torch and never call into them, so
``stand_ins/`` holds pure-Python stand-ins (``stub.py``) whose names import and only raise when used.

``STAND_INS_DIR`` goes first on ``PYTHONPATH`` of SGLang server processes (``pd_disagg.engines.sglang_server``),
so the stand-ins are visible only to the servers we start, never to the main environment nor to a GPU install.
"""

from __future__ import annotations

from pathlib import Path

STAND_INS_DIR = Path(__file__).resolve().parent / "stand_ins"
