"""When Python's cyclic garbage collector walks the agent's objects.

A full collection walks every container object the process holds: with 3000 pods on
an agent, 0.4 s during which the event loop stands still, and it comes again each time
the heap grows by a quarter (every 17 s while pods keep coming; bench.scale --churn
measured the startup p99 this added). The objects that survived a while are frozen
(gc.freeze: the collector no longer walks them), so the collections that come on their
own walk only what came since. Once every `full_every` seconds they are unfrozen and
collected, so cyclic garbage among them is not kept longer than that.

The first freeze comes `first_freeze` seconds after the start, the wait then doubling
up to `freeze_every`: what the start-up made (modules, a thousand nodes' controllers)
is frozen before the first pods come. Frozen only at 10 s, a full collection of it
stood the loop still for 40 ms in the first burst of pods (bench.scale --churn).
"""

from __future__ import annotations

import gc
import logging

from nodeagent.api.clock import Clock

log = logging.getLogger(__name__)


class Collector:
    def __init__(self, clock: Clock, freeze_every: float = 10.0,
                 full_every: float = 600.0, first_freeze: float = 0.5) -> None:
        self.clock = clock
        self.first_freeze = first_freeze
        self.freeze_every = freeze_every
        self.full_every = full_every
        self.full_collections = 0

    async def run(self) -> None:
        last_full = self.clock.monotonic()
        wait = min(self.first_freeze, self.freeze_every)
        try:
            while True:
                await self.clock.sleep(wait)
                wait = min(wait * 2, self.freeze_every)
                if self.clock.monotonic() - last_full >= self.full_every:
                    gc.unfreeze()
                    found = gc.collect()
                    self.full_collections += 1
                    last_full = self.clock.monotonic()
                    log.debug("full collection: %d unreachable objects", found)
                gc.freeze()
        finally:
            gc.unfreeze()  # what the process does after the agent is its own business
