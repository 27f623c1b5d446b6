"""Clocks that every loop takes, so tests can replace time and never sleep."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import heapq
import itertools
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

T = TypeVar("T")


def api_time(t: dt.datetime) -> str:
    """metav1.Time: RFC 3339, whole seconds, UTC."""
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_microtime(t: dt.datetime) -> str:
    """metav1.MicroTime: RFC 3339 with microseconds, UTC."""
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; for intervals and deadlines."""

    def now(self) -> dt.datetime:
        """Wall-clock time, UTC, timezone-aware; for timestamps written to the API."""

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock."""


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """Virtual time. `sleep` returns only when a test calls `advance` past its deadline."""

    def __init__(self, start: dt.datetime | None = None) -> None:
        self._t = 0.0
        self._start = start or dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self._t

    def now(self) -> dt.datetime:
        return self._start + dt.timedelta(seconds=self._t)

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (self._t + max(0.0, seconds), next(self._seq), fut))
        await fut

    @property
    def sleepers(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking each sleeper at its own deadline in order and
        letting the woken tasks run before time moves on."""
        end = self._t + seconds
        while self._waiters and self._waiters[0][0] <= end:
            deadline, _, fut = heapq.heappop(self._waiters)
            self._t = max(self._t, deadline)
            if not fut.done():
                fut.set_result(None)
            await settle()
        self._t = end
        await settle()


async def settle(rounds: int = 20) -> None:
    """Let ready tasks run until they block again (bounded, no real time passes)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def clock_timeout(clock: Clock, aw: Awaitable[T], seconds: float, what: str) -> T:
    """Await `aw` for at most `seconds` on `clock` (asyncio.wait_for measures real time,
    which a FakeClock cannot move). Raises TimeoutError(what) and cancels `aw`."""
    task = asyncio.ensure_future(aw)
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        timer.cancel()
        task.cancel()
        raise
    timer.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise TimeoutError(what)
    return task.result()
