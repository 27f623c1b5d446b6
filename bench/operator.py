"""Operator cost and reaction time with many nodes, against a real local control plane,
side by side with kube-controller-manager's node-lifecycle controller (the anchor).

    .venv/bin/python -m bench.operator                       # 1000 nodes
    .venv/bin/python -m bench.operator --nodes 1000,5000 --out docs/benchmarks

For each size N and each engine, a fresh control plane; N Nodes (posted Ready=True, as
an agent registers them) and N Leases in kube-node-lease created directly (admin
credentials); a load generator (worker processes) renews every Lease each --renew
seconds. The engines:

- **operator**: nodepulse-operator in exclusive mode (the controller manager without
  its node-lifecycle controller), one policy governing every node (grace --grace s, no
  partition guard, no NoExecute pacing limit);
- **kcm**: kube-controller-manager with every controller, its node-lifecycle one at
  --node-monitor-grace-period=--grace and its other defaults (--node-monitor-period 5s,
  its client's default QPS), no operator.

Measured for each:

- steady state (all Leases renewed, after the engine took admission's not-ready taint off
  every Node): the engine's CPU (% of one core) and RSS over a window;
- then the renewals of --victims (a share of the nodes) stop; for each of those nodes,
  delay = (moment a Node watch shows the unreachable NoSchedule taint) - (its last
  renewal + grace), p50/p99/max; the engine's CPU during that phase and its peak RSS;
  the API server's, etcd's and the load generator's CPU, and the whole machine's busy
  share, in the same phase: what bounds the delay when the machine is saturated.

The kcm engine's CPU is the whole controller manager's (every controller; the others are
idle here). `--profile DIR` samples the operator with py-spy (if installed) in the
steady window and while reacting (the thread holding the GIL: where its Python CPU
goes) and prints a summary; sampling slows it a little, so take the figures from a run
without it. With --out, the figures go to
DIR/operator.md, operator.json and operator.png. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import http.client
import json
import math
import multiprocessing as mp
import os
import shutil
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

from bench.scale import machine  # noqa: E402
from e2e.harness.ports import free_port  # noqa: E402
from e2e.harness.promtext import samples  # noqa: E402
from nodeagent.api.client import load_credentials  # noqa: E402
from nodeagent.api.policy import GROUP, PLURAL, VERSION  # noqa: E402
from nodepulse_dev import LocalCluster, build  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / ".venv" / "bin" / "nodepulse-operator"
LABEL = "nodepulse-bench/pool"
TAINT = "node.kubernetes.io/unreachable"
NOT_READY = "node.kubernetes.io/not-ready"
TICKS = os.sysconf("SC_CLK_TCK")
ENGINES = ("operator", "kcm")


class Raw:
    """Plain HTTPS to the API server with the admin client certificate: the load
    generator and the watch need no models, only speed."""

    def __init__(self, kubeconfig: Path, pool: int = 32) -> None:
        creds = load_credentials(kubeconfig)
        self.host = creds.server
        self.http = urllib3.PoolManager(
            maxsize=pool, cert_reqs=ssl.CERT_REQUIRED, ca_certs=creds.file_of("ca"),
            cert_file=creds.file_of("cert"), key_file=creds.file_of("key"))

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


class LeaseRenewer:
    """Lease renewals at the lowest client cost: a kept-alive http.client connection per
    thread and a body formatted, not serialized (urllib3 and json cost the load generator
    ~3 ms of CPU per renewal, more than the 2 cores can give 500 a second)."""

    PATH = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/"

    def __init__(self, kubeconfig: Path) -> None:
        creds = load_credentials(kubeconfig)
        url = urllib.parse.urlsplit(creds.server)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.ctx = creds.ssl_context() or ssl.create_default_context()
        self.local = threading.local()

    def renew(self, name: str, t: float) -> None:
        body = b'{"spec":{"renewTime":"%s"}}' % micro_now(t).encode()
        for attempt in (1, 2):  # a kept-alive connection the server closed: once more
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPSConnection(
                    self.host, self.port, context=self.ctx, timeout=30)
            try:
                conn.request("PATCH", self.PATH + name, body, {
                    "Content-Type": "application/merge-patch+json",
                    "Accept": "application/json"})
                resp = conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt == 2:
                    raise
                continue
            if resp.status >= 300:
                raise RuntimeError(f"PATCH lease {name}: {resp.status}")
            return


def renew_worker(kubeconfig: str, indexes: list[int], renew: float, victims: int,
                 stop: Any, stop_victims: Any, last: Any, renewed: Any) -> None:
    """One load-generator process: renews its share of Leases, spread over the period."""
    renewer = LeaseRenewer(Path(kubeconfig))
    pool = ThreadPoolExecutor(48)

    def one(i: int) -> None:
        if i < victims and stop_victims.is_set():
            return
        renewer.renew(node_name(i), time.time())
        if i < victims:
            # Renewed once the API server has answered: what the engines can see from
            # then on (the renewTime written is a little earlier).
            last[i] = time.time()
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


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = v[3] + v[4]  # idle, iowait
    return (sum(v) - idle) / TICKS, sum(v) / TICKS


class CpuMeter:
    """CPU of some processes (and of the machine) between start() and read()."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids

    def _now(self) -> dict[str, float]:
        out = {what: sum(proc_cpu(p) for p in pids) for what, pids in self.pids.items()}
        out["busy"], out["total"] = machine_busy()
        return out

    def start(self) -> None:
        self.t0, self.c0 = time.monotonic(), self._now()

    def read(self) -> dict[str, float]:
        """% of one core per process group; "machine": % of all cores busy."""
        dt, c1 = time.monotonic() - self.t0, self._now()
        out = {what: (c1[what] - self.c0[what]) / dt * 100 for what in self.pids}
        out["machine"] = (c1["busy"] - self.c0["busy"]) / max(1e-9, c1["total"]
                                                               - self.c0["total"]) * 100
        return out


