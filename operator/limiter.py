"""A bound on concurrent API writes that lets the most urgent waiting write in first.

The monitor starts every write of a period at once and does not wait for them; this
caps how many are in the API server at a time (`--writers`). When more wait, a stale
node's marking goes before an annotation or a policy status, and the longest-overdue
node first, so a burst of routine writes (every node's annotation after a policy
change) never holds a verdict back.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator


class Limiter:
    """At most `limit` holders at once; waiters go in by priority (lowest first), then
    in the order they came."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.active = 0
        self._waiting: list[tuple[tuple[float, ...], int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiting if not f.done())

    @contextlib.asynccontextmanager
    async def slot(self, priority: tuple[float, ...] = ()) -> AsyncIterator[None]:
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: tuple[float, ...]) -> None:
        if self.active < self.limit:  # then nobody waits: a release lets waiters in
            self.active += 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._order), granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # let in just as it was cancelled: pass the slot on
            else:
                granted.cancel()  # skipped when its turn comes
            raise

    def _release(self) -> None:
        self.active -= 1
        while self._waiting and self.active < self.limit:
            _, _, granted = heapq.heappop(self._waiting)
            if not granted.done():
                self.active += 1
                granted.set_result(None)
