"""CrashLoopBackOff: how long a container that crashed waits before its next start."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nodeagent.api.clock import Clock
from nodeagent.runtime.base import container_spec_hash

CrashKey = tuple[str, str, str]  # pod uid, container name, container_spec_hash


def crash_key(uid: str, spec: Mapping[str, Any]) -> CrashKey:
    """A container's back-off key. Its definition is part of it, as in the kubelet's:
    a crash-looping container given a new image starts without the old delay."""
    return (uid, str(spec["name"]), container_spec_hash(spec))


class CrashBackoff:
    """Restart delays per container (crash_key): the first restart is immediate,
    then 10 s, 20 s, ... up to 5 min; a container that ran `reset_after` (10 min) since
    its last restart starts over."""

    def __init__(self, clock: Clock, initial: float = 10.0, maximum: float = 300.0,
                 reset_after: float = 600.0) -> None:
        self.clock = clock
        self.initial = initial
        self.maximum = maximum
        self.reset_after = reset_after
        # pod uid -> (container name, spec hash) -> (delay, last restart)
        self._e: dict[str, dict[tuple[str, str], tuple[float, float]]] = {}

    def _left(self, e: tuple[float, float]) -> float:
        delay, last = e
        now = self.clock.monotonic()
        if now - last >= self.reset_after:
            return 0.0
        return max(0.0, last + delay - now)

    def remaining(self, key: CrashKey) -> float:
        """Seconds until the container may be restarted (0: now)."""
        e = self._e.get(key[0], {}).get(key[1:])
        return 0.0 if e is None else self._left(e)

    def delay(self, key: CrashKey) -> float:
        e = self._e.get(key[0], {}).get(key[1:])
        return e[0] if e else 0.0

    def waiting(self, uid: str) -> dict[CrashKey, tuple[float, float]]:
        """The pod's containers still backing off: key -> (seconds left, the delay)."""
        return {(uid, *k): (left, e[0]) for k, e in self._e.get(uid, {}).items()
                if (left := self._left(e)) > 0}

    def restarted(self, key: CrashKey) -> None:
        now = self.clock.monotonic()
        pod = self._e.setdefault(key[0], {})
        e = pod.get(key[1:])
        if e is None or now - e[1] >= self.reset_after:
            pod[key[1:]] = (self.initial, now)
        else:
            pod[key[1:]] = (min(e[0] * 2, self.maximum), now)

    def forget(self, uid: str) -> None:
        self._e.pop(uid, None)