def create_all(raw: Raw, n: int) -> None:
    def one(i: int) -> None:
        name = node_name(i)
        now = micro_now(time.time()).split(".")[0] + "Z"
        # Registered as an agent does: Ready=True in the Node's first status (the
        # controller manager judges a node that never posted Ready by its startup grace).
        raw.req("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {LABEL: "b"}},
            "status": {"conditions": [{"type": "Ready", "status": "True",
                                       "reason": "BenchReady", "message": "bench",
                                       "lastHeartbeatTime": now,
                                       "lastTransitionTime": now}]}})
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


class Profile:
    """py-spy attached to the operator for one phase, its samples summarized."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "py-spy"), "record", "--pid", str(pid), "--rate",
             "100", "--format", "raw", "--gil", "--nonblocking", "-o", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @staticmethod
    def available() -> bool:
        return (ROOT / ".venv" / "bin" / "py-spy").exists()

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return summarize(self.out) if self.out.exists() else "  (py-spy wrote nothing)"


def summarize(path: Path, top: int = 15) -> str:
    """Inclusive and self shares of the sampled CPU, by function (raw py-spy stacks)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split("/")[-1]
                  if " (" in f else f for f in stack.split(";")]
        for f in set(frames):
            inclusive[f] += n
        own[frames[-1]] += n
    if not total:
        return "  (no samples)"
    lines = [f"  {total} samples; inclusive:"]
    lines += [f"    {c / total:6.1%}  {f}" for f, c in inclusive.most_common(top)]
    lines.append("  self:")
    lines += [f"    {c / total:6.1%}  {f}" for f, c in own.most_common(top)]
    return "\n".join(lines)


def wait(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(1)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)  # nearest rank
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


@dataclasses.dataclass
class Row:
    engine: str
    nodes: int
    victims: int
    renew_per_s: float
    cpu_steady: float  # % of one core
    rss_steady: float  # MB
    cpu_react: float
    rss_peak: float
    p50: float  # s, grace expiry to the taint seen by a watch
    p99: float
    max: float
    false_taints: int
    apiserver_react: float  # % of one core while reacting
    etcd_react: float
    loadgen_react: float
    machine_react: float  # % of all cores busy while reacting
    patch_ms: float  # the API server's mean Node PATCH time while reacting
    patches: int  # Node and Node status PATCHes while reacting
    decide_mean: float | None = None  # operator: grace expiry to write done, mean s


