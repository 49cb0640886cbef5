"""vLLM adapter of pd_connector: ``PDConnector``, a ``KVConnectorBase_V1`` that pushes KV layer by layer.

- ``plugin.py``: the ``vllm.general_plugins`` entry point registering the name ``PDConnector``.
- ``connector.py``: the facade vLLM instantiates (scheduler and worker roles); it only routes hooks.
- ``scheduler_side.py``: per-request decisions in the EngineCore process; ``metadata.py``: what it hands
  the worker each step.
- ``worker_side.py``: the hooks next to the KV tensors, driving one ``pd_connector.transfer.TransferEngine``
  (which speaks ``pd_connector.protocol`` to the peer and moves bytes with a ``pd_connector.transport``);
  P's pushes in ``worker_pushes.py``.
- ``config.py``: ``kv_connector_extra_config``; ``stats.py``: the ``vllm:pd_connector_*`` metrics.
- ``compat/``: the vLLM versions it is proven on and every vLLM internal the project touches (also used by
  ``scheduler_plugins.vllm`` and ``pd-vllm``), checked at start.
Reading order and support matrix: pd_connector/README.md. Importing this package does not import vLLM;
``connector``, ``metadata``, ``stats`` and (when called) ``plugin`` and ``compat`` do.
"""
