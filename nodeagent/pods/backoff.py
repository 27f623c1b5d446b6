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
        self._e: dict[CrashKey, tuple[float, float]] = {}  # key -> (delay, last)

    def remaining(self, key: CrashKey) -> float:
        """Seconds until the container may be restarted (0: now)."""
        e = self._e.get(key)
        if e is None:
            return 0.0
        delay, last = e
        now = self.clock.monotonic()
        if now - last >= self.reset_after:
            return 0.0
        return max(0.0, last + delay - now)

    def delay(self, key: CrashKey) -> float:
        e = self._e.get(key)
        return e[0] if e else 0.0

    def restarted(self, key: CrashKey) -> None:
        now = self.clock.monotonic()
        e = self._e.get(key)
        if e is None or now - e[1] >= self.reset_after:
            self._e[key] = (self.initial, now)
        else:
            self._e[key] = (min(e[0] * 2, self.maximum), now)

    def forget(self, uid: str) -> None:
        for k in [k for k in self._e if k[0] == uid]:
            del self._e[k]