def run_size(n: int, engine: str, args: argparse.Namespace) -> Row:
    workdir = Path(tempfile.mkdtemp(prefix="nodepulse-bench-op-"))
    kcm = engine == "kcm"
    cluster = LocalCluster(workdir, node_grace=args.grace if kcm else None,
                           audit_node_writes=False)
    procs: list[mp.Process] = []
    op: subprocess.Popen[bytes] | None = None
    stop, stop_victims = mp.Event(), mp.Event()
    print(f"{engine}, {n} nodes:", file=sys.stderr)
    try:
        cluster.up(log=lambda m: print(f"  {m}", file=sys.stderr))
        raw = Raw(cluster.kubeconfig)
        if not kcm:
            kubectl = cluster.binary("kubectl")
            subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "apply",
                            "-f", str(ROOT / "charts" / "nodepulse" / "crds")], check=True,
                           capture_output=True)
            subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "wait",
                            "--for=condition=Established", f"crd/{PLURAL}.{GROUP}"],
                           check=True, capture_output=True)
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
        if kcm:
            pid = cluster.pids["kube-controller-manager"]
        else:
            log = (workdir / "operator.log").open("wb")
            op = subprocess.Popen([str(OPERATOR), "--kubeconfig", str(cluster.kubeconfig),
                                   "--metrics-port", str(port), "--identity", "bench",
                                   *cluster.node_lifecycle_args(), *args.operator_args],
                                  stdout=log, stderr=subprocess.STDOUT)
            pid = op.pid

        def status() -> dict[str, Any]:
            return dict(raw.req("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}/bench")
                        .get("status") or {})

        def converged() -> bool:
            # Both engines take admission's not-ready taint off a node posted Ready.
            if not kcm and status().get("nodes") != n:
                return False
            body = raw.req("GET", f"/api/v1/nodes?labelSelector={LABEL}%3Db")
            return not any(t["key"] == NOT_READY for obj in body["items"]
                           for t in (obj.get("spec") or {}).get("taints") or [])
        t0 = time.monotonic()
        wait(f"{engine} takes not-ready off every node", converged, 600)
        print(f"  {engine} converged in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        if not kcm:
            ann = raw.req("GET", f"/api/v1/nodes?labelSelector={LABEL}%3Db&limit=1")
            assert "nodepulse.dev/heartbeat" in ann["items"][0]["metadata"]["annotations"]
        time.sleep(args.settle)

        meter = CpuMeter({"engine": [pid], "apiserver": [cluster.pids["kube-apiserver"]],
                          "etcd": [cluster.pids["etcd"]],
                          "loadgen": [p.pid for p in procs if p.pid]})
        profile = (Profile(pid, workdir / "steady.pyspy") if args.profile and not kcm
                   else None)
        r0, w0 = renewed.value, time.monotonic()
        meter.start()
        rss_steady = []
        while time.monotonic() - w0 < args.window:
            time.sleep(2)
            rss_steady.append(proc_rss_mb(pid))
        steady = meter.read()
        renew_rate = (renewed.value - r0) / (time.monotonic() - w0)
        if profile:
            summary = profile.stop()
            keep(args, workdir / "steady.pyspy", f"{engine}-{n}-steady.pyspy")
            print(f"  profile, steady window:\n{summary}", file=sys.stderr)
        taints_now = raw.req("GET", f"/api/v1/nodes?labelSelector={LABEL}%3Db")
        early = sum(1 for obj in taints_now["items"]
                    for t in (obj.get("spec") or {}).get("taints") or [] if t["key"] == TAINT)
        if early:
            print(f"  warning: {early} unreachable taints in steady state "
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
        profile = (Profile(pid, workdir / "react.pyspy") if args.profile and not kcm
                   else None)
        stop_victims.set()
        meter.start()
        victim_names = {node_name(i) for i in range(victims)}
        rss_peak = max(rss_steady)

        def all_seen() -> bool:
            nonlocal rss_peak
            rss_peak = max(rss_peak, proc_rss_mb(pid))
            return victim_names <= set(watcher.seen)
        wait("every victim tainted", all_seen, args.grace + 300)
        react = meter.read()
        watcher.stop = True
        if profile:
            summary = profile.stop()
            keep(args, workdir / "react.pyspy", f"{engine}-{n}-react.pyspy")
            print(f"  profile, reacting:\n{summary}", file=sys.stderr)
        lat1 = patch_latency()
        patches = lat1[1] - lat0[1]
        patch_ms = (lat1[0] - lat0[0]) / max(1.0, patches) * 1000
        print(f"  API server: {patches:.0f} Node PATCHes while reacting, mean "
              f"{patch_ms:.0f} ms each (server side)", file=sys.stderr)
        decide_mean = None
        if not kcm:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                        timeout=10) as resp:
                om = resp.read().decode()
            ticks = samples(om, "nodepulse_operator_monitor_tick_seconds_count")
            tick_mean = samples(om, "nodepulse_operator_monitor_tick_seconds_sum") / max(1,
                                                                                         ticks)
            decided = samples(om, "nodepulse_operator_taint_delay_seconds_count")
            decide_mean = samples(om, "nodepulse_operator_taint_delay_seconds_sum") / max(
                1, decided)
            writes = {ln.split("{", 1)[1].split("}")[0]: float(ln.rsplit(" ", 1)[1])
                      for ln in om.splitlines()
                      if ln.startswith(("nodepulse_operator_writes_total{",
                                        "nodepulse_operator_events_total{"))}
            print(f"  operator writes and Events: {writes}", file=sys.stderr)
            print(f"  operator: {ticks:.0f} monitor periods, mean work "
                  f"{tick_mean * 1000:.0f} ms; mean grace-expiry-to-write-done "
                  f"{decide_mean:.2f} s over {decided:.0f} taints", file=sys.stderr)
        delays = [watcher.seen[node_name(i)] - (last[i] + args.grace) for i in range(victims)
                  if node_name(i) not in pre]
        others = [nm for nm in watcher.seen if nm not in victim_names or nm in pre]
        row = Row(engine=engine, nodes=n, victims=victims, renew_per_s=renew_rate,
                  cpu_steady=steady["engine"], rss_steady=statistics.mean(rss_steady),
                  cpu_react=react["engine"], rss_peak=rss_peak,
                  p50=pct(delays, 50), p99=pct(delays, 99), max=max(delays),
                  false_taints=len(others), apiserver_react=react["apiserver"],
                  etcd_react=react["etcd"], loadgen_react=react["loadgen"],
                  machine_react=react["machine"], patch_ms=patch_ms, patches=int(patches),
                  decide_mean=decide_mean)
        print("  " + json.dumps(dataclasses.asdict(row)), file=sys.stderr)
        return row
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


def keep(args: argparse.Namespace, path: Path, name: str) -> None:
    if path.exists():
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(args.profile) / name)


