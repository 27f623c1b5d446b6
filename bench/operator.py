"""Operator cost and reaction time with many nodes, against a real local control plane.

    .venv/bin/python bench/operator.py                       # 1000 nodes
    .venv/bin/python bench/operator.py --nodes 1000,5000

For each size N: a fresh control plane; N Nodes and N Leases in kube-node-lease created
directly (admin credentials); a load generator (worker processes) renews every Lease
each --renew seconds; one policy governs them all (grace --grace s, no partition guard,
no NoExecute pacing limit). The operator runs as a subprocess. Measured:

- steady state (all Leases renewed): operator CPU (% of one core) and RSS over a window;
- then the renewals of --victims (a share of the nodes) stop; for each of those nodes,
  delay = (moment a Node watch shows the unreachable NoSchedule taint) - (its last
  renewal + grace), p50/p99/max; the operator's CPU during that phase and its peak RSS.

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import urllib3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.cluster import LocalCluster  # noqa: E402
from e2e.cluster.cluster import free_port  # noqa: E402
from e2e.promtext import samples  # noqa: E402
from nodeagent.api.client import load_configuration  # noqa: E402
from nodeagent.api.policy import GROUP, PLURAL, VERSION  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / ".venv" / "bin" / "nodepulse-operator"
LABEL = "nodepulse-bench/pool"
TAINT = "node.kubernetes.io/unreachable"
TICKS = os.sysconf("SC_CLK_TCK")


class Raw:
    """Plain HTTPS to the API server with the admin client certificate: the load
    generator and the watch need no models, only speed."""

    def __init__(self, kubeconfig: Path, pool: int = 32) -> None:
        cfg = load_configuration(kubeconfig)
        self.host = cfg.host
        self.http = urllib3.PoolManager(
            maxsize=pool, cert_reqs=ssl.CERT_REQUIRED, ca_certs=cfg.ssl_ca_cert,
            cert_file=cfg.cert_file, key_file=cfg.key_file)

    def req(self, method: str, path: str, body: Any = None, ctype: str = "application/json",
            **kw: Any) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        r = self.http.request(method, self.host + path, body=data,
                              headers={"Content-Type": ctype}, **kw)
        if r.status >= 300:
            raise RuntimeError(f"{method} {path}: {r.status} {r.data[:300]!r}")
        return json.loads(r.data) if kw.get("preload_content", True) else r


def micro_now(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def node_name(i: int) -> str:
    return f"bench-{i:05d}"


def renew_worker(kubeconfig: str, indexes: list[int], renew: float, victims: int,
                 stop: Any, stop_victims: Any, last: Any, renewed: Any) -> None:
    """One load-generator process: renews its share of Leases, spread over the period."""
    raw = Raw(Path(kubeconfig), pool=16)
    pool = ThreadPoolExecutor(16)

    def one(i: int) -> None:
        if i < victims and stop_victims.is_set():
            return
        t = time.time()
        raw.req("PATCH", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/"
                f"{node_name(i)}", {"spec": {"renewTime": micro_now(t)}},
                ctype="application/merge-patch+json")
        if i < victims:
            last[i] = t
        with renewed.get_lock():
            renewed.value += 1

    while not stop.is_set():
        start = time.monotonic()
        step = renew / max(1, len(indexes))
        futures = []
        for k, i in enumerate(indexes):
            delay = start + k * step - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if stop.is_set():
                break
            futures.append(pool.submit(one, i))
        for f in futures:
            with contextlib.suppress(Exception):
                f.result()
        rest = start + renew - time.monotonic()
        if rest > 0:
            stop.wait(rest)
    pool.shutdown(wait=False, cancel_futures=True)


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def create_all(raw: Raw, n: int) -> None:
    def one(i: int) -> None:
        name = node_name(i)
        raw.req("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                          "metadata": {"name": name, "labels": {LABEL: "b"}}})
        raw.req("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40,
                     "renewTime": micro_now(time.time())}})
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(n)))


class TaintWatch(threading.Thread):
    """Records when each node first shows the unreachable NoSchedule taint."""

    def __init__(self, raw: Raw, rv: str) -> None:
        super().__init__(daemon=True)
        self.raw, self.rv = raw, rv
        self.seen: dict[str, float] = {}
        self.stop = False

    def note(self, obj: dict[str, Any], at: float) -> None:
        name = obj["metadata"]["name"]
        taints = (obj.get("spec") or {}).get("taints") or []
        if name not in self.seen and any(t["key"] == TAINT and t["effect"] == "NoSchedule"
                                         for t in taints):
            self.seen[name] = at

    def relist(self) -> None:
        """After a 410 or a broken stream: catch up from a list (taints found there
        are stamped now, which can only make a delay look longer)."""
        body = self.raw.req("GET", f"/api/v1/nodes?labelSelector={LABEL}%3Db")
        now = time.time()
        for obj in body["items"]:
            self.note(obj, now)
        self.rv = body["metadata"]["resourceVersion"]

    def run(self) -> None:
        while not self.stop:
            q = urllib.parse.urlencode({"watch": "1", "labelSelector": f"{LABEL}=b",
                                        "resourceVersion": self.rv,
                                        "allowWatchBookmarks": "true",
                                        "timeoutSeconds": "30"})
            try:
                r = self.raw.req("GET", f"/api/v1/nodes?{q}", preload_content=False,
                                 timeout=urllib3.Timeout(connect=5, read=60))
                buf = b""
                for chunk in r.stream(65536):
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        ev = json.loads(line)
                        if ev["type"] == "ERROR":  # 410 Gone: too old
                            raise RuntimeError(ev["object"].get("message"))
                        self.rv = ev["object"]["metadata"]["resourceVersion"]
                        if ev["type"] in ("ADDED", "MODIFIED"):
                            self.note(ev["object"], time.time())
                r.release_conn()
            except (urllib3.exceptions.HTTPError, RuntimeError):
                # The server ends a watch at timeoutSeconds, sometimes abruptly.
                if not self.stop:
                    self.relist()


def wait(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(1)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)  # nearest rank
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="nodepulse-bench-op-"))
    cluster = LocalCluster(workdir)
    procs: list[mp.Process] = []
    op: subprocess.Popen[bytes] | None = None
    stop, stop_victims = mp.Event(), mp.Event()
    try:
        cluster.up(log=lambda m: print(f"  {m}", file=sys.stderr))
        kubectl = cluster.binary("kubectl")
        subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "apply", "-f",
                        str(ROOT / "charts" / "nodepulse" / "crds")], check=True,
                       capture_output=True)
        subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "wait",
                        "--for=condition=Established", f"crd/{PLURAL}.{GROUP}"], check=True,
                       capture_output=True)
        raw = Raw(cluster.kubeconfig)
        raw.req("POST", f"/apis/{GROUP}/{VERSION}/{PLURAL}", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeStatusPolicy",
            "metadata": {"name": "bench"},
            "spec": {"nodeSelector": {"matchLabels": {LABEL: "b"}},
                     "heartbeat": {"leaseDurationSeconds": min(40, args.grace),
                                   "renewIntervalSeconds": int(args.renew)},
                     "failure": {"gracePeriodSeconds": args.grace,
                                 "maxUnreachableFraction": 1,
                                 "noExecuteTaintsPerMinute": 10000}}})
        t0 = time.monotonic()
        create_all(raw, n)
        print(f"  {n} Nodes and Leases created in {time.monotonic() - t0:.1f} s",
              file=sys.stderr)

        victims = max(1, int(n * args.victims))
        last = mp.Array("d", victims, lock=False)
        renewed = mp.Value("l", 0)
        shares = [list(range(w, n, args.workers)) for w in range(args.workers)]
        for share in shares:
            p = mp.Process(target=renew_worker, args=(str(cluster.kubeconfig), share,
                                                      args.renew, victims, stop,
                                                      stop_victims, last, renewed))
            p.start()
            procs.append(p)

        port = free_port()
        log = (workdir / "operator.log").open("wb")
        op = subprocess.Popen([str(OPERATOR), "--kubeconfig", str(cluster.kubeconfig),
                               "--metrics-port", str(port), "--identity", "bench",
                               *cluster.node_lifecycle_args()],
                              stdout=log, stderr=subprocess.STDOUT)

        def status() -> dict[str, Any]:
            return dict(raw.req("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}/bench")
                        .get("status") or {})
        t0 = time.monotonic()
        wait("operator governs every node", lambda: status().get("nodes") == n, 300)
        ann = raw.req("GET", f"/api/v1/nodes?labelSelector={LABEL}%3Db&limit=1")
        print(f"  operator converged in {time.monotonic() - t0:.1f} s "
              f"(policy status nodes={n})", file=sys.stderr)
        assert "nodepulse.dev/heartbeat" in ann["items"][0]["metadata"]["annotations"]
        time.sleep(args.settle)

        r0, c0, w0 = renewed.value, proc_cpu(op.pid), time.monotonic()
        rss_steady = []
        while time.monotonic() - w0 < args.window:
            time.sleep(2)
            rss_steady.append(proc_rss_mb(op.pid))
        dt = time.monotonic() - w0
        steady_cpu = (proc_cpu(op.pid) - c0) / dt * 100
        renew_rate = (renewed.value - r0) / dt
        st = status()
        if st.get("unreachableNodes"):
            print(f"  warning: {st['unreachableNodes']} nodes unreachable in steady state "
                  "(the load generator fell behind)", file=sys.stderr)

        watcher = TaintWatch(raw, "")
        watcher.relist()
        # Tainted already: the load generator fell behind (an overloaded machine).
        pre = set(watcher.seen)
        watcher.start()
        def patch_latency() -> tuple[float, float]:
            r = raw.req("GET", "/metrics", preload_content=False)
            text = r.data.decode()
            return (samples(text, "apiserver_request_duration_seconds_sum", resource="nodes",
                            verb="PATCH"),
                    samples(text, "apiserver_request_duration_seconds_count",
                            resource="nodes", verb="PATCH"))
        lat0 = patch_latency()
        stop_victims.set()
        c1, w1 = proc_cpu(op.pid), time.monotonic()
        victim_names = {node_name(i) for i in range(victims)}
        rss_peak = max(rss_steady)

        def all_seen() -> bool:
            nonlocal rss_peak
            rss_peak = max(rss_peak, proc_rss_mb(op.pid))
            return victim_names <= set(watcher.seen)
        wait("every victim tainted", all_seen, args.grace + 120)
        react_cpu = (proc_cpu(op.pid) - c1) / (time.monotonic() - w1) * 100
        watcher.stop = True
        lat1 = patch_latency()
        patch_ms = (lat1[0] - lat0[0]) / max(1.0, lat1[1] - lat0[1]) * 1000
        print(f"  API server: {lat1[1] - lat0[1]:.0f} Node PATCHes while reacting, mean "
              f"{patch_ms:.0f} ms each (server side)", file=sys.stderr)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            om = resp.read().decode()
        ticks = samples(om, "nodepulse_operator_monitor_tick_seconds_count")
        tick_mean = samples(om, "nodepulse_operator_monitor_tick_seconds_sum") / max(1, ticks)
        decided = samples(om, "nodepulse_operator_taint_delay_seconds_count")
        decide_mean = samples(om, "nodepulse_operator_taint_delay_seconds_sum") / max(1, decided)
        print(f"  operator: {ticks:.0f} monitor periods, mean work {tick_mean * 1000:.0f} ms; "
              f"mean grace-expiry-to-decision {decide_mean:.2f} s over {decided:.0f} taints",
              file=sys.stderr)
        delays = [watcher.seen[node_name(i)] - (last[i] + args.grace) for i in range(victims)
                  if node_name(i) not in pre]
        others = [nm for nm in watcher.seen if nm not in victim_names or nm in pre]
        return {"nodes": n, "victims": victims, "renew_per_s": renew_rate,
                "cpu_steady": steady_cpu, "rss_steady": statistics.mean(rss_steady),
                "cpu_react": react_cpu, "rss_peak": rss_peak,
                "p50": pct(delays, 50), "p99": pct(delays, 99), "max": max(delays),
                "false_taints": len(others)}
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGKILL)
        if op is not None:
            op.send_signal(signal.SIGTERM)
            try:
                op.wait(timeout=30)
            except subprocess.TimeoutExpired:
                op.kill()
                op.wait()
        cluster.remove()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1000", help="comma-separated sizes")
    parser.add_argument("--renew", type=float, default=10.0, help="Lease renew period, s")
    parser.add_argument("--grace", type=int, default=40, help="policy grace period, s")
    parser.add_argument("--victims", type=float, default=0.1,
                        help="share of nodes whose renewals stop")
    parser.add_argument("--workers", type=int, default=2, help="load-generator processes")
    parser.add_argument("--settle", type=float, default=10.0, help="s before measuring")
    parser.add_argument("--window", type=float, default=60.0, help="steady window, s")
    args = parser.parse_args()
    rows = [run_size(int(s), args) for s in args.nodes.split(",")]
    print(f"\noperator bench: renew every {args.renew:g} s, grace {args.grace} s, "
          f"{args.victims:.0%} of nodes stop renewing; {os.cpu_count()} CPUs shared with "
          "the control plane and the load generator")
    print(f"{'nodes':>6} {'renew/s':>8} {'cpu% steady':>11} {'rss MB':>7} "
          f"{'victims':>7} {'cpu% react':>10} {'rss peak':>8} {'p50 s':>6} {'p99 s':>6} "
          f"{'max s':>6} {'early':>5}")
    for r in rows:
        print(f"{r['nodes']:>6} {r['renew_per_s']:>8.1f} {r['cpu_steady']:>11.1f} "
              f"{r['rss_steady']:>7.1f} {r['victims']:>7} {r['cpu_react']:>10.1f} "
              f"{r['rss_peak']:>8.1f} {r['p50']:>6.2f} {r['p99']:>6.2f} {r['max']:>6.2f} "
              f"{r['false_taints']:>5}")
    print("delay = taint seen by a Node watch - (last renewal + grace); early = nodes "
          "tainted while their Leases were being renewed (0 unless the load generator fell "
          "behind; such victims are left out of the delays)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
