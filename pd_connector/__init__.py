"""pd_connector: move the KV cache from prefill (P) to decode (D) engine processes.

Layers, bottom up (engine-agnostic core first, engine adapters last; pd_connector/README.md walks them top
down and has the support matrix):
- ``transport/``: data plane. Registers KV memory and writes block runs into a peer's registered memory
  (UCX through ``ucxx``: shared memory on one host, tcp/RDMA across hosts; ``cma``: ``process_vm_writev``
  between processes of one host; or the asyncio TCP fallback).
- ``protocol``, ``control``, ``layout``, ``trust``, ``transfer/``: control plane (messages, framed
  connections on an I/O thread), the KV layout check, the peer policy, and the per-request transfer engine
  (handshake, leases, timeouts, abort, metrics), shared by both engines.
- ``wire``: the request fields a router sends each engine (docs/wire-contract.md).
- ``settings``: the transfer settings both adapters and the engine share, defined once, and their parser.
- ``metrics``: the transfer metrics both adapters export (what an ended transfer counts, Prometheus names).
- ``vllm/`` and ``sglang/``: thin adapters that map each engine's connector API onto the transfer engine.
"""