def table(rows: list[Row]) -> str:
    head = ("| engine | nodes | renew/s | CPU % steady | RSS MB | victims | CPU % reacting "
            "| RSS peak MB | p50 s | p99 s | max s | early | API server CPU % | etcd CPU % "
            "| load gen CPU % | machine busy % | Node PATCHes | mean PATCH ms |\n"
            + "|---" * 18 + "|\n")
    return head + "".join(
        f"| {r.engine} | {r.nodes} | {r.renew_per_s:.0f} | {r.cpu_steady:.1f} "
        f"| {r.rss_steady:.0f} | {r.victims} | {r.cpu_react:.1f} | {r.rss_peak:.0f} "
        f"| {r.p50:.2f} | {r.p99:.2f} | {r.max:.2f} | {r.false_taints} "
        f"| {r.apiserver_react:.0f} | {r.etcd_react:.0f} | {r.loadgen_react:.0f} "
        f"| {r.machine_react:.0f} | {r.patches} | {r.patch_ms:.0f} |\n" for r in rows)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("grace expiry to taint, p99 s", "p99"), ("grace expiry to taint, p50 s", "p50"),
              ("engine CPU % of a core, reacting", "cpu_react")]
    for ax, (title, attr) in zip(axes, panels, strict=True):
        for engine in ENGINES:
            mine = sorted((r for r in rows if r.engine == engine), key=lambda r: r.nodes)
            if mine:
                ax.plot([r.nodes for r in mine], [getattr(r, attr) for r in mine],
                        marker="o", label=engine)
        ax.set_title(title)
        ax.set_xlabel("nodes")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("nodepulse operator vs kube-controller-manager node lifecycle, "
                 "10 % of nodes silent at once (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_docs(rows: list[Row], args: argparse.Namespace, command: str) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "operator.png")
    (out / "operator.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows],
                                                  indent=1))
    versions = ", ".join(f"{n} {build.TOOLS[n].version}"
                         for n in ("kube-apiserver", "kube-controller-manager", "etcd"))
    (out / "operator.md").write_text(f"""# Operator: silent nodes, nodepulse vs the controller manager

Written by `bench/operator.py`; do not edit by hand.

- command: `{command}`
- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}
- machine: {machine()}, shared by the control plane, the load generator and the engine
- control plane: {versions} (local, loopback, etcd with --unsafe-no-fsync)
- scenario: every Lease renewed each {args.renew:g} s by a load generator
  ({args.workers} processes); grace {args.grace} s; {args.victims:.0%} of the nodes stop
  renewing at once; steady window {args.window:g} s

Engines, each on a fresh control plane: **operator** = `nodepulse-operator` in exclusive
mode (`{" ".join(args.operator_args) or "default flags"}`), one policy over every node
(grace {args.grace} s, no partition guard, no NoExecute pacing limit); **kcm** =
kube-controller-manager's node-lifecycle controller with
`--node-monitor-grace-period={args.grace}s` and its other defaults
(`--node-monitor-period` 5 s, its client's default QPS), no operator.

delay = the moment a Node watch shows `node.kubernetes.io/unreachable:NoSchedule` minus
(the API server's answer to the node's last renewal + grace). CPU is % of one core;
"reacting" is from the moment the victims stop until every victim is tainted; the API
server, etcd, load generator and machine figures are from that phase (machine: % of
all {os.cpu_count()} cores busy).
The kcm engine's CPU and RSS are the whole controller manager's. "early": nodes
tainted while still renewed (the load generator fell behind; left out of the delays).

{table(rows)}
![delay and CPU](operator.png)
""")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1000", help="comma-separated sizes")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated, of: %(default)s")
    parser.add_argument("--renew", type=float, default=10.0, help="Lease renew period, s")
    parser.add_argument("--grace", type=int, default=40, help="grace period, s")
    parser.add_argument("--victims", type=float, default=0.1,
                        help="share of nodes whose renewals stop")
    parser.add_argument("--workers", type=int, default=2, help="load-generator processes")
    parser.add_argument("--settle", type=float, default=10.0, help="s before measuring")
    parser.add_argument("--window", type=float, default=60.0, help="steady window, s")
    parser.add_argument("--profile", metavar="DIR",
                        help="sample the operator with py-spy; raw stacks kept in DIR")
    parser.add_argument("--operator-arg", dest="operator_args", action="append", default=[],
                        help="extra flag for nodepulse-operator (repeatable)")
    parser.add_argument("--out", help="write operator.md/.json/.png into this folder")
    args = parser.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    if bad := [e for e in engines if e not in ENGINES]:
        parser.error(f"--engines: unknown {', '.join(bad)} (known: {', '.join(ENGINES)})")
    if args.profile and not Profile.available():
        parser.error("--profile: py-spy is not installed (.venv/bin/pip install py-spy)")
    command = "python -m bench.operator " + " ".join(argv if argv is not None
                                                     else sys.argv[1:])
    rows = [run_size(int(s), e, args) for s in args.nodes.split(",") for e in engines]
    print(f"\noperator bench: renew every {args.renew:g} s, grace {args.grace} s, "
          f"{args.victims:.0%} of nodes stop renewing; {os.cpu_count()} CPUs shared with "
          "the control plane and the load generator\n")
    print(table(rows))
    print("delay = taint seen by a Node watch - (last renewal + grace); early = nodes "
          "tainted while their Leases were being renewed (0 unless the load generator fell "
          "behind; such victims are left out of the delays)")
    if args.out:
        write_docs(rows, args, command)
        print(f"wrote {args.out}/operator.md, operator.json, operator.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
