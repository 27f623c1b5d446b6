"""Pod startup latency, two ways. Prints figures only; asserts nothing.

Runtime level (default): N pods asked for at once (sandbox, create, start per pod, all
pods concurrently, as pod workers do) for the process runtime and a private containerd;
p50/p99 per pod and the time until one relist shows every container RUNNING.

    .venv/bin/python bench/startup.py                         # both runtimes, 30 and 100 pods
    .venv/bin/python bench/startup.py --runtime process --pods 30,100,110
    .venv/bin/python bench/startup.py --runtime containerd --cni   # bridge-CNI pods

API level (--api): the local control plane, one nodepulse-agent on that runtime, N pods
created through the API (bound to the agent's node); latency = pod create call to
phase Running seen by a watch; p50/p99 per size.

    .venv/bin/python bench/startup.py --api --runtime process --pods 30,100
    .venv/bin/python bench/startup.py --api --runtime containerd --pods 30,100
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
    from nodeagent.runtime.cri import CriRuntime
    from nodepulse_dev.containerd import start_containerd
    from nodepulse_dev.images import BUSYBOX_IMAGE
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


def api_run(runtime: str, sizes: list[int], timeout: float) -> None:
    """One agent on `runtime` against the local control plane; N pods via the API."""
    import signal
    import subprocess
    import threading
    import uuid

    from kubernetes import client, watch

    from e2e.harness.ports import free_port
    from nodepulse_dev import LocalCluster
    from nodepulse_dev.containerd import Containerd, start_containerd
    from nodepulse_dev.images import BUSYBOX_IMAGE

    node = f"startup-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster().up(log=lambda m: None)
    ctd: Containerd | None = None
    agent: subprocess.Popen[bytes] | None = None
    try:
        args = [str(Path(sys.executable).parent / "nodepulse-agent"), f"--node-name={node}",
                f"--kubeconfig={cluster.node_kubeconfig(node)}",
                f"--root-dir={cluster.workdir / 'agent'}",
                f"--healthz-bind-address=127.0.0.1:{free_port()}",
                f"--runtime={'cri' if runtime == 'containerd' else 'process'}"]
        if runtime == "containerd":
            ctd = start_containerd(cni=True)
            args.append(f"--container-runtime-endpoint={ctd.endpoint}")
        log_path = cluster.log_dir / "agent.log"
        with open(log_path, "ab") as log:
            agent = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        core = client.CoreV1Api(cluster.api_client())
        deadline = time.monotonic() + 60
        while not _node_ready(core, node):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the agent's node {node} never became Ready; see {log_path}")
            time.sleep(0.2)
        print(f"API level, {runtime} runtime, node {node} (agent log {log_path}):",
              flush=True)
        for n in sizes:
            ns = f"startup-{n}-{uuid.uuid4().hex[:6]}"
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
            running: dict[str, float] = {}
            created: dict[str, float] = {}
            all_running = threading.Event()
            w = watch.Watch()

            def watch_pods(ns: str = ns, w: watch.Watch = w,
                           running: dict[str, float] = running,
                           all_running: threading.Event = all_running, n: int = n) -> None:
                for ev in w.stream(core.list_namespaced_pod, ns, timeout_seconds=int(timeout)):
                    pod = ev["object"]
                    if pod.status and pod.status.phase == "Running":
                        running.setdefault(pod.metadata.name, time.monotonic())
                        if len(running) >= n:
                            all_running.set()
                            return

            t = threading.Thread(target=watch_pods, daemon=True)
            t.start()
            time.sleep(0.5)  # let the watch open before the first create
            t0 = time.monotonic()
            for i in range(n):
                name = f"p{i}"
                created[name] = time.monotonic()
                core.create_namespaced_pod(ns, {
                    "metadata": {"name": name},
                    "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                             "containers": [{"name": "main", "image": BUSYBOX_IMAGE,
                                             "command": ["sleep", "3600"]}]}})
            ok = all_running.wait(timeout)
            w.stop()
            lat = [(running[k] - created[k]) * 1000 for k in running]
            if lat:
                print(f"  {n:4d} pods: create->Running p50 {statistics.median(lat):7.0f} ms  "
                      f"p99 {pct(lat, 0.99):7.0f} ms  | last Running after "
                      f"{max(running.values()) - t0:6.2f} s"
                      + ("" if ok else f"  | ONLY {len(lat)}/{n} Running in {timeout:.0f} s"),
                      flush=True)
            else:
                print(f"  {n:4d} pods: none reached Running in {timeout:.0f} s; see {log_path}")
            print(f"        agent RSS with {len(lat)} pods running: {_rss_mib(agent.pid):.0f} MiB",
                  flush=True)
            core.delete_namespace(ns)
            gone = time.monotonic() + 120
            while core.list_namespaced_pod(ns).items and time.monotonic() < gone:
                time.sleep(0.5)
    finally:
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(30)
        if ctd is not None:
            ctd.stop()
        cluster.remove()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _node_ready(core: object, node: str) -> bool:
    from kubernetes import client
    from kubernetes.client.rest import ApiException
    assert isinstance(core, client.CoreV1Api)
    try:
        n = core.read_node(node)
    except ApiException:
        return False
    return any(c.type == "Ready" and c.status == "True"
               for c in (n.status.conditions or []) if n.status)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", choices=("process", "containerd", "both"), default="both")
    ap.add_argument("--pods", default="30,100", help="comma-separated burst sizes")
    ap.add_argument("--cni", action="store_true", help="containerd pods on the bridge CNI")
    ap.add_argument("--api", action="store_true",
                    help="through the API with a real agent (local control plane)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="API level: seconds to wait for each size's pods")
    args = ap.parse_args()
    sizes = [int(x) for x in args.pods.split(",")]
    if args.api:
        for rt in (("process", "containerd") if args.runtime == "both" else (args.runtime,)):
            api_run(rt, sizes, args.timeout)
        return
    if args.runtime in ("process", "both"):
        asyncio.run(run_process(sizes))
    if args.runtime in ("containerd", "both"):
        asyncio.run(run_containerd(sizes, args.cni))
    print(f"max RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}"
          " MiB")


if __name__ == "__main__":
    main()
