"""Metric families made once per Prometheus registry.

A process may run several agents' parts against one registry (virtual nodes, tests), and
a registry refuses a second family of the same name: each part gets its families from a
function wrapped in `per_registry`, labelled by node where nodes share them."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry

M = TypeVar("M")

# every maker wrapped below, in import order: what a registry can hold (the chart's
# dashboards are checked against the families they make)
MAKERS: list[Callable[[CollectorRegistry], object]] = []


def per_registry(make: Callable[[CollectorRegistry], M]) -> Callable[[CollectorRegistry], M]:
    """`make(registry)` once per registry object; later calls return what it made."""
    # keyed by the object, not id(): the ids of dead registries are reused
    made: weakref.WeakKeyDictionary[CollectorRegistry, M] = weakref.WeakKeyDictionary()

    def get(registry: CollectorRegistry) -> M:
        m = made.get(registry)
        if m is None:
            m = made[registry] = make(registry)
        return m

    get.__doc__ = make.__doc__
    MAKERS.append(get)
    return get
