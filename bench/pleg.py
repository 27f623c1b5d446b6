"""Relist cost: PLEG (one list per period, inspect only changed pods) against per-pod
polling (one status call per pod per period), measured in the same run.

    .venv/bin/python bench/pleg.py                       # fake runtime, 10/100/1000 pods x 5
    .venv/bin/python bench/pleg.py --containerd 50       # plus a private containerd, 50 pods

For each size: runtime calls per period (at the Runtime interface; for CRI also gRPC
calls), CPU ms of this process per no-change period, and wall ms per period; then the
polling/PLEG ratio. Prints figures only; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeagent.api.clock import FakeClock, RealClock  # noqa: E402
from nodeagent.pods.pleg import Pleg  # noqa: E402
from nodeagent.runtime import (  # noqa: E402
    ContainerConfig,
    PodRuntimeStatus,
    RelistResult,
    Runtime,
    SandboxConfig,
)
from nodeagent.runtime.fake import FakeRuntime  # noqa: E402


@dataclass
class Figures:
    calls: float     # runtime interface calls per period
    rpc: float       # gRPC calls per period (CRI only, else same as calls)
    cpu_ms: float    # CPU of this process per period (median)
    wall_ms: float   # wall time per period (median)


def pod(i: int, containers: int, image: str) -> dict:
    return {"metadata": {"name": f"bench-{i}", "namespace": "bench", "uid": f"bench-uid-{i}"},
            "spec": {"hostNetwork": True, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": f"c{j}", "image": image,
                                     "command": ["sleep", "3600"]}
                                    for j in range(containers)]}}


async def populate(rt: Runtime, pods: int, containers: int, image: str) -> list[str]:
    uids = []
    for i in range(pods):
        p = pod(i, containers, image)
        sc = SandboxConfig.from_pod(p)
        sid = await rt.run_sandbox(sc)
        for c in p["spec"]["containers"]:
            cid = await rt.create_container(sid, ContainerConfig.from_pod(p, c), sc)
            await rt.start_container(cid)
        uids.append(p["metadata"]["uid"])
    return uids


def rpc_calls(rt: Runtime) -> int:
    """Calls that reached the runtime so far: the fake counts its methods, CriRuntime
    counts gRPC calls."""
    if isinstance(rt, FakeRuntime):
        return sum(rt.calls.values())
    return int(getattr(rt, "calls", 0))


class Counting:
    """Counts interface calls on a runtime that has no counter of its own."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.n = 0

    async def relist(self) -> RelistResult:
        self.n += 1
        return await self.rt.relist()

    async def pod_status(self, uid: str) -> PodRuntimeStatus:
        self.n += 1
        return await self.rt.pod_status(uid)


async def measure_pleg(rt: Runtime, periods: int) -> Figures:
    clock = FakeClock() if isinstance(rt, FakeRuntime) else RealClock()
    counting = Counting(rt)
    pleg = Pleg(counting, clock, registry=CollectorRegistry())  # type: ignore[arg-type]
    await pleg.relist()  # first relist: everything is new and inspected
    while pleg._inspecting:  # let the first inspections finish
        await asyncio.sleep(0)
    cpu, wall = [], []
    n0, r0 = counting.n, rpc_calls(rt)
    for _ in range(periods):
        c, w = time.process_time(), time.perf_counter()
        await pleg.relist()
        cpu.append((time.process_time() - c) * 1000)
        wall.append((time.perf_counter() - w) * 1000)
    return Figures((counting.n - n0) / periods, (rpc_calls(rt) - r0) / periods,
                   statistics.median(cpu), statistics.median(wall))


async def measure_polling(rt: Runtime, uids: list[str], periods: int) -> Figures:
    """The design PLEG replaced: every pod worker asks the runtime for its pod's status
    each period and compares it with what it saw last time."""
    seen: dict[str, tuple[tuple[str, str], ...]] = {}
    cpu, wall = [], []
    calls, r0 = 0, rpc_calls(rt)
    for _ in range(periods):
        c, w = time.process_time(), time.perf_counter()
        for uid in uids:
            st = await rt.pod_status(uid)
            calls += 1
            snap = tuple(sorted((x.id, str(x.state)) for x in st.containers)) + tuple(
                sorted((s.id, str(s.state)) for s in st.sandboxes))
            if seen.get(uid) != snap:
                seen[uid] = snap
        cpu.append((time.process_time() - c) * 1000)
        wall.append((time.perf_counter() - w) * 1000)
    return Figures(calls / periods, (rpc_calls(rt) - r0) / periods,
                   statistics.median(cpu), statistics.median(wall))


