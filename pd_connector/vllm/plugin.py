"""``vllm.general_plugins`` entry point: makes ``"kv_connector": "PDConnector"`` resolvable.

vLLM calls ``register()`` in every process it starts (API server, EngineCore, workers) before it builds the
connector; registration is lazy (module path + class name), so importing this is cheap. Calling it twice in
one process is harmless. The factory's registry is vLLM-internal: ``compat.register_connector`` touches it,
and fails naming the missing symbols on a vLLM that lacks them.
"""

from __future__ import annotations

CONNECTOR_NAME = "PDConnector"


def register() -> None:
    from pd_connector.vllm.compat import register_connector

    register_connector(CONNECTOR_NAME, "pd_connector.vllm.connector", "PDConnector")
