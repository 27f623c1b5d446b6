"""The kubelet and nodepulse side by side: two identical kind workers of one cluster, the
same node image and containerd, one with the kubelet as its node agent, one with
nodepulse-agent (e2e/kind/agent_node.py). Prints figures only; asserts nothing.

    .venv/bin/python -m bench.kubelet                    # 3 rounds each, about 30 min
    .venv/bin/python -m bench.kubelet --rounds 5 --write-docs

Each round, for one agent at a time (the order alternates from round to round, so
neither always goes first):

1. idle: the agent's CPU and resident memory over a window, with no pod of ours;
2. a burst of 100 pods bound to its node (`spec.nodeName`), each with the service
   account's token volume, a ConfigMap volume and an HTTP readiness probe (agnhost
   netexec); startup = the pod's create call to phase Running seen by a watch;
3. 10 more, to 110, all Ready; the agent's CPU and memory over the same window;
4. all deleted, until none is left.

The agent is the main process of the node's `kubelet` unit (the wrapper of the nodepulse
node execs the agent): CPU = its user and system time, memory = its VmRSS. The API
requests an agent makes are counted by the API server's audit log (the node's user,
every request, counted once when it arrives): those from the burst's start to the last
pod's deletion, less the idle rate over that time, per pod.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench import measure
from e2e.harness.waits import eventually

AGENTS = ("kubelet", "nodepulse")
LABEL = "bench.nodepulse.dev/agent"  # on each worker: which agent runs it
NAMESPACE = "bench-kubelet"
BURST = 100
STEADY = 110
AUDIT_DIR = "/etc/kubernetes/audit"
AUDIT_LOG = "/var/log/kubernetes/audit.log"
CLUSTER_NAME = "np-bench-kubelet"
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "kubelet.md"


# ---- what is measured, as plain functions (tests/test_bench_kubelet.py)
def cpu_seconds(stat: str, ticks_per_second: float) -> float:
    """User plus system time of a /proc/PID/stat line, in seconds."""
    fields = stat.rpartition(")")[2].split()  # the name may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def rss_mb(status: str) -> float:
    """VmRSS of a /proc/PID/status text, in MB (10^6 bytes)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise ValueError("no VmRSS line: the process is gone or a zombie")


def audit_requests(lines: Iterable[str], user: str, start: float, end: float) -> Counter[str]:
    """The requests `user` made that arrived within [start, end) (epoch seconds), by
    "verb resource[/subresource]", from audit log lines (one event per request stage;
    a request counts once, by its audit ID)."""
    seen: set[str] = set()
    out: Counter[str] = Counter()
    for line in lines:
        if f'"{user}"' not in line:  # most lines are another user's: skip the parse
            continue
        ev = json.loads(line)
        if ev.get("user", {}).get("username") != user or ev["auditID"] in seen:
            continue
        seen.add(ev["auditID"])
        at = datetime.datetime.fromisoformat(ev["requestReceivedTimestamp"]).timestamp()
        if start <= at < end:
            ref = ev.get("objectRef") or {}
            what = "/".join(x for x in (ref.get("resource"), ref.get("subresource")) if x)
            out[f"{ev['verb']} {what or ev.get('requestURI', '?')}"] += 1
    return out


def per_pod(requests: float, idle_rate: float, seconds: float, pods: int) -> float:
    """Requests beyond the idle rate over `seconds`, per pod."""
    return measure.net(requests, idle_rate, seconds) / pods


@dataclass
class Round:
    agent: str
    round: int
    idle_cpu_pct: float       # of one core, over the idle window
    idle_rss_mb: float        # mean of the window's samples
    busy_cpu_pct: float       # with 110 pods Ready
    busy_rss_mb: float
    startup_s: list[float]    # the burst's pods, create to Running
    burst_cpu_s: float        # the agent's CPU from the burst's start until 110 Ready
    requests_per_pod: float
    requests: dict[str, float] = field(default_factory=dict)  # by kind, per pod (idle ones included)

    @property
    def p50(self) -> float:
        return measure.percentile(self.startup_s, 50)

    @property
    def p99(self) -> float:
        return measure.percentile(self.startup_s, 99)


