"""Heartbeat cost: efficient (Lease + NodeStatus on change) against legacy (full
NodeStatus every update period, no Lease), measured in the same run against a real
local control plane.

    .venv/bin/python bench/heartbeat.py                          # N = 1, 10 for 1 min each
    .venv/bin/python bench/heartbeat.py --nodes 1,10,50 --minutes 3

Each phase starts N agent processes (one per node, node credentials, default
settings), waits until every node is registered, then measures a steady-state window:
API writes and request bytes from the API server's own metrics
(apiserver_request_total, apiserver_request_body_size_bytes for leases and nodes, with
the API server's own identity-lease renewals, seen by a watch, taken out), the bytes
of node and lease watch events the API server fans out to its watchers (scheduler,
controller manager, the agents' own node watches; apiserver_watch_events_sizes), and
the agents' CPU seconds and resident memory from /proc. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes import client, watch  # noqa: E402

from e2e.harness.promtext import samples  # noqa: E402
from nodepulse_dev import LocalCluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / ".venv" / "bin" / "nodepulse-agent"
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")
BODY_VERBS = ("create", "update", "patch")
TICKS = 100.0  # os.sysconf("SC_CLK_TCK") on Linux


@dataclass
class Result:
    mode: str
    nodes: int
    minutes: float
    writes: float  # per node-minute
    lease_puts: float
    status_patches: float
    body_bytes: float  # per node-minute
    watch_bytes: float  # node and lease watch events sent to watchers, per node-minute
    cpu: float  # agent CPU seconds per node-minute
    rss_mb: float  # mean resident set per agent process


def metrics(cluster: LocalCluster) -> str:
    with cluster.api_client() as api:
        resp = api.call_api("GET", f"{api.configuration.host}/metrics")
        resp.read()
        return str(resp.data.decode())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class OtherLeaseWrites:
    """Counts lease writes in kube-system (the API server's identity lease), watching
    only there so that node Lease updates gain no extra watcher."""

    def __init__(self, api: client.ApiClient) -> None:
        self.times: list[float] = []
        self._w = watch.Watch()
        coord = client.CoordinationV1Api(api)
        rv = coord.list_namespaced_lease("kube-system").metadata.resource_version
        self._stopped = False

        def run() -> None:
            try:
                for ev in self._w.stream(coord.list_namespaced_lease, "kube-system",
                                         resource_version=rv, timeout_seconds=3600):
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.times.append(time.monotonic())
            except Exception:
                if not self._stopped:
                    raise

        threading.Thread(target=run, daemon=True).start()

    def between(self, a: float, b: float) -> int:
        return sum(1 for t in self.times if a <= t < b)

    def stop(self) -> None:
        self._stopped = True
        self._w.stop()


def writes_and_bytes(m: str) -> tuple[float, float, float, float, float, float]:
    lease_puts = samples(m, "apiserver_request_total", resource="leases", verb="PUT")
    patches = samples(m, "apiserver_request_total", resource="nodes", subresource="status",
                      verb="PATCH")
    writes = sum(samples(m, "apiserver_request_total", resource=r, verb=v)
                 for r in ("leases", "nodes") for v in WRITE_VERBS)
    body = sum(samples(m, "apiserver_request_body_size_bytes_sum", resource=r, verb=v)
               for r in ("leases", "nodes") for v in BODY_VERBS)
    lease_body = samples(m, "apiserver_request_body_size_bytes_sum", resource="leases",
                         verb="update")
    fanout = sum(samples(m, "apiserver_watch_events_sizes_sum", resource=r)
                 for r in ("leases", "nodes"))
    return writes, lease_puts, patches, body, lease_body, fanout


def run_phase(cluster: LocalCluster, others: OtherLeaseWrites, mode: str, n: int,
              minutes: float, workdir: Path) -> Result:
    api = cluster.api_client()
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)
    names = [f"bench-{mode[:3]}-{n}-{i}" for i in range(n)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in names:
            log = (workdir / f"{name}.log").open("wb")
            procs.append(subprocess.Popen(
                [str(AGENT), "--node-name", name, "--heartbeat-mode", mode,
                 "--kubeconfig", str(cluster.node_kubeconfig(name)),
                 "--healthz-bind-address", "", "--root-dir", str(workdir / name)],
                stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60 + 3 * n

        def registered() -> bool:
            have = {x.metadata.name for x in core.list_node().items}
            if not set(names) <= have:
                return False
            if mode == "legacy":
                return True
            leases = {x.metadata.name for x in coord.list_namespaced_lease(
                "kube-node-lease").items}
            return set(names) <= leases
        while not registered():
            dead = [p.args for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"agents did not come up ({dead or 'timeout'}); "
                                   f"logs in {workdir}")
            time.sleep(0.5)
        time.sleep(2)  # the registration reports land
        m0, t0 = metrics(cluster), time.monotonic()
        cpu0 = sum(cpu_seconds(p.pid) for p in procs)
        time.sleep(minutes * 60)
        m1, t1 = metrics(cluster), time.monotonic()
        cpu1 = sum(cpu_seconds(p.pid) for p in procs)
        rss = sum(rss_mb(p.pid) for p in procs) / n
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    for name in names:  # leave the cluster as it was
        for delete in (lambda n=name: core.delete_node(n),
                       lambda n=name: coord.delete_namespaced_lease(n, "kube-node-lease")):
            with contextlib.suppress(client.ApiException):
                delete()
    a, b = writes_and_bytes(m0), writes_and_bytes(m1)
    writes, puts, patches, body, lease_body, fanout = (
        y - x for x, y in zip(a, b, strict=True))
    own = others.between(t0, t1)  # the API server's identity lease, not ours
    all_puts = samples(m1, "apiserver_request_body_size_bytes_count", resource="leases",
                       verb="update") - samples(m0, "apiserver_request_body_size_bytes_count",
                                                resource="leases", verb="update")
    mean_put = lease_body / all_puts if all_puts else 0.0
    node_minutes = n * (t1 - t0) / 60
    return Result(mode, n, round((t1 - t0) / 60, 2),
                  (writes - own) / node_minutes, (puts - own) / node_minutes,
                  patches / node_minutes, (body - own * mean_put) / node_minutes,
                  fanout / node_minutes,
                  (cpu1 - cpu0) / node_minutes, rss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,10",
                        help="comma-separated agent counts (default 1,10; try 1,10,50)")
    parser.add_argument("--minutes", type=float, default=1.0,
                        help="measured minutes per phase (default 1)")
    parser.add_argument("--modes", default="efficient,legacy")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.nodes.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    workdir = Path(tempfile.mkdtemp(prefix="nodepulse-bench-heartbeat-"))
    cluster = LocalCluster(workdir / "cluster")
    results: list[Result] = []
    try:
        cluster.up(log=lambda msg: print(msg, file=sys.stderr))
        others = OtherLeaseWrites(cluster.api_client())
        for n in sizes:
            for mode in modes:
                print(f"-- {mode}, {n} agent(s), {args.minutes:g} min", file=sys.stderr)
                results.append(run_phase(cluster, others, mode, n, args.minutes, workdir))
        others.stop()
    finally:
        cluster.remove()
    header = (f"{'mode':<10} {'nodes':>5} {'min':>5} {'writes':>8} {'lease PUT':>9} "
              f"{'status PATCH':>12} {'req bytes':>10} {'watch bytes':>11} "
              f"{'agent CPU s':>11} {'RSS MB':>7}")
    print("per node-minute (steady state, after registration); RSS per agent process")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.mode:<10} {r.nodes:>5} {r.minutes:>5.2f} {r.writes:>8.2f} "
              f"{r.lease_puts:>9.2f} {r.status_patches:>12.2f} {r.body_bytes:>10.0f} "
              f"{r.watch_bytes:>11.0f} {r.cpu:>11.3f} {r.rss_mb:>7.1f}")
    for n in sizes:
        eff = next((r for r in results if r.nodes == n and r.mode == "efficient"), None)
        leg = next((r for r in results if r.nodes == n and r.mode == "legacy"), None)
        if eff and leg and eff.body_bytes:
            fan = f", watch bytes x{leg.watch_bytes / eff.watch_bytes:.1f}" \
                if eff.watch_bytes else ""
            print(f"N={n}: legacy/efficient request bytes x{leg.body_bytes / eff.body_bytes:.1f}, "
                  f"writes x{leg.writes / eff.writes:.2f}{fan}")
    print(f"agent logs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