def row(label: str, pods: int, containers: int, p: Figures, q: Figures, rpc: bool) -> None:
    def ratio(a: float, b: float) -> str:
        return f"{a / b:8.1f}x" if b > 0 else "      n/a"
    extra = f" {p.rpc:7.1f} {q.rpc:8.1f}" if rpc else ""
    print(f"{label:11} {pods:5d} {pods * containers:6d} | {p.calls:6.1f} {q.calls:7.1f}{extra} | "
          f"{p.cpu_ms:8.3f} {q.cpu_ms:9.3f} {ratio(q.cpu_ms, p.cpu_ms)} | "
          f"{p.wall_ms:8.3f} {q.wall_ms:9.3f} {ratio(q.wall_ms, p.wall_ms)} | "
          f"{ratio(q.calls, p.calls)}")


HEADER = ("runtime      pods  ctrs | calls/period    | CPU ms/period (median)     | "
          "wall ms/period (median)    | calls\n"
          "                        |   pleg polling  |     pleg   polling   ratio |"
          "     pleg   polling   ratio | ratio")


async def fake_runs(sizes: list[int], containers: int, periods: int) -> None:
    print(HEADER)
    alone = []
    for n in sizes:
        rt = FakeRuntime(FakeClock())
        uids = await populate(rt, n, containers, "localhost/busybox:1")
        p = await measure_pleg(rt, periods)
        q = await measure_polling(rt, uids, periods)
        row("fake", n, containers, p, q, rpc=False)
        cpu = []
        for _ in range(periods):
            c = time.process_time()
            await rt.relist()
            cpu.append((time.process_time() - c) * 1000)
        alone.append(f"{n} pods {statistics.median(cpu):.3f} ms")
    print("of which the fake runtime's own relist() (copying every record): "
          + ", ".join(alone))


async def containerd_run(pods: int, containers: int, periods: int) -> None:
    from nodeagent.runtime.cri import CriRuntime
    from nodepulse_dev.containerd import start_containerd
    from nodepulse_dev.images import BUSYBOX_IMAGE

    ctd = start_containerd(cni=False)
    try:
        rt = CriRuntime(ctd.endpoint)
        t = time.perf_counter()
        uids = await populate(rt, pods, containers, BUSYBOX_IMAGE)
        print(f"\ncontainerd: started {pods} pods x {containers} containers in "
              f"{time.perf_counter() - t:.1f}s; gRPC calls counted by CriRuntime")
        print("runtime      pods  ctrs | calls/period, interface then gRPC | "
              "CPU ms/period (median)     | wall ms/period (median)    | calls\n"
              "                        |   pleg polling    pleg  polling |     pleg   polling"
              "   ratio |     pleg   polling   ratio | ratio")
        p = await measure_pleg(rt, periods)
        q = await measure_polling(rt, uids, periods)
        row("containerd", pods, containers, p, q, rpc=True)
        await rt.close()
    finally:
        ctd.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", default="10,100,1000", help="fake runtime pod counts")
    ap.add_argument("--containers", type=int, default=5)
    ap.add_argument("--periods", type=int, default=30, help="no-change periods measured")
    ap.add_argument("--containerd", type=int, default=0, metavar="PODS",
                    help="also run against a private containerd with this many pods")
    ap.add_argument("--containerd-containers", type=int, default=1)
    args = ap.parse_args()
    asyncio.run(fake_runs([int(x) for x in args.pods.split(",")], args.containers,
                          args.periods))
    if args.containerd:
        asyncio.run(containerd_run(args.containerd, args.containerd_containers,
                                   args.periods))


if __name__ == "__main__":
    main()
