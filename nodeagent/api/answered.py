"""The one connectivity signal: the API server answers again.

Whatever sees a request go through after requests failed (a Lease renewal, a watch or
list that works again, a mirror pod created) fires it. Whatever waits out a backoff
because the API server did not answer (the watches' reconnects, the pod status writes,
the mirror pod passes) waits on it, and goes now instead of at the end of a backoff
that may have grown to a minute meanwhile; a failure after that backs off again.

A wait for a Retry-After the server asked for is not made on it: that is served in
full (other requests going through do not mean this one may).

At most once per `min_interval` (1 s): a thousand virtual nodes' Leases recover
together. A fire within the interval is delivered at its end, not dropped, so a part
that failed again just after one delivery still hears the next.
"""

from __future__ import annotations

import asyncio
import math

from nodeagent.api.clock import Clock, clock_timeout


class ApiAnswered:
    def __init__(self, clock: Clock, min_interval: float = 1.0) -> None:
        self.clock = clock
        self.min_interval = min_interval
        self.delivered = 0  # how often the waits under way were told
        self._event = asyncio.Event()
        self._last = -math.inf
        self._later: asyncio.Task[None] | None = None

    def fire(self) -> None:
        """The API server answered after failures (call from the event loop)."""
        now = self.clock.monotonic()
        due = self._last + self.min_interval
        if now >= due:
            self._deliver(now)
        elif self._later is None:
            self._later = asyncio.get_running_loop().create_task(self._deliver_at(due))

    async def wait(self, seconds: float) -> bool:
        """Wait `seconds` on the clock, or less if the signal is delivered meanwhile
        (True then). A delivery before the wait began does not end it."""
        try:
            await clock_timeout(self.clock, self._event.wait(), seconds, "backoff")
        except TimeoutError:
            return False
        return True

    async def _deliver_at(self, due: float) -> None:
        await self.clock.sleep(due - self.clock.monotonic())
        self._later = None
        self._deliver(self.clock.monotonic())

    def _deliver(self, now: float) -> None:
        self._last = now
        self.delivered += 1
        self._event.set()
        self._event = asyncio.Event()
