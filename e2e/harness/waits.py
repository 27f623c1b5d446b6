"""Waiting for a condition: polled, with a timeout whose message says what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from kubernetes import client

T = TypeVar("T")
K = TypeVar("K")


def eventually(pred: Callable[[], T | None], what: str, timeout: float = 60.0,
               every: float = 0.25,
               tolerate: tuple[type[BaseException], ...] = ()) -> T:
    """Poll `pred` until it returns something truthy, and return that. Exceptions of the
    `tolerate` types count as "not yet" (e.g. while the control plane comes back)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            got = pred()
            if got:
                return got
        except tolerate as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}"
                                 + (f" (last error: {last})" if last else ""))
        time.sleep(every)


def node_registered(core: client.CoreV1Api, name: str,
                    running: Callable[[], bool] = lambda: True) -> None:
    """Wait for the Node `name` to be registered; `running`: whether its agent still
    runs (else the wait ends in its timeout, the message naming the node)."""
    eventually(lambda: running() and core.list_node(
        field_selector=f"metadata.name={name}").items, f"node {name} registered")


def first_seen(keys: Iterable[K], holds: Callable[[K], bool], what: str,
               timeout: float = 60.0,
               tolerate: tuple[type[BaseException], ...] = ()) -> dict[K, float]:
    """Poll until `holds(key)` has been true once for every key (`eventually`, with
    its `tolerate`); when (wall clock) each was first seen to hold."""
    seen: dict[K, float] = {}
    pending = list(keys)

    def all_seen() -> bool:
        for k in pending:
            if k not in seen and holds(k):
                seen[k] = time.time()
        return len(seen) == len(pending)
    eventually(all_seen, what, timeout, tolerate=tolerate)
    return seen
