"""The chart's Grafana dashboards ask only for metrics the programs export.

The exported series are read from the metric families themselves: every module of the
agent and the operator imported (module-level families register in the process's
registry), every per-registry maker (`nodeagent.metrics.MAKERS`) run on a fresh one, and
each family's series named as prometheus_client exposes them (a counter's `_total`, a
histogram's `_bucket`, `_sum` and `_count`, ...). Each panel's queries, and the
template variables' queries, must name only those."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nodeoperator
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric

import nodeagent
from nodeagent.metrics import MAKERS

CHART = Path(__file__).resolve().parent.parent / "charts" / "nodepulse"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))

# the series each type of family exposes, by suffix
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",),
            "stateset": ("",), "unknown": ("",), "gaugehistogram": ("_bucket", "_gsum",
                                                                    "_gcount")}

# PromQL words that are not metric names: functions, aggregations, keywords
PROMQL_WORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan", "sum", "min", "max", "avg", "count", "stddev",
    "stdvar", "topk", "bottomk", "quantile", "count_values", "group"}


def series_of(family: Metric) -> set[str]:
    return {family.name + suffix for suffix in SUFFIXES[family.type]}


def exported_series() -> set[str]:
    """Every series name the agent's and the operator's registries can expose."""
    for package in (nodeagent, nodeoperator):
        for mod in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(mod.name)
    fresh = CollectorRegistry()
    for make in MAKERS:
        make(fresh)
    names: set[str] = set()
    for family in [*fresh.collect(), *REGISTRY.collect()]:
        expected = series_of(family)
        # where the family has samples already, they bear the suffixes out
        assert {s.name for s in family.samples} <= expected, family
        names |= expected
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, strings
    text = re.sub(r"\$\{?\w+(?::\w+)?\}?", "", text)  # Grafana variables
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges, subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    # whole words not followed by "(" (a function's or an aggregation's name)
    words = re.findall(r"(?<![\w:.])[A-Za-z_:][\w:]*(?![\w:])(?!\s*\()", text)
    return {w for w in words if w.lower() not in PROMQL_WORDS}


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels") or [])  # a row's panels

    for panel in panels(dashboard.get("panels") or []):
        for target in panel.get("targets") or []:
            yield f"panel {panel.get('title')!r} ({target.get('refId')})", target["expr"]
    for var in (dashboard.get("templating") or {}).get("list") or []:
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            # Grafana's label_values(series, label): the label is no metric
            query = re.sub(r"^\s*label_values\((.*),\s*\w+\s*\)\s*$", r"\1", query)
            yield f"variable {var['name']!r}", query


def unknown_metrics(dashboard: dict[str, Any], name: str, exported: set[str]) -> list[str]:
    return [f"{name}: {where}: {metric} is not a metric the programs export"
            for where, expr in queries(dashboard)
            for metric in sorted(metric_names(expr) - exported)]


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_series()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_names_exported_metrics(path: Path, exported: set[str]) -> None:
    dashboard = json.loads(path.read_text())
    assert list(queries(dashboard)), "a dashboard without queries"
    assert unknown_metrics(dashboard, path.name, exported) == []


def test_the_exported_series_are_named_as_prometheus_sees_them(exported: set[str]) -> None:
    for name in ("nodepulse_lease_renewals_total", "nodepulse_nodes",
                 "nodepulse_lease_renewal_duration_seconds_bucket",
                 "nodepulse_pod_worker_sync_duration_seconds_count",
                 "nodepulse_probe_results_total", "nodepulse_source_pods",
                 "nodepulse_operator_policy_nodes", "nodepulse_operator_events_total",
                 "nodepulse_operator_taint_delay_seconds_sum"):
        assert name in exported
    for name in ("nodepulse_lease_renewals", "nodepulse_nodes_total",
                 "nodepulse_lease_renewal_duration_seconds",
                 "nodepulse_operator_stale_nodes_bucket"):
        assert name not in exported


def test_a_wrong_metric_is_named_with_its_panel(exported: set[str]) -> None:
    dashboard = {"panels": [{"type": "row", "title": "a row", "panels": [
        {"title": "Renewals", "targets": [
            {"refId": "A", "expr": 'sum by (result) (rate(nodepulse_lease_renewals'
                                   '{instance=~"$instance"}[$__rate_interval]))'},
            {"refId": "B", "expr": "histogram_quantile(0.99, sum by (le) (rate("
                                   "nodepulse_lease_renewal_duration_seconds_bucket[5m])))"}]},
        {"title": "Latency", "targets": [
            {"refId": "A", "expr": "histogram_quantile(0.9, rate("
                                   "nodepulse_lease_renewal_duration_seconds[5m]))"}]}]}],
        "templating": {"list": [{"name": "instance", "type": "query",
                                 "query": {"query": "label_values(nodepulse_nodez, instance)"}}]}}
    assert unknown_metrics(dashboard, "d.json", exported) == [
        "d.json: panel 'Renewals' (A): nodepulse_lease_renewals is not a metric the "
        "programs export",
        "d.json: panel 'Latency' (A): nodepulse_lease_renewal_duration_seconds is not a "
        "metric the programs export",
        "d.json: variable 'instance': nodepulse_nodez is not a metric the programs export"]


def test_metric_names_of_promql() -> None:
    assert metric_names('sum by (kind, result) (rate(a_total{x="b c", y=~"d|e"}[5m])) '
                        '/ on(instance) group_left(mode) b_info == 1 or vector(0)') \
        == {"a_total", "b_info"}
    assert metric_names("count(up offset 1h) > 2e3 and absent(c[$__range])") == {"up", "c"}


def test_the_chart_ships_every_dashboard_file() -> None:
    """The template names each dashboard: a file added without it would never ship."""
    template = (CHART / "templates" / "dashboards.yaml").read_text()
    (names,) = re.findall(r"range \$name := list ((?:\"\w+\" ?)+)", template)
    assert sorted(re.findall(r'"(\w+)"', names)) == sorted(p.stem for p in DASHBOARDS)
    uids = [json.loads(p.read_text())["uid"] for p in DASHBOARDS]
    assert len(set(uids)) == len(uids) == 3
