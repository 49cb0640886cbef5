"""The relay's per-event histogram renders exactly what prometheus_client's Histogram would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router.metrics import EventHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry) -> list[str]:
    """Bucket, count and sum lines (prometheus_client's own Histogram adds a ``_created`` line)."""
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if line.startswith("gaps_") and "_created" not in line)


def test_event_histogram_matches_prometheus_histogram() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    lean = EventHistogram("gaps_seconds", "gaps", "route", BUCKETS)
    ours.register(lean)
    reference = Histogram("gaps_seconds", "gaps", ["route"], buckets=BUCKETS, registry=theirs)
    # values on bucket bounds count in that bucket (le = "less than or equal"); 5.0 goes to +Inf only
    values = {"local": [0.0005, 0.001, 0.002, 0.1, 5.0], "disagg": [0.01, 0.01, 0.5]}
    for route, seen in values.items():
        for v in seen:
            lean.series(route).observe(v)
            reference.labels(route).observe(v)
    assert _samples(ours) == _samples(theirs)
    assert 'gaps_seconds_bucket{le="0.001",route="local"} 2.0' in _samples(ours)
    assert lean.series("local") is lean.series("local")
