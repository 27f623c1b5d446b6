"""Pod startup latency at the runtime interface: N pods asked for at once (sandbox,
create, start per pod, all pods concurrently, as pod workers do), for the process
runtime and a private containerd. Prints p50/p99 per pod and the time until one
relist shows every container RUNNING. Prints figures only; asserts nothing.

    .venv/bin/python bench/startup.py                         # both runtimes, 30 and 100 pods
    .venv/bin/python bench/startup.py --runtime process --pods 30,100,110
    .venv/bin/python bench/startup.py --runtime containerd --cni   # bridge-CNI pods

The API-level figure (pod create to Running observed by a watch) adds the agent's
sync loop and the API round trips on top of these numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeagent.runtime import (  # noqa: E402
    ContainerConfig,
    ContainerState,
    Runtime,
    SandboxConfig,
)


def pod(i: int, image: str, host_network: bool) -> dict:
    return {"metadata": {"name": f"start-{i}", "namespace": "bench", "uid": f"start-uid-{i}"},
            "spec": {"hostNetwork": host_network, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": image,
                                     "command": ["sleep", "3600"]}]}}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


async def one_pod(rt: Runtime, p: dict) -> float:
    t = time.perf_counter()
    sc = SandboxConfig.from_pod(p)
    sid = await rt.run_sandbox(sc)
    cid = await rt.create_container(sid, ContainerConfig.from_pod(
        p, p["spec"]["containers"][0]), sc)
    await rt.start_container(cid)
    return time.perf_counter() - t


async def burst(rt: Runtime, n: int, image: str, host_network: bool) -> None:
    pods = [pod(i, image, host_network) for i in range(n)]
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    lat = await asyncio.gather(*(one_pod(rt, p) for p in pods))
    while True:  # until one relist shows them all running
        r = await rt.relist()
        if sum(c.state == ContainerState.RUNNING for c in r.containers) >= n:
            break
        await asyncio.sleep(0.01)
    all_running = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    ms = [x * 1000 for x in lat]
    print(f"  {n:4d} pods: per pod p50 {statistics.median(ms):7.1f} ms  p99 "
          f"{pct(ms, 0.99):7.1f} ms  | all RUNNING in a relist after {all_running:6.2f} s"
          f"  | agent-side CPU {cpu * 1000:7.0f} ms", flush=True)
    t1 = time.perf_counter()
    await asyncio.gather(*(rt.remove_sandbox(s.id) for s in r.sandboxes))
    print(f"        teardown of {len(r.sandboxes)} pods: {time.perf_counter() - t1:.2f} s",
          flush=True)


async def run_process(sizes: list[int]) -> None:
    from nodeagent.runtime.process import ProcessRuntime
    with tempfile.TemporaryDirectory(prefix="np-bench-") as d:
        rt = ProcessRuntime(d)
        print("process runtime (each container a local process):")
        try:
            for n in sizes:
                await burst(rt, n, "localhost/busybox:1", True)
        finally:
            await rt.close()


async def run_containerd(sizes: list[int], cni: bool) -> None:
    from e2e.cluster.containerd import start_containerd
    from e2e.cluster.images import BUSYBOX_IMAGE
    from nodeagent.runtime.cri import CriRuntime
    ctd = start_containerd(cni=cni)
    try:
        rt = CriRuntime(str(ctd.socket))
        print(f"containerd {'bridge-CNI' if cni else 'hostNetwork'} pods "
              f"(CRI over {ctd.socket}):")
        try:
            for n in sizes:
                await burst(rt, n, BUSYBOX_IMAGE, not cni)
        finally:
            await rt.close()
    finally:
        ctd.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", choices=("process", "containerd", "both"), default="both")
    ap.add_argument("--pods", default="30,100", help="comma-separated burst sizes")
    ap.add_argument("--cni", action="store_true", help="containerd pods on the bridge CNI")
    args = ap.parse_args()
    sizes = [int(x) for x in args.pods.split(",")]
    if args.runtime in ("process", "both"):
        asyncio.run(run_process(sizes))
    if args.runtime in ("containerd", "both"):
        asyncio.run(run_containerd(sizes, args.cni))
    print(f"max RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}"
          " MiB")


if __name__ == "__main__":
    main()
