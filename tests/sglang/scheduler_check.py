"""The SLO scheduler's check on the installed SGLang, run by ``test_compat.py`` in the same SGLang subprocess as
the transfer backend's (importing SGLang costs ~25 s): ``pd_connector.sglang.compat.scheduler``'s start-up
check passes and names a parameter SGLang dropped, and ``scheduler_plugins.sglang.register`` wraps SGLang's
``Scheduler`` methods through SGLang's own ``HookRegistry`` when ``PD_SGLANG_SCHEDULER=slo``."""

from __future__ import annotations

SLO_SCHEDULER_CHECK = """
from pd_connector.sglang.compat import scheduler as slo_compat
from scheduler_plugins import sglang as slo_scheduler
assert slo_compat.startup_problem() is None, slo_compat.startup_problem()
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.plugins.hook_registry import HookRegistry
names = ("__init__", "get_new_batch_prefill", "run_batch", "process_batch_result", "on_idle")
originals = {name: getattr(Scheduler, name) for name in names}
slo_scheduler.register({"PD_SGLANG_SCHEDULER": "slo"})
HookRegistry.apply_hooks()
for name, original in originals.items():
    chain = [getattr(Scheduler, name)]
    while hasattr(chain[-1], "__wrapped__") and chain[-1] is not original:
        chain.append(chain[-1].__wrapped__)
    assert chain[0] is not original and chain[-1] is original, name
from sglang.srt.managers.schedule_policy import PrefillAdder
PrefillAdder.__init__ = lambda self, page_size, rem_chunk_tokens: None
problem = slo_compat.startup_problem()
assert "PrefillAdder.__init__(num_mixed_decode_tokens)" in problem and "sglang 0.5.23" in problem, problem
"""
