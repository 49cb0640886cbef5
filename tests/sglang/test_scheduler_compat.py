"""pd_connector.sglang.compat.scheduler on the installed SGLang (its virtualenv): the SLO scheduler's start-up
check passes, names a parameter SGLang dropped, and its hooks wrap SGLang's ``Scheduler`` through SGLang's own
``HookRegistry`` when ``PD_SGLANG_SCHEDULER=slo`` (the way ``pd_connector.sglang.plugin.register`` runs)."""

from __future__ import annotations

from tests.sglang.installed import run_in_sglang

CHECK_INSTALLED = """
import logging
from pd_connector.sglang.compat import scheduler as compat
assert compat.startup_problem() is None, compat.startup_problem()
from pd_connector.sglang import plugin
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.plugins.hook_registry import HookRegistry
names = ("__init__", "get_new_batch_prefill", "run_batch", "process_batch_result")
originals = {name: getattr(Scheduler, name) for name in names}
logging.disable(logging.CRITICAL)
plugin.register()
HookRegistry.apply_hooks()
for name, original in originals.items():
    chain = [getattr(Scheduler, name)]
    while hasattr(chain[-1], "__wrapped__") and chain[-1] is not original:
        chain.append(chain[-1].__wrapped__)
    assert chain[0] is not original and chain[-1] is original, name
from sglang.srt.managers.schedule_policy import PrefillAdder
PrefillAdder.__init__ = lambda self, page_size, rem_chunk_tokens: None
problem = compat.startup_problem()
assert "PrefillAdder.__init__(num_mixed_decode_tokens)" in problem and "sglang 0.5.23" in problem, problem
print("ok")
"""


def test_the_installed_sglang_passes_and_the_hooks_wrap_its_scheduler() -> None:
    run_in_sglang(CHECK_INSTALLED, {"PD_SGLANG_SCHEDULER": "slo"})
