"""vLLM adapter of pd_connector: ``PDConnector``, a ``KVConnectorBase_V1`` that pushes KV layer by layer.

- ``connector.py``: the facade vLLM instantiates (scheduler and worker roles).
- ``scheduler_side.py``: per-request bookkeeping in the EngineCore process; ``metadata.py``: what it sends
  the worker each step.
- ``worker_side.py``: the hooks next to the KV tensors; ``sender.py`` (P's side channel and pushes) and
  ``receiver.py`` (D's loads) speak ``wire.py`` over one TCP connection per transfer.
- ``plugin.py``: the ``vllm.general_plugins`` entry point registering the name ``PDConnector``.
Importing this package does not import vLLM; only the modules above do.
"""
