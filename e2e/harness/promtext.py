"""Reads Prometheus text exposition, for tests and benchmarks that witness a
component's behaviour through its own metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include all of `labels`."""
    # The API server exposes megabytes of metrics; parse only the lines of `name`.
    lines = [ln for ln in text.splitlines() if ln.startswith((name + "{", name + " "))]
    total = 0.0
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
