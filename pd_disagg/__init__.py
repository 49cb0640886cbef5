"""Shared developer tooling for pd-disagg: the tiny local model, the real SmolLM2 model converted from PyPI
(``smollm2``), the vLLM CPU launcher, the engine-server harness used by tests, benchmarks and the demo, and the
demo itself.

The product packages are ``pd_connector``, ``scheduler_plugins``, ``router`` and ``planner``; this package
holds what they all need to be run and proven on a machine without a model hub or a GPU.
"""
