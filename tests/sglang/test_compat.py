"""pd_connector.sglang.compat: the start-up check names every missing SGLang internal, and passes on the
installed SGLang (run in the SGLang virtualenv, where SGLang is installed)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pd_connector.sglang import compat, plugin
from tests.sglang.installed import run_in_sglang
from tests.sglang.scheduler_check import SLO_SCHEDULER_CHECK


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
"""


def test_the_installed_sglang_passes_and_a_removed_symbol_is_named() -> None:
    """The transfer backend's check, then the SLO scheduler's (``scheduler_check``), in one SGLang process."""
    run_in_sglang(CHECK_INSTALLED + SLO_SCHEDULER_CHECK + 'print("ok")')
