"""The agent process's garbage collection: survivors frozen every period (automatic
collections walk only what came since), unfrozen and collected in full on a longer one,
and nothing left frozen when it stops. FakeClock; no sleeps."""

from __future__ import annotations

import asyncio
import gc

from nodeagent.api.clock import FakeClock, settle
from nodeagent.collector import Collector
from tests.conftest import aio


@aio
async def test_survivors_are_frozen_and_collected_in_full_on_the_long_period() -> None:
    clock = FakeClock()
    collector = Collector(clock, freeze_every=10, full_every=60)
    task = asyncio.create_task(collector.run())
    try:
        await settle()
        assert gc.get_freeze_count() == 0
        # the start-up's objects frozen soon: at 0.5 s, then 1.5, 3.5, 7.5, 15.5, 25.5...
        froze_at = []
        for _ in range(52):
            kept: list[list[int]] = [[] for _ in range(10)]  # made since the last freeze
            frozen = gc.get_freeze_count()
            await clock.advance(0.5)
            if gc.get_freeze_count() > frozen:
                froze_at.append(round(clock.monotonic(), 1))
            del kept
        assert froze_at == [0.5, 1.5, 3.5, 7.5, 15.5, 25.5]
        assert collector.full_collections == 0
        # cyclic garbage made while frozen objects sit in the permanent generation
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        await clock.advance(40)
        assert collector.full_collections == 1
        assert gc.get_freeze_count() > 0  # frozen again right after the full collection
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert gc.get_freeze_count() == 0
