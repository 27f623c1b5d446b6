"""When Python's cyclic garbage collector walks the agent's objects.

A full collection walks every container object the process holds: with 3000 pods on
an agent, 0.4 s during which the event loop stands still, and it comes again each time
the heap grows by a quarter (every 17 s while pods keep coming; bench.scale --churn
measured the startup p99 this added). The objects that survived a while are frozen
(gc.freeze: the collector no longer walks them), so the collections that come on their
own walk only what came since. Once every `full_every` seconds they are unfrozen and
collected, so cyclic garbage among them is not kept longer than that.
"""

from __future__ import annotations

import gc
import logging

from nodeagent.api.clock import Clock

log = logging.getLogger(__name__)


class Collector:
    def __init__(self, clock: Clock, freeze_every: float = 10.0,
                 full_every: float = 600.0) -> None:
        self.clock = clock
        self.freeze_every = freeze_every
        self.full_every = full_every
        self.full_collections = 0

    async def run(self) -> None:
        last_full = self.clock.monotonic()
        try:
            while True:
                await self.clock.sleep(self.freeze_every)
                if self.clock.monotonic() - last_full >= self.full_every:
                    gc.unfreeze()
                    found = gc.collect()
                    self.full_collections += 1
                    last_full = self.clock.monotonic()
                    log.debug("full collection: %d unreachable objects", found)
                gc.freeze()
        finally:
            gc.unfreeze()  # what the process does after the agent is its own business
