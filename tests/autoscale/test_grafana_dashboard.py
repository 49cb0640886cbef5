"""examples/grafana/pd-disagg.json loads, and every metric its PromQL queries is one that pd-router
(``router.metrics`` and the tracer's stage histogram), PDConnector on vLLM (``pd_connector.metrics.PromMetrics``
with engine ``vllm``) or the autoscaler (``pd_disagg.autoscale.metrics``) exposes, with the suffix it is
exposed under: a renamed metric breaks this test instead of a panel going blank."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from pd_connector.metrics import PromMetrics
from pd_disagg.autoscale.metrics import AutoscaleMetrics
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.trace import Tracer

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "pd-disagg.json"
# Grouping, matching, durations and strings hold label names and values, not metrics.
_NOT_METRICS = re.compile(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"|\b(?:by|without|on|ignoring)\s*\([^)]*\)')
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right"}


def _exposed(registry: CollectorRegistry) -> set[str]:
    """The sample names a registry's families are scraped under (a counter's ``_total``, a histogram's
    ``_bucket``/``_count``/``_sum``, a gauge's own name)."""
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_count", "_sum")}
        else:
            names.add(family.name)
    return names


def _known() -> set[str]:
    router = RouterMetrics()
    router.watch_workers(list)
    router.watch_prefixes(PrefixIndex(block_size=16, max_blocks=16))
    Tracer(router.registry)
    connector = CollectorRegistry()
    PromMetrics(
        "vllm",
        functools.partial(Counter, registry=connector),
        functools.partial(Histogram, registry=connector),
        ["engine"],
        {0: ["0"]},
    )
    return _exposed(router.registry) | _exposed(connector) | _exposed(AutoscaleMetrics().registry)


def _metrics_in(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside label sets, groupings and durations that are
    neither functions (followed by ``(``) nor keywords."""
    text = _NOT_METRICS.sub(" ", expr)
    found = set()
    for match in _NAME.finditer(text):
        rest = text[match.end() :].lstrip()
        if not rest.startswith("(") and match.group() not in _KEYWORDS:
            found.add(match.group())
    return found


def _targets(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for panel in panels:
        out += panel.get("targets", [])
        out += _targets(panel.get("panels", []))
    return out


def test_metric_names_are_found_in_promql() -> None:
    expr = 'histogram_quantile(0.9, sum by (le, route) (rate(pd_router_ttft_seconds_bucket{route="x"}[5m])))'
    assert _metrics_in(expr) == {"pd_router_ttft_seconds_bucket"}
    assert _metrics_in("sum(rate(vllm:pd_connector_bytes_sent_total[1m])) / sum(up)") == {
        "vllm:pd_connector_bytes_sent_total",
        "up",
    }


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    targets = _targets(dashboard["panels"])
    assert dashboard["uid"] and len(targets) >= 20
    known = _known()
    used: set[str] = set()
    for target in targets:
        names = _metrics_in(target["expr"])
        assert names, f"no metric in {target['expr']!r}"
        unknown = names - known
        assert not unknown, f"{sorted(unknown)} in {target['expr']!r} is exported by no one"
        used |= names
    # The dashboard covers each source: the router, the connector, the autoscaler.
    for prefix in ("pd_router_", "vllm:pd_connector_", "pd_autoscale_"):
        assert any(name.startswith(prefix) for name in used), prefix
