"""One P/D cluster (and one pd-router in front of it) for every test file of this package.

The files here test PDConnector on real vLLM servers by subject; they share the servers because each start
costs 30-60 s of CPU on two cores. The fixtures are package-scoped: the servers start when the first test
needs them and stop (by PID) after the package's last test, before other integration test files start
their own. Each test names the configuration it needs (``pd``: the default one; ``cluster.ensure(...)``:
another D), which restarts only what differs, so no test depends on what another did. pytest runs the files
in name order, which keeps the restarts few: the default configuration first (test_abandoned_transfers,
test_equality, test_through_router, test_trust), then the files that kill servers (test_when_killed) and
that need another D (test_with_fail_policy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from integration_tests.pd_connector.cluster import MAX_MODEL_LEN, ROUTER_THRESHOLD, Cluster
from integration_tests.starter import server_starter
from pd_disagg.engines import base_url, router_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port


@pytest.fixture(scope="package")
def package_servers() -> Iterator[Callable[..., list[ManagedServer]]]:
    """Starts servers that live until the package's last test (then all are stopped)."""
    with server_starter() as start:
        yield start


@pytest.fixture(scope="package")
def cluster(package_servers, tiny_model: Path, log_dir: Path) -> Cluster:
    return Cluster(package_servers, tiny_model, log_dir)


@pytest.fixture
def pd(cluster: Cluster) -> Cluster:
    """P and D as deployed by default: prefix caching on both, D recomputes failed loads."""
    return cluster.ensure()


@pytest.fixture(scope="package")
def router(package_servers, cluster: Cluster, tmp_path_factory, log_dir: Path) -> str:
    """pd-router (a real process) in front of the package's P and D, in our push flow (docs/wire-contract.md)."""
    cluster.ensure()
    config = write_router_config(
        tmp_path_factory.mktemp("pd-router") / "router.toml",
        flow="pd-push",
        sections={
            "model": {"path": str(cluster.model), "served_names": ["tiny"], "max_model_len": MAX_MODEL_LEN},
            "policy": {"threshold_tokens": ROUTER_THRESHOLD},
            "health": {"interval_s": 0.5},
        },
        prefill=[{"url": cluster.p_url, "bootstrap": cluster.bootstrap}],
        decode=[{"url": cluster.d_url}],
    )
    (server,) = package_servers(router_server(config, log_dir=log_dir, port=free_port(), name="pd-router"))
    return base_url(server)
