"""What one idle virtual node holds in Python objects: an agent of N virtual nodes on the
in-memory API (tests/fakekube.py), the fake runtime and a fake clock, run for some
simulated minutes; tracemalloc's difference from before the agent was built (after a
first agent of two nodes has paid what a process pays once), grouped by the line that
allocated, per node. What stays is per node, plus what each agent holds once (its
metrics, its loops) divided among the nodes. What the in-memory API keeps (its store,
its record of calls) is left out: allocations with one of its frames in their
traceback. Prints figures only; asserts nothing.

    .venv/bin/python -m bench.pernode --nodes 200
    .venv/bin/python -m bench.pernode --nodes 200 --group-by filename

RSS holds more than this (the modules' code, the allocator's slack); bench.scale
measures RSS against a control plane.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

LEFT_OUT = ("*/tests/fakekube.py", "*/tests/conftest.py")


async def run_agent(nodes: int, minutes: float, between: Callable[[], None] | None = None
                    ) -> None:
    """An agent of `nodes` virtual nodes for `minutes` of a fake clock; `between` is
    called before it stops."""
    from prometheus_client import CollectorRegistry

    from nodeagent import config
    from nodeagent.agent import Agent, Externals, Pools
    from nodeagent.api.clock import FakeClock, settle
    from nodeagent.runtime.fake import FakeRuntime
    from tests.conftest import InlineExecutor, agent_flags
    from tests.fakekube import FakeKube

    tmp = Path(tempfile.mkdtemp(prefix="np-pernode-"))
    flags = agent_flags(tmp, "--virtual-nodes", str(nodes), "--node-name-prefix", "vn")
    clock = FakeClock()
    inline = InlineExecutor()
    agent = Agent(dataclasses.replace(config.load(flags, {}), port=None),
                  Externals(FakeKube(now=clock.monotonic), clock,
                            runtime=FakeRuntime(clock, images=[]),
                            pools=Pools(inline, inline), registry=CollectorRegistry(),
                            flags=flags, env={}))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await settle()
    for _ in range(int(minutes * 60)):
        await clock.advance(1)
    if between is not None:
        between()
    stop.set()
    await task


async def measure(nodes: int, minutes: float, group_by: str) -> list[tracemalloc.StatisticDiff]:
    """What an agent of `nodes` holds that was not there before it, after a first agent
    of two nodes has paid what is paid once per process (imports, caches)."""
    await run_agent(2, minutes)
    gc.collect()
    tracemalloc.start(30)  # deep enough to see the in-memory API's frames
    before = tracemalloc.take_snapshot()
    snapshots = []

    def take() -> None:
        gc.collect()
        snapshots.append(tracemalloc.take_snapshot())
    await run_agent(nodes, minutes, take)
    after = snapshots[0]
    tracemalloc.stop()
    left_out = [tracemalloc.Filter(False, p, all_frames=True) for p in LEFT_OUT]
    left_out.append(tracemalloc.Filter(False, tracemalloc.__file__))
    return after.filter_traces(left_out).compare_to(before.filter_traces(left_out), group_by)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pernode",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--minutes", type=float, default=3, help="simulated minutes")
    p.add_argument("--group-by", choices=("lineno", "filename"), default="lineno")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    stats = asyncio.run(measure(args.nodes, args.minutes, args.group_by))
    total = sum(s.size_diff for s in stats)
    print(f"{args.nodes} idle virtual nodes, {args.minutes:g} simulated minutes: "
          f"{total / 1e6:.2f} MB of Python objects, {total / args.nodes:.0f} B per node")
    for s in stats[:args.top]:
        print(f"{s.size_diff / args.nodes:8.0f} B/node {s.count_diff / args.nodes:6.1f} "
              f"objects/node  {s.traceback[0]}")


if __name__ == "__main__":
    main()