FIGURES: dict[str, tuple[str, Callable[[Round], float], str]] = {
    "idle_rss": ("RSS idle (MB)", lambda r: r.idle_rss_mb, "{:.1f}"),
    "idle_cpu": ("CPU idle (% of a core)", lambda r: r.idle_cpu_pct, "{:.2f}"),
    "busy_rss": (f"RSS with {STEADY} pods (MB)", lambda r: r.busy_rss_mb, "{:.1f}"),
    "busy_cpu": (f"CPU with {STEADY} pods (% of a core)", lambda r: r.busy_cpu_pct, "{:.2f}"),
    "burst_cpu": (f"CPU for the burst, to {STEADY} Ready (s)", lambda r: r.burst_cpu_s,
                  "{:.1f}"),
    "p50": (f"startup p50, burst of {BURST} (s)", lambda r: r.p50, "{:.2f}"),
    "p99": (f"startup p99, burst of {BURST} (s)", lambda r: r.p99, "{:.2f}"),
    "requests": ("API requests per pod", lambda r: r.requests_per_pod, "{:.1f}"),
}


def summary(rounds: list[Round]) -> dict[str, dict[str, tuple[float, float, float]]]:
    """figure -> agent -> (min, median, max) over the agent's rounds; the startup
    percentiles of all its rounds' pods pooled (median = pooled, min/max = rounds')."""
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for key, (_, get, _) in FIGURES.items():
        out[key] = {}
        for agent in AGENTS:
            mine = [r for r in rounds if r.agent == agent]
            if not mine:
                continue
            lo, mid, hi = measure.spread([get(r) for r in mine])
            if key in ("p50", "p99"):
                pooled = measure.pool(r.startup_s for r in mine)
                mid = measure.percentile(pooled, 50 if key == "p50" else 99)
            out[key][agent] = (lo, mid, hi)
    return out


def verdict(kubelet_range: tuple[float, float, float],
            nodepulse_range: tuple[float, float, float]) -> str:
    """"lower" or "higher" when every round of nodepulse is below (above) every round of
    the kubelet; "ranges overlap" when the rounds cannot tell the two apart."""
    if nodepulse_range[2] < kubelet_range[0]:
        return "lower"
    if nodepulse_range[0] > kubelet_range[2]:
        return "higher"
    return "ranges overlap"


def render(rounds: list[Round], markdown: bool = False) -> str:
    s = summary(rounds)
    head = ["figure", "kubelet", "nodepulse", "nodepulse / kubelet", "nodepulse's rounds"]
    rows = []
    for key, (label, _, fmt) in FIGURES.items():
        cells = [label]
        for agent in AGENTS:
            lo, mid, hi = s[key].get(agent, (float("nan"),) * 3)
            cells.append(f"{fmt.format(mid)} ({fmt.format(lo)}-{fmt.format(hi)})")
        k, n = s[key].get("kubelet"), s[key].get("nodepulse")
        cells += [f"{measure.ratio(n[1], k[1]):.2f}x", verdict(k, n)] if k and n else ["-"] * 2
        rows.append(cells)
    lines = measure.table(head, rows, markdown)
    kinds: dict[str, Counter[str]] = {a: Counter() for a in AGENTS}
    for r in rounds:
        kinds[r.agent].update({k: v / sum(x.agent == r.agent for x in rounds)
                               for k, v in r.requests.items()})
    top = sorted(set(kinds["kubelet"]) | set(kinds["nodepulse"]),
                 key=lambda k: -(kinds["kubelet"][k] + kinds["nodepulse"][k]))
    lines += ["", "API requests per pod by kind (mean of the rounds; the idle ones, Lease "
              "renewals mostly, not taken off):", ""]
    lines += measure.table(["request", "kubelet", "nodepulse"],
                            [[k, f"{kinds['kubelet'][k]:.2f}", f"{kinds['nodepulse'][k]:.2f}"]
                             for k in top if max(abs(kinds[a][k]) for a in AGENTS) >= 0.05],
                            markdown)
    return "\n".join(lines)


