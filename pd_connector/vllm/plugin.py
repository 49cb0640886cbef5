"""``vllm.general_plugins`` entry point: makes ``"kv_connector": "PDConnector"`` resolvable.

vLLM calls ``register()`` in every process it starts (API server, EngineCore, workers) before it builds the
connector; registration is lazy (module path + class name), so importing this is cheap. Calling it twice in
one process is harmless.
"""

from __future__ import annotations

CONNECTOR_NAME = "PDConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "pd_connector.vllm.connector", "PDConnector")
