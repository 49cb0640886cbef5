"""``serve run examples/ray_serve.yaml``'s builder: the application graph of pd-disagg on Ray Serve.

Serve imports ``build_app`` (the config's ``import_path``) in ``serve run``'s process and calls it with the
config's ``args``. It checks the Ray version and the arguments there, before anything is deployed, then binds
the router (the application's ingress) with the two engine deployments, and with the ``Autoscaler`` deployment
when the arguments have ``autoscale:``. Replica counts and resources are Serve's deployment options, set per
deployment name in the config's ``deployments:`` list (``Prefill``, ``Decode``, ``PDRouter``, ``Autoscaler``);
with the autoscaler they are its starting counts, and the application needs ``external_scaler_enabled: true``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from ray import serve
from ray.serve.deployment import Application

from pd_disagg.ray_serve.app_config import parse_args
from pd_disagg.ray_serve.autoscaler import AUTOSCALER, AutoscalerReplica
from pd_disagg.ray_serve.deployments import ROUTER, EngineReplica, RouterReplica
from pd_disagg.ray_serve.router_config import STAND_IN_DECODE, router_config
from pd_disagg.ray_serve.versions import check_version

#: Deployment name of each role's engines.
ENGINE_DEPLOYMENTS = {"prefill": "Prefill", "decode": "Decode"}


def build_app(args: dict[str, Any]) -> Application:
    """The application: ``PDRouter`` bound with ``Prefill`` and ``Decode`` (raises on a bad argument)."""
    check_version()
    parsed = parse_args(args)
    router_config(parsed, [], [STAND_IN_DECODE])
    plain = msgspec.to_builtins(parsed)
    engines = {
        role: serve.deployment(name=name)(EngineReplica).bind(role, plain)
        for role, name in ENGINE_DEPLOYMENTS.items()
    }
    router = serve.deployment(name=ROUTER)(RouterReplica)
    if parsed.autoscale is None:
        return router.bind(plain, **engines)
    # Bound by the router so that one graph deploys all; the autoscaler finds the router by name at start.
    scaler = serve.deployment(name=AUTOSCALER)(AutoscalerReplica).bind(plain, ENGINE_DEPLOYMENTS)
    return router.bind(plain, **engines, autoscaler=scaler)
