"""The shared due scheduler: jobs at their own due times, woken early only by a plan
sooner than the wait under way, and idle (no re-planning, no spinning) in between."""

from __future__ import annotations

import asyncio

from nodeagent.api.clock import FakeClock, settle
from nodeagent.node.scheduler import DueScheduler
from tests.conftest import aio


class CountingClock(FakeClock):
    def __init__(self) -> None:
        super().__init__()
        self.sleeps = 0

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        await super().sleep(seconds)


@aio
async def test_jobs_run_at_their_due_times_and_plan_their_next() -> None:
    clock = CountingClock()
    ran: list[tuple[str, float]] = []

    async def job(key: str) -> float | None:
        ran.append((key, clock.monotonic()))
        return clock.monotonic() + 10 if key == "a" else None

    sched: DueScheduler[str] = DueScheduler(clock, job)
    task = asyncio.create_task(sched.run())
    sched.schedule("a", 5)
    await settle()
    await clock.advance(30)
    assert ran == [("a", 5), ("a", 15), ("a", 25)]
    # a plan sooner than the wait under way (for a at 35) wakes it
    sched.schedule("b", 31)
    await clock.advance(1)
    assert ran[-1] == ("b", 31)
    await sched.stop()
    task.cancel()


@aio
async def test_a_plan_for_later_wakes_nothing_and_the_wait_does_not_spin() -> None:
    clock = CountingClock()

    async def job(key: str) -> float | None:
        return None

    sched: DueScheduler[str] = DueScheduler(clock, job)
    task = asyncio.create_task(sched.run())
    sched.schedule("a", 100)
    await settle()
    waits = clock.sleeps
    for i in range(50):  # later than the wait under way: nothing to re-plan
        sched.schedule(f"later-{i}", 200 + i)
    await settle()
    assert clock.sleeps == waits
    # sooner ones end the wait once each; the cancelled timers' callbacks, run after,
    # must not end the next wait (which would spin the loop on zero-length waits)
    for i in range(5):
        sched.schedule(f"sooner-{i}", 50 - i)
        await settle()
    assert clock.sleeps == waits + 5
    await settle()
    assert clock.sleeps == waits + 5 and clock.sleepers == 1
    await sched.stop()
    task.cancel()


@aio
async def test_with_slack_one_wake_up_runs_every_job_due_within_it() -> None:
    """Thousands of nodes' jobs each due at its own jittered time: with `slack`, one
    wake-up runs all that are due within it, each at most `slack` late, never early."""
    clock = CountingClock()
    ran: dict[str, float] = {}

    async def job(key: str) -> float | None:
        ran[key] = clock.monotonic()
        return None

    sched: DueScheduler[str] = DueScheduler(clock, job, slack=0.05)
    task = asyncio.create_task(sched.run())
    due = {"a": 1.0, "b": 1.01, "c": 1.04, "d": 1.2}
    for key, at in due.items():
        sched.schedule(key, at)
    await settle()
    waits = clock.sleeps
    await clock.advance(2)
    assert ran == {"a": 1.05, "b": 1.05, "c": 1.05, "d": 1.25}
    assert clock.sleeps == waits + 1  # a, b, c in one wake-up; then d's
    # a plan within the slack of the wait under way does not end it
    sched.schedule("e", 3.0)
    await settle()
    waits = clock.sleeps
    sched.schedule("f", 3.02)
    await settle()
    assert clock.sleeps == waits
    await clock.advance(2)
    assert (ran["e"], ran["f"]) == (3.05, 3.05)
    await sched.stop()
    task.cancel()


@aio
async def test_at_most_max_running_jobs_at_once_the_others_wait_their_turn_in_order() -> None:
    """Jobs that wait (for request turns) hold what they made: a thousand due at once
    run `max_running` at a time, each starting as soon as one ends."""
    clock = CountingClock()
    gates = {k: asyncio.Event() for k in "abcde"}
    started: list[str] = []

    async def job(key: str) -> float | None:
        started.append(key)
        await gates[key].wait()
        return None

    sched: DueScheduler[str] = DueScheduler(clock, job, max_running=2)
    task = asyncio.create_task(sched.run())
    for i, key in enumerate("abcde"):
        sched.schedule(key, 1.0 + i / 100)
    await clock.advance(2)
    assert started == ["a", "b"]
    gates["b"].set()
    await settle()
    assert started == ["a", "b", "c"]  # b's end let the next due one start
    # a's next plan, made while it runs, waits behind the jobs due before it
    sched.schedule("a", 2.5)
    await clock.advance(1)
    assert started == ["a", "b", "c"]
    for key in "acde":
        gates[key].set()
        await settle()
    assert started == ["a", "b", "c", "d", "e", "a"]
    await sched.stop()
    task.cancel()


@aio
async def test_with_urgency_the_most_urgent_due_job_goes_next_not_the_first_due() -> None:
    """Jobs due while every run slot is taken go in the order of their urgency (a
    Lease's expiry); a job re-planned or cancelled while it waits is not run for its old
    plan."""
    clock = CountingClock()
    gates = {k: asyncio.Event() for k in "abcdef"}
    started: list[str] = []
    expires = {"a": 0, "b": 50, "c": 40, "d": 30, "e": 20, "f": 10}

    async def job(key: str) -> float | None:
        started.append(key)
        await gates[key].wait()
        return None

    sched: DueScheduler[str] = DueScheduler(clock, job, max_running=1,
                                            urgency=expires.__getitem__)
    task = asyncio.create_task(sched.run())
    sched.schedule("a", 1.0)
    for i, key in enumerate("bcdef"):
        sched.schedule(key, 2.0 + i / 100)  # due in this order, while a runs
    await clock.advance(3)
    assert started == ["a"]
    sched.schedule("e", 100)  # planned for later
    sched.cancel("d")
    for key in "afcb":
        gates[key].set()
        await settle()
    assert started == ["a", "f", "c", "b"]
    await clock.advance(100)
    assert started == ["a", "f", "c", "b", "e"]
    await sched.stop()
    task.cancel()
