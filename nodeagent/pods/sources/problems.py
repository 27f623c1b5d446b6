"""Reporting bad input: a log line, a metric, and a Warning Event on the Node."""

from __future__ import annotations

import logging
from typing import Protocol

from nodeagent.pods.podupdate import Source
from nodeagent.pods.sources import sourcemetrics

log = logging.getLogger("nodeagent.pods.sources")


class EventSink(Protocol):
    def warning(self, reason: str, message: str) -> None:
        """Record a Warning Event on the Node. Must not block (schedule the API call)."""


class Problems:
    """Where sources report what they refuse. `sink` is usually the agent's Events."""

    def __init__(self, sink: EventSink | None = None) -> None:
        self.sink = sink

    def report(self, source: Source, reason: str, message: str) -> None:
        log.warning("%s source: %s", source.value, message)
        sourcemetrics.MANIFEST_ERRORS.labels(source.value, reason).inc()
        if self.sink is not None:
            self.sink.warning(f"StaticPod{reason}", f"{source.value} source: {message}")
