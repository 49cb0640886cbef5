"""The autoscaler on Ray Serve: a Serve deployment that runs ``pd_disagg.autoscale``'s controller.

Why a deployment of the application (``Autoscaler``, one replica) and not a process next to the head: Serve
deploys it with ``serve run`` (one command, no second thing to start or to stop), restarts it when it dies, and
removes it with the application; it reaches pd-router through the router deployment's handle
(``RouterReplica.metrics_text``), wherever either replica runs, so pd-router may keep listening on loopback.
Its state (the metrics window, the hold timers) is lost on a restart: the new replica starts a fresh window and
decides nothing until it has two scrapes, then never scales down before a whole hold time.

``RayServeScaler`` is the controller's ``Scaler``: it reads each engine deployment's replicas from the Ray
dashboard's Serve REST API (``GET /api/serve/applications/``: ``target_num_replicas`` and each replica's
state) and sets a count with ``POST /api/v1/applications/<app>/deployments/<name>/scale`` and the body
``{"target_num_replicas": N}`` (Ray 2.60, ``ray/dashboard/modules/serve/serve_head.py``). Serve accepts that only
for an application deployed with ``external_scaler_enabled: true`` (its config, next to ``name:``; it answers
412 otherwise), which also turns Serve's own autoscaling off for it. The dashboard runs on the head
(``ray start --head`` with the ``ray[default]`` extra; port 8265 by default).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import msgspec
import ray
from ray import serve

from pd_disagg.autoscale.controller import Controller
from pd_disagg.autoscale.metrics import serve as serve_metrics
from pd_disagg.autoscale.policy import Replicas
from pd_disagg.autoscale.settings import check
from pd_disagg.ray_serve.app_config import AppArgs
from pd_disagg.ray_serve.deployments import ROUTER

log = logging.getLogger("ray.serve")

#: The autoscaler deployment's name in the application.
AUTOSCALER = "Autoscaler"
#: Seconds a call to the dashboard or the router may take.
CALL_TIMEOUT_S = 10.0
#: Replica states that will serve but do not yet (Ray's ``ReplicaState``); RUNNING serves; STOPPING and
#: STOPPED are leaving.
STARTING_STATES = frozenset({"STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION"})
DASHBOARD_PORT = 8265


def replicas_from_details(
    details: dict[str, Any], app: str, deployments: dict[str, str]
) -> dict[str, Replicas]:
    """Each role's replicas from the dashboard's ``/api/serve/applications/`` answer (``ServeInstanceDetails``);
    ``deployments`` maps a role to its deployment's name. Raises ``KeyError`` naming what is missing."""
    try:
        found = details["applications"][app]["deployments"]
    except (KeyError, TypeError):
        raise KeyError(f"application {app!r} is not deployed") from None
    out = {}
    for role, name in deployments.items():
        if name not in found:
            raise KeyError(f"deployment {name!r} not in application {app!r}")
        states = [r.get("state") for r in found[name].get("replicas", [])]
        out[role] = Replicas(
            running=states.count("RUNNING"),
            starting=sum(s in STARTING_STATES for s in states),
            target=int(found[name]["target_num_replicas"]),
        )
    return out


def scale_path(app: str, deployment: str) -> str:
    return f"/api/v1/applications/{app}/deployments/{deployment}/scale"


def default_dashboard_url(gcs_address: str) -> str:
    """The head's dashboard at its default port, from the GCS address ``host:port`` (the head's)."""
    host = gcs_address.rsplit(":", 1)[0]
    return f"http://{host}:{DASHBOARD_PORT}"


class RayServeScaler:
    """Reads and sets the engine deployments' replica counts through the dashboard's Serve REST API."""

    def __init__(self, dashboard_url: str, app: str, deployments: dict[str, str]) -> None:
        self._url = dashboard_url.rstrip("/")
        self._app, self._deployments = app, deployments
        self._timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)

    async def replicas(self) -> dict[str, Replicas]:
        async with (
            aiohttp.ClientSession(timeout=self._timeout) as session,
            session.get(f"{self._url}/api/serve/applications/") as resp,
        ):
            if resp.status != 200:
                raise RuntimeError(f"dashboard: GET applications: {resp.status} {await resp.text()}")
            return replicas_from_details(await resp.json(), self._app, self._deployments)

    async def scale(self, role: str, target: int) -> None:
        url = self._url + scale_path(self._app, self._deployments[role])
        async with (
            aiohttp.ClientSession(timeout=self._timeout) as session,
            session.post(url, json={"target_num_replicas": target}) as resp,
        ):
            if resp.status != 200:
                hint = (
                    " (deploy the application with external_scaler_enabled: true)"
                    if resp.status == 412
                    else ""
                )
                raise RuntimeError(
                    f"dashboard: scale {role} to {target}: {resp.status} {await resp.text()}{hint}"
                )


class AutoscalerReplica:
    """Runs the controller for this application's ``Prefill`` and ``Decode`` deployments as a task of the
    replica's event loop; ``deployments`` maps each role to its deployment's name. pd-router's metrics come
    through the ``PDRouter`` deployment's handle."""

    async def __init__(self, args: dict[str, Any], deployments: dict[str, str]) -> None:  # type: ignore[misc]
        parsed = msgspec.convert(args, AppArgs)
        assert parsed.autoscale is not None  # app.build_app binds this deployment only with autoscale set
        settings = parsed.autoscale
        dashboard = parsed.dashboard_url or default_dashboard_url(ray.get_runtime_context().gcs_address)
        app = serve.get_replica_context().app_name
        router = serve.get_deployment_handle(ROUTER, app_name=app)

        async def scrape() -> str:
            text: str = await asyncio.wait_for(router.metrics_text.remote(), CALL_TIMEOUT_S)
            return text

        scaler = RayServeScaler(dashboard, app, deployments)
        # Serve's logger: its lines land in this replica's log file (docs/ray.md shows one).
        self._controller = Controller(settings, check(settings), scrape, scaler, logger=log)
        self._runner = None
        if settings.metrics_port:
            self._runner = await serve_metrics(
                self._controller.metrics, settings.metrics_host, settings.metrics_port
            )
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._controller.run(self._stop))
        log.info("%s: scaling %s of %s through %s", AUTOSCALER, deployments, app, dashboard)

    async def check_health(self) -> None:
        """Fail (Serve replaces the replica) when the controller's loop ended."""
        if self._task.done():
            error = None if self._task.cancelled() else self._task.exception()
            raise RuntimeError(f"the autoscaling loop ended: {error!r}")

    async def __del__(self) -> None:
        self._stop.set()
        await asyncio.wait([self._task], timeout=CALL_TIMEOUT_S)
        if self._runner is not None:
            await self._runner.cleanup()
