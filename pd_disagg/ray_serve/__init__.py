"""pd-disagg on Ray Serve: one application (``serve run examples/ray_serve.yaml``) deploys prefill and decode
vLLM servers with PDConnector and pd-router in front of them (docs/ray.md).

One job per module: ``versions`` (the Ray release gate), ``app_config`` (the application's arguments, parsed
and checked once), ``engine_command`` (a replica's vLLM command line and kv-transfer-config), ``router_config``
(pd-router's configuration from the arguments and the registered replicas), ``deployments`` (the Serve
deployments that run those processes), ``autoscaler`` (the ``Autoscaler`` deployment running
``pd_disagg.autoscale``'s controller, and its Serve REST scaler) and ``app`` (the builder ``serve run``
imports). Only ``deployments``, ``autoscaler`` and ``app`` import Ray; the rest is plain data, unit-tested
without it.
"""
