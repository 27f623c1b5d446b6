"""The pod half's calls into the runtime, each bounded by the call timeout, and the ones
under way counted so a stop can let them end.

Cancelling the caller (the agent stopping) does not cancel the call itself: a CRI
StartContainer whose client goes away is aborted by containerd half-way, as a
StartError, and the next agent has to restart that container. `drain` lets the calls in
flight end before the process does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from nodeagent.api.clock import Clock, clock_timeout
from nodeagent.runtime.base import Runtime, start_call

log = logging.getLogger(__name__)

T = TypeVar("T")


def _forget_call(inflight: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(call: asyncio.Future[Any]) -> None:
        inflight.discard(call)
        if not call.cancelled():
            call.exception()  # retrieved: a caller that was cancelled never will
    return done


class RuntimeCalls:
    def __init__(self, runtime: Runtime, clock: Clock, timeout: float = 60.0) -> None:
        self.runtime = runtime
        self.clock = clock
        self.timeout = timeout
        self._inflight: set[asyncio.Future[Any]] = set()

    async def __call__(self, aw: Coroutine[Any, Any, T], what: str, extra: float = 0.0) -> T:
        """One runtime call (`aw`, a coroutine of the runtime's), bounded by the call
        timeout plus `extra` (a stop's grace period)."""
        call = start_call(self.runtime, aw)
        if call.done():  # an inline runtime answered in this turn
            return call.result()
        self._inflight.add(call)
        call.add_done_callback(_forget_call(self._inflight))
        secs = self.timeout + extra
        try:
            return await clock_timeout(self.clock, asyncio.shield(call), secs,
                                       f"runtime {what}: no answer within {secs:.0f}s")
        except TimeoutError:
            call.cancel()  # timed out: the call itself is abandoned
            raise

    def in_flight(self) -> int:
        return sum(1 for c in self._inflight if not c.done())

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` s for the calls in flight, then cancel the rest. Returns
        how many had to be cancelled."""
        pending = {c for c in self._inflight if not c.done()}
        if not pending:
            return 0
        log.info("waiting up to %.0fs for %d runtime call(s) in flight", timeout,
                 len(pending))
        with contextlib.suppress(TimeoutError):
            await clock_timeout(self.clock, asyncio.wait(pending), timeout,
                                "runtime calls in flight")
        left = [c for c in pending if not c.done()]
        for c in left:
            c.cancel()
        if left:
            log.warning("%d runtime call(s) still running after %.0fs; cancelled",
                        len(left), timeout)
            await asyncio.gather(*left, return_exceptions=True)
        return len(left)
