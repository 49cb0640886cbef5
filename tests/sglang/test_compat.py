"""pd_connector.sglang.compat: the start-up check names every missing SGLang internal, and passes on the
installed SGLang (run in the SGLang virtualenv, where SGLang is installed)."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from pd_connector.sglang import compat, plugin
from pd_disagg.engines import sglang_python
from pd_disagg.sglang_cpu import STAND_INS_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_missing_symbols_are_named_and_nothing_is_registered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(compat, "SYMBOLS", ("json:dumps", "json:no_such_thing", "no_such_module:x"))
    problem = compat.startup_problem()
    assert problem is not None
    assert "json:no_such_thing" in problem and "no_such_module:x" in problem and "json:dumps" not in problem
    assert "proven on sglang 0.5.23" in problem
    registered = []
    monkeypatch.setattr(compat, "add_backend_choice", registered.append)
    with caplog.at_level(logging.ERROR, logger=plugin.__name__):
        plugin.register()
    assert registered == [] and "json:no_such_thing" in caplog.text


def test_the_manager_check_names_missing_fields() -> None:
    decode = SimpleNamespace(value="decode")
    complete = {f: 0 for f in compat.MANAGER_FIELDS + compat.DECODE_MANAGER_FIELDS}
    compat.require_manager(SimpleNamespace(**{**complete, "disaggregation_mode": decode}))
    prefill = {f: 0 for f in compat.MANAGER_FIELDS if f != "local_ip"}
    with pytest.raises(RuntimeError, match=r"CommonKVManager\.local_ip") as raised:
        compat.require_manager(
            SimpleNamespace(**{**prefill, "disaggregation_mode": SimpleNamespace(value="prefill")})
        )
    assert "addr_to_rooms_tracker" not in str(raised.value)  # decode-only fields are not asked of P


CHECK_INSTALLED = """
import logging
from pd_connector.sglang import compat, plugin
assert compat.startup_problem() is None, compat.startup_problem()
import pd_connector.sglang.conn  # the Common* bases resolve through compat
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
del CommonKVReceiver._send_abort_notification
problem = compat.startup_problem()
assert "CommonKVReceiver._send_abort_notification" in problem and "sglang 0.5.23" in problem, problem
CommonKVReceiver.send_metadata = lambda self, kv_indices, aux_index=None: None
problem = compat.startup_problem()
assert "CommonKVReceiver.send_metadata(destination)" in problem, problem
logging.disable(logging.CRITICAL)
plugin.register()
from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
assert "pd" not in DISAGG_TRANSFER_BACKEND_CHOICES
print("ok")
"""


def test_the_installed_sglang_passes_and_a_removed_symbol_is_named() -> None:
    python = sglang_python()
    assert os.path.exists(python), f"no SGLang virtualenv at {python}: run `make sglang-env` (make unit does)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(STAND_INS_DIR), str(ROOT)]))}
    done = subprocess.run(
        [python, "-W", "ignore", "-c", CHECK_INSTALLED],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
