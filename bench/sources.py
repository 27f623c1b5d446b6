"""Pod source change detection: what a folder of static manifests and an API watch
cost, and how fast a change arrives.

    .venv/bin/python bench/sources.py                  # 1000 manifests, 1000 API pods
    .venv/bin/python bench/sources.py --no-cluster     # the file part only

File source (1000 manifests in a temp folder, real inotify):
  - initial load: start -> first full set in the merge;
  - one no-change rescan: CPU and wall ms (reads and digests every file, parses none);
  - updates emitted after touching every file (must be 0);
  - write -> PodUpdate latency, p50/p99: via inotify (default 0.1 s debounce), and via
    the periodic rescan alone (inotify disabled; the period is shortened to --period so
    the run is short, and the latency scales with it: with the default 20 s, p50 ~10 s).
API source (needs the local control plane from nodepulse_dev, brought up here; or says
why it is skipped): 1000 pods bound to one node, then
  - the initial paginated list time;
  - events/s delivered for 1000 pod updates made while the watch was disconnected
    (a backlog the resumed watch streams as fast as it can);
  - events/s delivered for 1000 updates made live, with the writer's own rate beside it.
Prints figures only; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeagent.api.clock import FakeClock, RealClock  # noqa: E402
from nodeagent.api.kube import RestKube  # noqa: E402
from nodeagent.pods.podupdate import Op, Source  # noqa: E402
from nodeagent.pods.sources.api import APISource  # noqa: E402
from nodeagent.pods.sources.file import FileSource  # noqa: E402
from nodeagent.pods.sources.merge import Merge  # noqa: E402


def manifest(i: int, image: str = "busybox:1") -> str:
    return (f"apiVersion: v1\nkind: Pod\nmetadata:\n  name: static-{i}\n  labels:\n"
            f"    app: bench\n    index: '{i}'\nspec:\n  containers:\n  - name: main\n"
            f"    image: {image}\n    command: [sleep, '3600']\n    resources:\n"
            f"      requests: {{cpu: 10m, memory: 16Mi}}\n")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def drain(merge: Merge) -> int:
    n = 0
    while not merge.updates.empty():
        n += len(merge.updates.get_nowait().pods)
    return n


async def wait_for_name(merge: Merge, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        u = await asyncio.wait_for(merge.updates.get(), max(0.01, deadline - time.monotonic()))
        if u.op is Op.ADD and any(p["metadata"]["name"] == name for p in u.pods):
            return


async def bench_files(n: int, samples: int, period: float) -> None:
    print(f"== file source: {n} static manifests")
    with tempfile.TemporaryDirectory(prefix="nodepulse-bench-") as d:
        folder = Path(d)
        for i in range(n):
            (folder / f"static-{i}.yaml").write_text(manifest(i))
        merge = Merge([Source.FILE])
        src = FileSource(folder, "bench-node", merge, RealClock())
        t0, c0 = time.perf_counter(), time.process_time()
        task = asyncio.create_task(src.run())
        await merge.ready.wait()
        load, cpu_load = time.perf_counter() - t0, time.process_time() - c0
        added = drain(merge)
        print(f"initial load: {load * 1000:.0f} ms wall, {cpu_load * 1000:.0f} ms CPU "
              f"for {added} pods (load average {os.getloadavg()[0]:.1f})")

        cpu0, wall0 = time.process_time(), time.perf_counter()
        src._scan_all("rescan")
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        print(f"one no-change rescan: {cpu * 1000:.1f} ms CPU, {wall * 1000:.1f} ms wall, "
              f"{drain(merge)} updates")

        batches = src.batches
        for i in range(n):
            p = folder / f"static-{i}.yaml"
            os.utime(p)
            with open(p, "ab"):
                pass
        # let the inotify batches run out, then one more rescan for good measure
        await asyncio.sleep(1.0)
        while src.debouncing.is_set() or src._pending:
            await asyncio.sleep(0.1)
        src._scan_all("rescan")
        print(f"updates after touching all {n} files: {drain(merge)} "
              f"({src.batches - batches} inotify batches)")

        lat: list[float] = []
        for k in range(samples):
            i = k % n
            p = folder / f"static-{i}.yaml"
            p.write_text(manifest(i, image=f"busybox:{k + 2}"))
            t = time.perf_counter()
            await wait_for_name(merge, f"static-{i}-bench-node")
            lat.append(time.perf_counter() - t)
            drain(merge)
        print(f"write -> update via inotify (debounce {src.debounce * 1000:.0f} ms), "
              f"{samples} edits: p50 {pct(lat, 50) * 1000:.0f} ms, "
              f"p99 {pct(lat, 99) * 1000:.0f} ms")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        # the rescan alone: no inotify reader, period shortened
        merge = Merge([Source.FILE])
        src = FileSource(folder, "bench-node", merge, RealClock(), check_frequency=period)
        task = asyncio.create_task(src.run())
        await merge.ready.wait()
        drain(merge)
        assert src._inotify is not None
        asyncio.get_running_loop().remove_reader(src._inotify.fileno())
        lat = []
        rescan_samples = max(10, samples // 10)
        for k in range(rescan_samples):
            i = k % n
            await asyncio.sleep((k * 0.37) % period)  # land at spread phases of the period
            (folder / f"static-{i}.yaml").write_text(manifest(i, image=f"rescan:{k}"))
            t = time.perf_counter()
            await wait_for_name(merge, f"static-{i}-bench-node", timeout=period * 3)
            lat.append(time.perf_counter() - t)
            drain(merge)
        print(f"write -> update via rescan only (period {period:.1f} s), {rescan_samples} "
              f"edits: p50 {pct(lat, 50) * 1000:.0f} ms, p99 {pct(lat, 99) * 1000:.0f} ms "
              f"(scales with the period: default 20 s -> p50 ~{20 * statistics.median(lat) / period:.0f} s)")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def bench_api(pods: int) -> None:
    print(f"== API source: {pods} pods bound to one node")
    try:
        from e2e.harness.apirequests import request, request_json
        from nodeagent.api.client import load_credentials, new_api_client
        from nodepulse_dev import LocalCluster
        cluster = LocalCluster()
        cluster.up(log=lambda m: print(f"  {m}"))
    except Exception as e:  # noqa: BLE001
        print(f"skipped: no local control plane could be started ({type(e).__name__}: {e})")
        return
    try:
        from kubernetes import client
        node = "bench-node"
        api = new_api_client(cluster.node_kubeconfig(node), pool_size=4)
        request_json(api, "POST", "/api/v1/nodes",
                     body={"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        admin = cluster.api_client()
        admin.configuration.connection_pool_maxsize = 32
        core = client.CoreV1Api(new_api_client(cluster.kubeconfig, pool_size=32))

        def create(i: int) -> None:
            request_json(admin, "POST", "/api/v1/namespaces/default/pods", body={
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"bench-{i}", "labels": {"v": "0"}},
                "spec": {"nodeName": node, "automountServiceAccountToken": False,
                         "containers": [{"name": "c", "image": "busybox:1"}]}})

        def patch_all(version: int) -> float:
            t = time.perf_counter()
            with ThreadPoolExecutor(16) as ex:
                list(ex.map(lambda i: core.patch_namespaced_pod(
                    f"bench-{i}", "default", {"metadata": {"labels": {"v": str(version)}}}),
                    range(pods)))
            return time.perf_counter() - t

        t = time.perf_counter()
        with ThreadPoolExecutor(16) as ex:
            list(ex.map(create, range(pods)))
        print(f"  created {pods} pods in {time.perf_counter() - t:.1f} s")

        clock = FakeClock()
        merge = Merge([Source.API])
        kube = RestKube(load_credentials(cluster.node_kubeconfig(node)))
        src = APISource(kube, [node], merge, clock)
        t = time.perf_counter()
        task = asyncio.create_task(src.run())
        await merge.ready.wait()
        print(f"initial paginated list: {(time.perf_counter() - t) * 1000:.0f} ms "
              f"for {drain(merge)} pods")
        await src.reflector.connected.wait()

        async def updates(n: int) -> float:
            got, t0 = 0, time.perf_counter()
            while got < n:
                u = await asyncio.wait_for(merge.updates.get(), 120)
                if u.op is Op.UPDATE:
                    got += len(u.pods)
            return time.perf_counter() - t0

        # backlog: the watch is down while the updates are made, then resumes
        rv0 = src.reflector.resource_version
        src.reflector.drop_connection()
        while clock.sleepers == 0:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(patch_all, 1)
        events0 = src.reflector.events
        t = time.perf_counter()
        await clock.advance(1.0)
        await updates(pods)
        took = time.perf_counter() - t
        print(f"resumed watch, {pods} updates made while down: {pods / took:.0f} events/s "
              f"delivered ({took * 1000:.0f} ms; {src.reflector.events - events0} watch events; "
              f"relists {src.reflector.relists}, LIST calls {src.reflector.lists})")

        def raw_read() -> float:
            """The same backlog read as bytes only: what the API server and the
            connection allow, without parsing or merging."""
            t0 = time.perf_counter()
            resp = request(api, "GET", "/api/v1/pods", timeout=(10.0, 120.0), query={
                "fieldSelector": src.reflector.config.field_selector, "watch": True,
                "resourceVersion": rv0, "timeoutSeconds": 60})
            lines = 0
            for chunk in resp.stream(65536):
                lines += chunk.count(b"\n")
                if lines >= pods:
                    break
            resp.close()
            return time.perf_counter() - t0
        raw = await asyncio.to_thread(raw_read)
        print(f"  baseline: the same {pods} events read raw (no parsing): "
              f"{pods / raw:.0f} events/s ({raw * 1000:.0f} ms)")

        # live: updates delivered while they are being made
        writer = asyncio.create_task(asyncio.to_thread(patch_all, 2))
        took = await updates(pods)
        write_s = await writer
        print(f"live watch, {pods} updates: {pods / took:.0f} events/s delivered "
              f"(the writer made {pods / write_s:.0f} updates/s)")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.aclose()
    finally:
        cluster.down()
        cluster.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifests", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=200, help="edits timed via inotify")
    ap.add_argument("--period", type=float, default=2.0,
                    help="rescan period for the rescan-only latency run (s)")
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument("--no-cluster", action="store_true", help="skip the API source part")
    args = ap.parse_args()
    asyncio.run(bench_files(args.manifests, args.samples, args.period))
    if args.no_cluster:
        print("== API source: skipped (--no-cluster)")
    else:
        asyncio.run(bench_api(args.pods))


if __name__ == "__main__":
    main()
