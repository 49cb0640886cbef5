"""pd_connector: move the KV cache from prefill (P) to decode (D) engine processes.

Layers, bottom up (engine-agnostic core first, engine adapters last):
- ``transport/``: data plane. Registers KV memory and writes block runs into a peer's registered memory
  (UCX through ``ucxx``: shared memory on one host, tcp/RDMA across hosts; or the asyncio TCP fallback).
- ``protocol``, ``layout``, ``transfer/``: control plane and per-request transfer engine (handshake, leases,
  timeouts, abort, metrics), shared by both engines.
- ``vllm/`` and ``sglang/``: thin adapters that map each engine's connector API onto the transfer engine.
"""
