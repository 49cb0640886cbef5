"""scheduler_plugins: SLO-aware iteration scheduling for engine servers (colocated, decode and prefill nodes).

Engine-agnostic core first, engine adapter last:
- ``config``: the settings (mode, ITL/TTFT targets, chunk sizes) and where they come from.
- ``cost_model``: predicts an iteration's time from its shape; fitted online from measured step times.
- ``budget``: picks the prefill chunk that keeps the predicted iteration under the ITL target, and the order
  in which waiting prefills are served.
- ``vllm``: ``SLOScheduler``, a thin subclass of vLLM's v1 ``Scheduler`` (``--scheduler-cls``).
- ``sglang``: hooks on SGLang's ``Scheduler`` (``PD_SGLANG_SCHEDULER=slo``) that size each prefill chunk.
"""
