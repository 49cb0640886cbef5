"""pd-disagg's shipped commands and deployment: the tiny local model, the real SmolLM2 model converted from PyPI
(``smollm2``), the vLLM CPU launcher (``pd-vllm``), the engine-server harness used by tests, benchmarks and the
demo, the demo itself, and the Ray Serve application (``ray_serve``, the ``ray`` extra: P and D vLLM replicas
with PDConnector behind pd-router, ``serve run examples/ray_serve.yaml``).

The product packages are ``pd_connector``, ``scheduler_plugins``, ``router`` and ``planner``; this package
holds what runs them: on a machine without a model hub or a GPU, and on a Ray cluster.
"""
