"""One asyncio task that runs many nodes' periodic jobs at their own due times.

Shared by all nodes of a process (a heap of due times instead of a sleeping loop per
node); the lease renewals and the status ticks each get their own scheduler and their
own thread pool, so neither waits behind the other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import heapq
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

from nodeagent.api.clock import Clock

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# A job runs one key's work and says when (monotonic time) to run it next, or None.
Job = Callable[[K], Awaitable[float | None]]


class Blocking:
    """Runs blocking calls (host readings) in a bounded thread pool."""

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self.executor = executor

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Waits for calls already running: a write that started finishes."""
        self.executor.shutdown(wait=True, cancel_futures=True)


async def inline(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Blocking's stand-in for calls cheap enough to make on the event loop: a thread
    would cost more than the call (virtual nodes' status work, on one shared host
    reading)."""
    return fn(*args, **kwargs)


class DueScheduler(Generic[K]):
    """`slack`: a job may run this many seconds after its due time, so that one wake-up
    runs every job due within it (thousands of nodes' renewals and ticks, each due at
    its own jittered time, would otherwise wake the loop once each).

    `max_running`: at most this many jobs run at once; a due job waits in the heap for
    one of them to end. Jobs that wait for request turns hold what they computed: five
    thousand nodes' first status reports, all due at the start, held five thousand
    statuses while four turns wrote them (75 MB the process kept afterwards).

    `urgency`: of the jobs due while they wait for a running one to end, the one with
    the least urgency(key) goes next, not the one due first (Lease renewals: the one
    that expires first, whatever its node's interval)."""

    def __init__(self, clock: Clock, job: Job[K], name: str = "scheduler",
                 retry_after_error: float = 1.0, slack: float = 0.0,
                 max_running: int | None = None,
                 urgency: Callable[[K], float] | None = None) -> None:
        self.clock = clock
        self.job = job
        self.name = name
        self.retry_after_error = retry_after_error
        self.slack = slack
        self.max_running = max_running or math.inf
        self._full = False  # run() waits for a running job to end
        self.urgency = urgency
        self._heap: list[tuple[float, int, K]] = []  # (due, seq, key)
        # jobs due and waiting for a run slot, by urgency: (urgency, seq, due, key)
        self._ready: list[tuple[float, int, float, K]] = []
        self._due: dict[K, float] = {}
        self._running: dict[K, asyncio.Task[None]] = {}
        self._seq = itertools.count()
        # run() waits on this until the head of the heap is due, or something is
        # planned sooner than that (plans for later, the common case, wake nothing)
        self._waiter: asyncio.Future[None] | None = None
        self._waiting_until = math.inf
        self._stopping = False

    def due(self, key: K) -> float | None:
        return self._due.get(key)

    def running(self, key: K) -> bool:
        return key in self._running

    def schedule(self, key: K, at: float) -> None:
        """Run `key` at monotonic time `at` (replacing any earlier plan for it)."""
        self._due[key] = at
        heapq.heappush(self._heap, (at, next(self._seq), key))
        if at + self.slack < self._waiting_until:
            self._wake()

    def cancel(self, key: K) -> None:
        self._due.pop(key, None)

    async def run(self) -> None:
        while not self._stopping:
            now = self.clock.monotonic()
            key = self._next_due(now)
            if key is None:
                self._drop_superseded(self._heap, 0)
                head = self._heap[0][0] if self._heap else None
                await self._wait(None if head is None else head - now + self.slack)
                continue
            if key not in self._running and len(self._running) >= self.max_running:
                self._full = True
                await self._wait(None)
                continue
            if self.urgency is None:
                heapq.heappop(self._heap)
            else:
                heapq.heappop(self._ready)
            del self._due[key]
            if key in self._running:
                continue  # the running job plans its own next run
            self._running[key] = asyncio.create_task(self._run_one(key),
                                                     name=f"{self.name}:{key}")

    def _next_due(self, now: float) -> K | None:
        """The job to run next, if one is due: the head of the time heap, or with
        `urgency`, of the ready heap that every due job moves to."""
        self._drop_superseded(self._heap, 0)
        if self.urgency is None:
            return self._heap[0][2] if self._heap and self._heap[0][0] <= now else None
        while self._heap and self._heap[0][0] <= now:
            at, seq, key = heapq.heappop(self._heap)
            if self._due.get(key) == at:
                heapq.heappush(self._ready, (self.urgency(key), seq, at, key))
        self._drop_superseded(self._ready, 2)
        return self._ready[0][3] if self._ready else None

    def _drop_superseded(self, heap: list[Any], due_at: int) -> None:
        """Pops the head entries of `heap` that were re-planned or cancelled since."""
        while heap and self._due.get(heap[0][-1]) != heap[0][due_at]:
            heapq.heappop(heap)

    async def _run_one(self, key: K) -> None:
        try:
            nxt = await self.job(key)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: job for %s failed", self.name, key)
            nxt = self.clock.monotonic() + self.retry_after_error
        finally:
            self._running.pop(key, None)
            if self._full:
                self._full = False
                self._wake()
        if nxt is not None and not self._stopping:
            planned = self._due.get(key)
            self.schedule(key, nxt if planned is None else min(planned, nxt))

    def _wake(self) -> None:
        if self._waiter is not None:
            _settle(self._waiter)

    async def _wait(self, seconds: float | None) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        self._waiting_until = math.inf if seconds is None else self.clock.monotonic() + seconds
        timer = None
        if seconds is not None:
            timer = asyncio.ensure_future(self.clock.sleep(seconds))
            # this wait's own waiter: a cancelled timer's callback runs later, and must
            # not end the next wait
            timer.add_done_callback(lambda _: _settle(waiter))
        try:
            await waiter
        finally:
            self._waiter, self._waiting_until = None, math.inf
            if timer is not None:
                timer.cancel()

    async def stop(self) -> None:
        """No new runs; jobs in flight are cancelled at their next await (a blocking
        call already in a thread still completes: see Blocking.shutdown)."""
        self._stopping = True
        self._wake()
        tasks = list(self._running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
