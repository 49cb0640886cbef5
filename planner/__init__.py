"""SLO-aware capacity planner for prefill/decode disaggregation (``pd-plan``).

Modules, one job each: ``profile`` (the measured profile file and its validation), ``model`` (the planning
formulas), ``kv`` (KV-cache size and transfer time from a HF config), ``simulator`` (discrete-event xPyD
simulation), ``profiler`` (measures a profile on a live OpenAI-compatible server), ``plots`` (PNG figures)
and ``cli`` (the ``pd-plan`` command); for ``pd-plan trace``: ``trace`` (lognormal lengths, rate over the day),
``tails`` (per-instance capacity against percentile SLOs), ``schedule`` (replicas over time: start-time lead,
scale-down hold) and ``fleet`` (the day plan per method and its sampled simulation).
"""