# ---- the cluster
def cluster_config(workdir: Path) -> Path:
    """The [Conformance] cluster's config (e2e/conformance/kind-config.yaml) with one
    worker per agent, labelled with it, room for the pods of a round beside the
    DaemonSets', and the API server's audit log of the workers' requests."""
    from e2e.conformance import kind
    from e2e.kind import node

    cfg = yaml.safe_load(kind.CONFIG.read_text())
    cfg["name"] = CLUSTER_NAME
    policy = workdir / "audit"
    policy.mkdir(parents=True, exist_ok=True)
    users = [f"system:node:{CLUSTER_NAME}-worker{n}" for n in ("", "2")]
    (policy / "policy.yaml").write_text(yaml.safe_dump({
        "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [{"level": "Metadata", "users": users}, {"level": "None"}]}))
    cfg["nodes"] = [
        {"role": "control-plane", "image": node.image_name(),
         "extraMounts": [{"hostPath": str(policy), "containerPath": AUDIT_DIR,
                          "readOnly": True}]},
        *({"role": "worker", "image": kind.node_image(a), "labels": {LABEL: a}}
          for a in AGENTS)]
    cfg["kubeadmConfigPatches"] += [
        yaml.safe_dump({"kind": "KubeletConfiguration", "maxPods": STEADY + 10}),
        yaml.safe_dump({"kind": "ClusterConfiguration", "apiServer": {
            "extraArgs": {"audit-policy-file": f"{AUDIT_DIR}/policy.yaml",
                          "audit-log-path": AUDIT_LOG},
            "extraVolumes": [
                {"name": "audit-policy", "hostPath": AUDIT_DIR, "mountPath": AUDIT_DIR,
                 "readOnly": True, "pathType": "Directory"},
                {"name": "audit-log", "hostPath": str(Path(AUDIT_LOG).parent),
                 "mountPath": str(Path(AUDIT_LOG).parent),
                 "pathType": "DirectoryOrCreate"}]}})]
    out = workdir / "kind-config.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


class Bench:
    """One kind cluster, its two workers and what is measured on them."""

    def __init__(self, cluster: Any, args: argparse.Namespace, agnhost: str) -> None:
        from kubernetes import client

        from nodeagent.api.client import new_api_client

        self.cluster = cluster
        self.args = args
        self.agnhost = agnhost
        self.api = new_api_client(cluster.kubeconfig, component="bench")
        self.core = client.CoreV1Api(self.api)
        self.workers = {n.metadata.labels[LABEL]: n.metadata.name
                        for n in self.core.list_node(label_selector=LABEL).items}
        if set(self.workers) != set(AGENTS):
            raise RuntimeError(f"workers labelled {LABEL}: {self.workers}")
        self.control_plane = f"{CLUSTER_NAME}-control-plane"
        self.ticks = os.sysconf("SC_CLK_TCK")  # the nodes' kernel is this one

    # the agent's process
    def agent_pid(self, agent: str) -> int:
        pid = int(self.cluster.node_exec(self.workers[agent], "systemctl", "show", "-p",
                                         "MainPID", "--value", "kubelet").strip())
        if pid <= 0:
            raise RuntimeError(f"{self.workers[agent]}: the kubelet unit has no main process")
        return pid

    def sample(self, agent: str, pid: int) -> tuple[float, float]:
        """(CPU seconds so far, RSS MB) of the agent's process."""
        out = self.cluster.node_exec(self.workers[agent], "sh", "-c",
                                     f"cat /proc/{pid}/stat; cat /proc/{pid}/status")
        stat, _, status = out.partition("\n")
        return cpu_seconds(stat, self.ticks), rss_mb(status)

    def window(self, agent: str, pid: int) -> tuple[float, float]:
        """(CPU % of a core, mean RSS MB) over the window, sampled every few seconds."""
        cpu0, _ = self.sample(agent, pid)
        t0 = time.monotonic()
        rss = []
        while time.monotonic() - t0 < self.args.window:
            time.sleep(min(5.0, max(0.0, self.args.window - (time.monotonic() - t0))))
            cpu, mb = self.sample(agent, pid)
            rss.append(mb)
        return 100 * (cpu - cpu0) / (time.monotonic() - t0), statistics.fmean(rss)

    # the pods
    def pod(self, name: str, agent: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": {"app": "bench", LABEL: agent}},
                "spec": {"nodeName": self.workers[agent],
                         "terminationGracePeriodSeconds": 5,
                         "containers": [{
                             "name": "web", "image": self.agnhost,
                             "imagePullPolicy": "IfNotPresent",
                             "args": ["netexec", "--http-port=8080"],
                             "readinessProbe": {"httpGet": {"path": "/", "port": 8080},
                                                "periodSeconds": 10},
                             "volumeMounts": [{"name": "config",
                                               "mountPath": "/etc/bench"}]}],
                         "volumes": [{"name": "config", "configMap": {"name": "bench"}}]}}

    def create(self, names: list[str], agent: str) -> dict[str, float]:
        """Create the pods at once (a few at a time); uid -> when its create was sent."""
        def one(name: str) -> tuple[str, float]:
            sent = time.monotonic()
            made = self.core.create_namespaced_pod(NAMESPACE, self.pod(name, agent))
            return made.metadata.uid, sent
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return dict(pool.map(one, names))

    def pods(self, agent: str) -> list[Any]:
        return self.core.list_namespaced_pod(NAMESPACE,
                                             label_selector=f"{LABEL}={agent}").items

    def all_ready(self, agent: str, count: int) -> bool:
        pods = self.pods(agent)
        return len(pods) == count and all(
            any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            for p in pods)

    def audit_lines(self) -> list[str]:
        return self.cluster.node_exec(self.control_plane, "cat", AUDIT_LOG).splitlines()

    def run_round(self, agent: str, number: int) -> Round:
        from bench.scale import PodWatch

        log = self.args.log
        user = f"system:node:{self.workers[agent]}"
        pid = self.agent_pid(agent)
        idle_start = time.time()
        idle_cpu, idle_rss = self.window(agent, pid)
        idle_end = time.time()
        log(f"{agent} round {number}: idle {idle_cpu:.2f}% of a core, {idle_rss:.1f} MB")

        watch = PodWatch(self.api, NAMESPACE)
        try:
            busy_start = time.time()
            cpu0, _ = self.sample(agent, pid)
            sent = self.create([f"{agent}-{number}-{i}" for i in range(BURST)], agent)
            eventually(lambda: set(sent) <= set(watch.running),
                       f"{agent}: {BURST} pods Running", self.args.timeout, every=1)
            startup = [watch.running[uid] - t for uid, t in sent.items()]
        finally:
            watch.stop()
        self.create([f"{agent}-{number}-{i}" for i in range(BURST, STEADY)], agent)
        eventually(lambda: self.all_ready(agent, STEADY), f"{agent}: {STEADY} pods Ready",
                   self.args.timeout, every=1)
        burst_cpu = self.sample(agent, pid)[0] - cpu0
        log(f"{agent} round {number}: startup p50 {measure.percentile(startup, 50):.2f} s, "
            f"p99 {measure.percentile(startup, 99):.2f} s; {burst_cpu:.1f} CPU-s to "
            f"{STEADY} Ready")
        busy_cpu, busy_rss = self.window(agent, pid)
        log(f"{agent} round {number}: with {STEADY} pods {busy_cpu:.2f}% of a core, "
            f"{busy_rss:.1f} MB")
        self.core.delete_collection_namespaced_pod(NAMESPACE,
                                                   label_selector=f"{LABEL}={agent}")
        eventually(lambda: not self.pods(agent), f"{agent}: pods gone", self.args.timeout,
                   every=1)
        busy_end = time.time()
        if self.agent_pid(agent) != pid:
            raise RuntimeError(f"{agent}: the agent restarted during round {number}")

        lines = self.audit_lines()
        idle = sum(audit_requests(lines, user, idle_start, idle_end).values())
        rate = idle / (idle_end - idle_start)
        busy = audit_requests(lines, user, busy_start, busy_end)
        seconds = busy_end - busy_start
        total = per_pod(sum(busy.values()), rate, seconds, STEADY)
        log(f"{agent} round {number}: {sum(busy.values())} requests in {seconds:.0f} s "
            f"(idle {rate * 60:.1f}/min): {total:.1f} per pod")
        return Round(agent, number, idle_cpu, idle_rss, busy_cpu, busy_rss, startup,
                     burst_cpu, total, {k: v / STEADY for k, v in busy.items()})

    def prepare(self) -> None:
        self.core.create_namespace({"metadata": {"name": NAMESPACE}})
        self.core.create_namespaced_config_map(NAMESPACE, {
            "metadata": {"name": "bench"}, "data": {"greeting": "hello"}})
        eventually(lambda: any(sa.metadata.name == "default" for sa in
                               self.core.list_namespaced_service_account(NAMESPACE).items),
                   "the namespace's default service account", 120, every=1)


def run(args: argparse.Namespace) -> list[Round]:
    from e2e.conformance import images, kind

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="np-bench-kubelet-"))
    agnhost = images.upstream_names()["Agnhost"]
    tars = {agnhost: images.conformance_images()[agnhost]}
    rounds: list[Round] = []
    with kind.private_kind_cluster(cluster_config(workdir), AGENTS, workdir, tars,
                                   args.log) as cluster:
        bench = Bench(cluster, args, agnhost)
        bench.prepare()
        time.sleep(args.settle)  # the nodes' start-up (images, first status) is not idle
        for number in range(1, args.rounds + 1):
            order = AGENTS if number % 2 else AGENTS[::-1]
            for agent in order:
                rounds.append(bench.run_round(agent, number))
    return rounds


def write_docs(rounds: list[Round], command: str, started: str) -> None:
    DOC.with_suffix(".json").write_text(json.dumps(
        {"command": command, "started": started, "rounds": [asdict(r) for r in rounds]},
        indent=1))
    DOC.write_text(
        "# The kubelet and nodepulse side by side (bench.kubelet)\n\n"
        f"Written by `{command}`, started {started}, on {os.cpu_count()} cores. "
        "The method is bench/kubelet.py's docstring: two identical kind workers of one "
        "cluster, one with each agent; per figure the median of the rounds, their range "
        "in parentheses (startup percentiles: all rounds' pods pooled, the range the "
        "rounds'). The last column says whether every round of nodepulse was below "
        "(lower) or above (higher) every round of the kubelet. The rounds' own figures "
        "are kubelet.json.\n\n"
        + render(rounds, markdown=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kubelet",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of each agent")
    p.add_argument("--window", type=float, default=60,
                   help="seconds of each CPU and memory window")
    p.add_argument("--settle", type=float, default=60,
                   help="seconds after the cluster is up before the first round")
    p.add_argument("--timeout", type=float, default=600, help="seconds for each wait")
    p.add_argument("--workdir", help="where the cluster's config and kubeconfig go")
    p.add_argument("--write-docs", action="store_true", help=f"write {DOC.name} and its json")
    p.add_argument("--from-json", type=Path, metavar="FILE",
                   help="no run: print (and with --write-docs, write) the rounds a run "
                        f"saved in FILE ({DOC.with_suffix('.json').name})")
    args = p.parse_args(argv)
    args.log = lambda m: print(m, flush=True)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        rounds = [Round(**r) for r in saved["rounds"]]
        command, started = saved["command"], saved["started"]
    else:
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m bench.kubelet " + shlex.join(sys.argv[1:])
        rounds = run(args)
    print(render(rounds))
    if args.write_docs:
        write_docs(rounds, command, started)


if __name__ == "__main__":
    main()
