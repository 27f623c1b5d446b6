"""Control-plane cost of keeping N nodes alive, three subjects side by side on the
local control plane (etcd and kube-apiserver included in the measurement):

- nodepulse: nodepulse-agent, efficient heartbeats (Lease + NodeStatus on change);
- legacy:    nodepulse-agent --heartbeat-mode=legacy (full NodeStatus every 10 s, no Lease);
- kwok:      KWOK (pinned, built from its Go module) managing N Nodes we create, with
             the default stages kwokctl applies when nodes hold leases (KWOK_STAGES,
             read from the pinned module) and a 40 s Lease.

    python -m bench.scale --nodes 100,500,1000 --minutes 5

Every (subject, N) phase gets a fresh control plane, so peak memory and counters
belong to that phase alone: cluster up -> idle baseline window (the cluster's own
background) -> subject started -> all N nodes Ready (and leased) -> warm-up ->
measured window -> subject stopped -> cluster removed. Per node-minute over the
window: API write requests and request body bytes (apiserver_request_total,
apiserver_request_body_size_bytes; the API server's identity-lease renewals, seen by
a watch, and the idle background taken out), etcd bytes put and WAL bytes written
(etcd's own counters, idle background taken out), CPU seconds of the subject's
processes, the API server and etcd (the latter two net of idle), and peak RSS
(VmHWM). Prints a table and the ratios nodepulse/legacy and nodepulse/kwok, writes
docs/benchmarks/scale.md, scale.json and scale.png. Asserts nothing.

nodepulse runs all N nodes in one process when the agent has --virtual-nodes;
otherwise it runs one agent process per node (node credentials each), which only
goes to a few dozen nodes on a small machine.
"""

from __future__ import annotations

import abc
import argparse
import concurrent.futures
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kubernetes import client, watch

from bench import measure
from bench.heartbeat import OtherLeaseWrites, cpu_seconds
from nodepulse_dev import LocalCluster, build

ROOT = Path(__file__).resolve().parents[1]
AGENT = Path(sys.executable).parent / "nodepulse-agent"
LEASE_NS = "kube-node-lease"
LEASE_SECONDS = 40  # kubelet's, nodepulse's and kwokctl's (before its heartbeat factor)
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
BENCH_LABEL = "nodepulse.dev/bench"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


VIRTUAL_TAINT = "nodepulse.dev/virtual=true:NoSchedule"  # what virtual nodes carry
# nodes without real workloads: the in-memory runtime, as virtual nodes use
AGENT_RUNTIME = ["--runtime", "fake"]
# KWOK serves no node API here (its --node-port and --server-address are unset), so
# nodepulse runs without its kubelet API too (like for like: that API's code costs the
# agent memory, docs/benchmarks/issue40-cost.md); dropped for an agent that predates the flag
AGENT_SERVER = ["--enable-server=false"]


def agent_help() -> str:
    return subprocess.run([str(AGENT), "--help"], capture_output=True, text=True,
                          check=True).stdout


# ---- subjects: a command line and how its nodes come to be
class Subject(abc.ABC):
    name = ""
    leases = True  # whether its liveness signal is a Lease

    def __init__(self, tag: str, n: int, workdir: Path) -> None:
        self.tag, self.n, self.workdir = tag, n, workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def selector(self) -> str:
        return f"{BENCH_LABEL}={self.tag}"

    @abc.abstractmethod
    def start(self, cluster: LocalCluster) -> None:
        """Start the subject's processes (and create its nodes, if it does not)."""

    def _spawn(self, args: list[str], logname: str) -> None:
        with (self.workdir / f"{logname}.log").open("ab") as out:
            self.procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL,
                                               start_new_session=True))

    def dead(self) -> list[str]:
        return [f"pid {p.pid} exit {p.returncode}" for p in self.procs if p.poll() is not None]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class AgentSubject(Subject):
    def __init__(self, mode: str, virtual: bool, tag: str, n: int, workdir: Path,
                 agent: Path = AGENT, name: str = "", split: int = 1) -> None:
        """`split`: virtual nodes across this many agent processes (the chart's
        StatefulSet of agents), each with its share."""
        super().__init__(tag, n, workdir)
        self.mode, self.virtual, self.agent, self.split = mode, virtual, agent, split
        self.name = name or ("nodepulse" if mode == "efficient" else mode)
        self.leases = mode != "legacy"

    def start(self, cluster: LocalCluster) -> None:
        common = ["--heartbeat-mode", self.mode, "--node-labels", f"{BENCH_LABEL}={self.tag}",
                  "--healthz-bind-address", "", *AGENT_RUNTIME, *AGENT_SERVER]
        if self.virtual:
            # N nodes in `split` processes; the admin kubeconfig, as the chart's RBAC
            # would allow writes to exactly these Nodes and Leases
            for j in range(self.split):
                share = self.n // self.split + (1 if j < self.n % self.split else 0)
                # nodes <tag>-0 .. <tag>-(N-1) in one process; <tag>-p<j>-<i> in several
                prefix = self.tag if self.split == 1 else f"{self.tag}-p{j}"
                self._spawn([str(self.agent), "--virtual-nodes", str(share),
                             "--node-name-prefix", prefix, "--agent-id", prefix,
                             "--kubeconfig", str(cluster.kubeconfig),
                             "--root-dir", str(self.workdir / prefix), *common], prefix)
            return
        common += ["--agent-id", self.tag]
        for i in range(self.n):
            name = f"{self.tag}-{i}"
            self._spawn([str(self.agent), "--node-name", name,
                         "--kubeconfig", str(cluster.node_kubeconfig(name)),
                         "--register-with-taints", VIRTUAL_TAINT,
                         "--root-dir", str(self.workdir / name), *common], name)


class KwokSubject(Subject):
    name = "kwok"

    def start(self, cluster: LocalCluster) -> None:
        kwok = build.ensure(["kwok"], log=log)["kwok"]
        core = client.CoreV1Api(cluster.api_client())
        self._create_nodes(core)
        self._spawn([str(kwok), f"--kubeconfig={cluster.kubeconfig}",
                     "--manage-all-nodes=false",
                     f"--manage-nodes-with-annotation-selector={'='.join(KWOK_ANNOTATION)}",
                     f"--node-lease-duration-seconds={LEASE_SECONDS}",
                     *(f"--config={p}" for p in kwok_stages())], self.tag)

    def _create_nodes(self, core: client.CoreV1Api) -> None:
        """N Node objects as KWOK's documentation has users write them."""
        def create(i: int) -> None:
            name = f"{self.tag}-{i}"
            core.create_node(client.V1Node(
                metadata=client.V1ObjectMeta(
                    name=name, annotations={KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1],
                                            "node.alpha.kubernetes.io/ttl": "0"},
                    labels={BENCH_LABEL: self.tag, "kubernetes.io/hostname": name,
                            "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                            "type": "kwok"}),
                spec=client.V1NodeSpec(taints=[client.V1Taint(
                    key=KWOK_ANNOTATION[0], value=KWOK_ANNOTATION[1], effect="NoSchedule")])))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(create, range(self.n)))


# The stages kwokctl applies for a cluster whose nodes hold leases, as files of the
# pinned module's kustomize/stage/: each node initialised once, its conditions re-written
# every 600-610 s (the Lease does the heartbeat); a bound pod made Running at once, a
# Job's Running pod Succeeded, a pod with a deletion timestamp removed. Up to v0.7.0 the
# kwok binary added default pod stages when given none; from v0.8.0 it runs exactly the
# stages it is given, so without the pod stages no pod ever leaves Pending.
KWOK_STAGES = ("node/fast/node-initialize.yaml",
               "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
               "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml",
               "pod/fast/pod-delete.yaml")


def kwok_stages() -> list[Path]:
    """The paths of KWOK_STAGES in the pinned module's source (fetched when kwok is built)."""
    tool = build.TOOLS["kwok"]
    src = build.cache_root() / "gomod" / f"{tool.module}@{tool.version}" / "kustomize" / "stage"
    paths = [src / rel for rel in KWOK_STAGES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise RuntimeError(f"kwok's stage files are missing: {missing} (the module source "
                           f"is fetched when kwok is built; remove {tool.path} to rebuild)")
    return paths


# ---- one phase
@dataclass
class Snapshot:
    t: float
    writes: dict[str, float]
    body: dict[str, float]
    lease_updates: float  # count of lease update bodies (to size the identity lease's)
    etcd: dict[str, float]
    cpu: dict[str, float]  # kube-apiserver, etcd, subject


def snapshot(cluster: LocalCluster, subject_pids: list[int]) -> Snapshot:
    api = cluster.apiserver_metrics()
    etcd = cluster.etcd_metrics()
    cpu = {c: cpu_seconds(cluster.pids[c]) for c in ("kube-apiserver", "etcd")}
    cpu["subject"] = sum(cpu_seconds(p) for p in subject_pids)
    return Snapshot(time.monotonic(), measure.write_counts(api), measure.body_bytes(api),
                    measure.body_count(api, "leases", "update"),
                    measure.etcd_counters(etcd), cpu)


@dataclass
class Window:
    """Counter deltas over a window, the API server's identity lease taken out."""
    seconds: float
    writes: dict[str, float]
    body: float
    etcd: dict[str, float]
    cpu: dict[str, float]

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot, own_lease_writes: int) -> Window:
        writes = measure.delta(a.writes, b.writes)
        if own_lease_writes:
            writes["leases PUT"] = max(0.0, writes.get("leases PUT", 0.0) - own_lease_writes)
        body = measure.delta(a.body, b.body)
        updates = b.lease_updates - a.lease_updates
        mean_update = body.get("leases update", 0.0) / updates if updates else 0.0
        return cls(b.t - a.t, {k: v for k, v in writes.items() if v},
                   max(0.0, sum(body.values()) - own_lease_writes * mean_update),
                   measure.delta(a.etcd, b.etcd), measure.delta(a.cpu, b.cpu))

    def rate(self, value: float) -> float:
        return value / self.seconds


def wait_ready(subject: Subject, cluster: LocalCluster, timeout: float) -> None:
    api = cluster.api_client()
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)
    deadline = time.monotonic() + timeout
    have = 0
    while True:
        nodes = core.list_node(label_selector=subject.selector).items
        ready = {n.metadata.name for n in nodes
                 if any(c.type == "Ready" and c.status == "True"
                        for c in (n.status.conditions or []))}
        if subject.leases and len(ready) >= subject.n:
            ready &= {x.metadata.name for x in coord.list_namespaced_lease(LEASE_NS).items}
        if len(ready) >= subject.n:
            return
        if len(ready) != have:
            have = len(ready)
            log(f"  {have}/{subject.n} nodes ready")
        dead = subject.dead()
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{subject.name}: {len(ready)}/{subject.n} nodes ready "
                               f"({'exited: ' + ', '.join(dead) if dead else 'timed out'}); "
                               f"logs in {subject.workdir}")
        time.sleep(2)


# the controller manager's TTL controller writes it on every new Node, once
TTL_ANNOTATION = "node.alpha.kubernetes.io/ttl"


def without_ttl(nodes: list[client.V1Node]) -> list[str]:
    """Names of the nodes the TTL controller has not annotated yet."""
    return [n.metadata.name for n in nodes if TTL_ANNOTATION not in (n.metadata.annotations or {})]


def wait_ttl_annotated(subject: Subject, cluster: LocalCluster, timeout: float) -> float:
    """Wait until the controller manager has annotated every node of the subject; the
    seconds waited. Its TTL controller patches each new Node once, at its client's 20
    requests/s (5 s for 100 nodes). Nodes that register themselves are Ready before it
    is done, and nodes the bench makes before starting KWOK are done by then: without
    this wait its writes met the churn's first burst for one subject and not the other."""
    core = client.CoreV1Api(cluster.api_client())
    started = time.monotonic()
    while left := without_ttl(core.list_node(label_selector=subject.selector).items):
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{subject.name}: {len(left)} nodes have no {TTL_ANNOTATION} "
                               f"annotation after {timeout:.0f} s, e.g. {left[0]}")
        time.sleep(0.5)
    return time.monotonic() - started


def stale_nodes(subject: Subject, cluster: LocalCluster) -> int:
    """Nodes whose liveness signal (Lease renewTime, or the Ready condition's heartbeat
    for a subject without leases) is older than the lease duration now."""
    api = cluster.api_client()
    now = datetime.datetime.now(datetime.UTC)
    limit = datetime.timedelta(seconds=LEASE_SECONDS)
    names = {n.metadata.name: n for n in
             client.CoreV1Api(api).list_node(label_selector=subject.selector).items}
    if subject.leases:
        renewed = {x.metadata.name: x.spec.renew_time for x in
                   client.CoordinationV1Api(api).list_namespaced_lease(LEASE_NS).items}
        return sum(1 for n in names if renewed.get(n) is None or now - renewed[n] > limit)
    stale = 0
    for node in names.values():
        beat = next((c.last_heartbeat_time for c in node.status.conditions or []
                     if c.type == "Ready"), None)
        stale += beat is None or now - beat > limit
    return stale


def run_phase(subject: Subject, args: argparse.Namespace) -> measure.Result:
    cluster = LocalCluster(subject.workdir / "cluster")
    cluster.up(log=log)
    others: OtherLeaseWrites | None = None
    try:
        others = OtherLeaseWrites(cluster.api_client())
        time.sleep(args.settle_seconds)
        b0 = snapshot(cluster, [])
        time.sleep(args.baseline_seconds)
        b1 = snapshot(cluster, [])
        idle = Window.between(b0, b1, others.between(b0.t, b1.t))
        log(f"  idle: {idle.rate(sum(idle.writes.values())) * 60:.1f} writes/min, "
            f"etcd {idle.rate(idle.etcd[measure.ETCD_PUT_BYTES]) * 60:,.0f} put B/min")

        log(f"  starting {subject.name} with {subject.n} nodes")
        started = time.monotonic()
        subject.start(cluster)
        wait_ready(subject, cluster, args.ready_timeout + subject.n * 0.5)
        log(f"  all {subject.n} ready in {time.monotonic() - started:.0f} s; "
            f"warm-up {args.warmup_seconds:g} s")
        time.sleep(args.warmup_seconds)
        stale = stale_nodes(subject, cluster)
        pids = [p.pid for p in subject.procs]
        s0 = snapshot(cluster, pids)
        end = s0.t + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(min(5.0, max(0.0, end - time.monotonic())))
            if subject.dead():
                raise RuntimeError(f"{subject.name} exited during the window: "
                                   f"{subject.dead()}; logs in {subject.workdir}")
        s1 = snapshot(cluster, pids)
        peaks = {c: measure.peak_rss_mb(cluster.pids[c]) for c in ("kube-apiserver", "etcd")}
        subject_peak = sum(measure.peak_rss_mb(p) for p in pids)
        stale = max(stale, stale_nodes(subject, cluster))
        w = Window.between(s0, s1, others.between(s0.t, s1.t))
    finally:
        subject.stop()
        if others is not None:
            others.stop()
        cluster.remove()

    n, secs = subject.n, w.seconds

    def pnm(value: float, idle_total: float = 0.0) -> float:
        """per node-minute, net of the idle cluster's rate for the same span"""
        return measure.per_node_minute(measure.net(value, idle.rate(idle_total), secs), n, secs)

    return measure.Result(
        subject=subject.name, nodes=n, seconds=secs,
        writes=pnm(sum(w.writes.values()), sum(idle.writes.values())),
        body_bytes=pnm(w.body, idle.body),
        etcd_put_bytes=pnm(w.etcd[measure.ETCD_PUT_BYTES], idle.etcd[measure.ETCD_PUT_BYTES]),
        etcd_wal_bytes=pnm(w.etcd[measure.ETCD_WAL_BYTES], idle.etcd[measure.ETCD_WAL_BYTES]),
        subject_cpu=pnm(w.cpu["subject"]),
        apiserver_cpu=pnm(w.cpu["kube-apiserver"], idle.cpu["kube-apiserver"]),
        etcd_cpu=pnm(w.cpu["etcd"], idle.cpu["etcd"]),
        subject_rss_mb=subject_peak, apiserver_rss_mb=peaks["kube-apiserver"],
        etcd_rss_mb=peaks["etcd"], processes=len(subject.procs), stale_max=stale,
        by_resource={k: measure.per_node_minute(v, n, secs) for k, v in w.writes.items()})


# ---- pod churn (issue 8 item 3)
CHURN_NS = "bench-churn"
# rounds of each subject by default: one round's p99 is its first burst's, which moves
# from run to run as much as the subjects differ
CHURN_ROUNDS = 5


class PodWatch:
    """When each pod of a namespace was first seen, and first seen Running, by one
    watch (monotonic clock). The API server closes a watcher that falls behind, so the
    watch resumes from the last resourceVersion it saw, and relists when that is gone;
    events stay plain JSON (building client models is what makes a watcher slow)."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.first: dict[str, float] = {}
        self.bound: dict[str, float] = {}  # first seen with spec.nodeName (scheduled)
        self.running: dict[str, float] = {}
        self.unobserved: set[str] = set()  # Running before the watch saw them at all
        self.resumes = 0
        self.relists = 0
        self._w = watch.Watch()
        self._stopped = False
        self.error: BaseException | None = None
        core = client.CoreV1Api(api)

        def relist() -> str:
            pods = core.list_namespaced_pod(namespace)
            now = time.monotonic()
            for pod in pods.items:
                uid, phase = pod.metadata.uid, pod.status.phase if pod.status else None
                if uid not in self.first and phase == "Running":
                    self.unobserved.add(uid)  # created and started while unwatched
                self._see(uid, pod.spec.node_name, phase, now)
            return str(pods.metadata.resource_version)

        def run() -> None:
            try:
                rv = relist()
                while not self._stopped:
                    try:
                        for ev in self._w.stream(core.list_namespaced_pod, namespace,
                                                 resource_version=rv, timeout_seconds=600,
                                                 deserialize=False):
                            obj = ev["object"]
                            if ev["type"] == "ERROR":
                                raise RuntimeError(f"watch error: {obj.get('message')}")
                            self._see(obj["metadata"]["uid"], obj["spec"].get("nodeName"),
                                      obj.get("status", {}).get("phase"), time.monotonic())
                            rv = obj["metadata"]["resourceVersion"]
                        self.resumes += 1
                    except Exception:  # closed, expired (410) or refused: start over
                        if self._stopped:
                            return
                        self.relists += 1
                        rv = relist()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                if not self._stopped:
                    self.error = e

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def _see(self, uid: str, node: str | None, phase: str | None, now: float) -> None:
        self.first.setdefault(uid, now)
        if node:
            self.bound.setdefault(uid, now)
        if phase == "Running":
            self.running.setdefault(uid, now)

    def stop(self) -> None:
        self._stopped = True
        self._w.stop()


def deployment(tag: str, replicas: int) -> client.V1Deployment:
    labels = {"app": f"churn-{tag}"}
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=f"churn-{tag}"),
        spec=client.V1DeploymentSpec(
            replicas=replicas, selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(
                    containers=[client.V1Container(name="c", image="nodepulse.dev/bench:1")],
                    node_selector={BENCH_LABEL: tag},
                    tolerations=[client.V1Toleration(operator="Exists")],
                    automount_service_account_token=False, enable_service_links=False,
                    termination_grace_period_seconds=0))))


def job(tag: str, completions: int, parallelism: int, run_for: str) -> client.V1Job:
    """Pods that run `run_for` and exit 0: on nodepulse's virtual nodes by the fake
    runtime's script annotations (docs/virtual-nodes.md, "Scripted pods"); KWOK completes
    a Job's pods by its own default stage."""
    return client.V1Job(
        metadata=client.V1ObjectMeta(name=f"job-{tag}"),
        spec=client.V1JobSpec(
            completions=completions, parallelism=parallelism, backoff_limit=completions,
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(
                    labels={"app": f"job-{tag}"},
                    annotations={"fake.nodepulse.dev/run-for": run_for,
                                 "fake.nodepulse.dev/exit-code": "0"}),
                spec=client.V1PodSpec(
                    containers=[client.V1Container(name="c", image="nodepulse.dev/bench:1")],
                    restart_policy="Never", node_selector={BENCH_LABEL: tag},
                    tolerations=[client.V1Toleration(operator="Exists")],
                    automount_service_account_token=False, enable_service_links=False,
                    termination_grace_period_seconds=0))))


def run_job(api: client.ApiClient, subject: Subject, args: argparse.Namespace
            ) -> tuple[int, float]:
    """Create the Job, wait for its completions: (succeeded, seconds to the last one)."""
    batch = client.BatchV1Api(api)
    batch.create_namespaced_job(CHURN_NS, job(subject.tag, args.job_pods,
                                              args.job_parallelism, args.job_run_for))
    log(f"  Job of {args.job_pods} completions ({args.job_parallelism} at a time) created")
    t0 = time.monotonic()
    succeeded = -1
    while time.monotonic() - t0 < args.churn_timeout:
        time.sleep(1)
        st = batch.read_namespaced_job_status(f"job-{subject.tag}", CHURN_NS).status
        if (st.succeeded or 0) // 500 != succeeded // 500:
            log(f"  {st.succeeded or 0} succeeded, {st.failed or 0} failed")
        succeeded = st.succeeded or 0
        if succeeded >= args.job_pods:
            # the Job controller's completion, as a user's client would see it
            return succeeded, time.monotonic() - t0
        if subject.dead():
            raise RuntimeError(f"{subject.name} exited during the Job: {subject.dead()}")
    return succeeded, math.nan


def run_churn(subject: Subject, args: argparse.Namespace, round_no: int
              ) -> measure.ChurnResult:
    cluster = LocalCluster(subject.workdir / "cluster")
    cluster.up(log=log)
    pods: PodWatch | None = None
    try:
        api = cluster.api_client()
        log(f"  starting {subject.name} with {subject.n} nodes")
        subject.start(cluster)
        wait_ready(subject, cluster, args.ready_timeout + subject.n * 0.5)
        waited = wait_ttl_annotated(subject, cluster, args.ready_timeout + subject.n * 0.2)
        log(f"  the controller manager's TTL annotations on all nodes after {waited:.1f} s more")
        client.CoreV1Api(api).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=CHURN_NS)))
        pods = PodWatch(api, CHURN_NS)
        pids = [p.pid for p in subject.procs]
        s0 = snapshot(cluster, pids)
        client.AppsV1Api(api).create_namespaced_deployment(
            CHURN_NS, deployment(subject.tag, args.churn_pods))
        log(f"  Deployment of {args.churn_pods} pods created")
        deadline = s0.t + args.churn_timeout
        seen = -1
        while len(pods.running) < args.churn_pods and time.monotonic() < deadline:
            time.sleep(2)
            if pods.error is not None:
                raise RuntimeError(f"pod watch failed: {pods.error!r}")
            if subject.dead():
                raise RuntimeError(f"{subject.name} exited during the churn: "
                                   f"{subject.dead()}; logs in {subject.workdir}")
            if len(pods.running) // 500 != seen // 500:
                seen = len(pods.running)
                log(f"  {len(pods.first)} pods seen, {seen} Running")
        s1 = snapshot(cluster, pids)
        # the Deployment's pods only: the Job's, in the same namespace, come later
        running, unobserved = dict(pods.running), set(pods.unobserved)
        log(f"  pod watch resumed {pods.resumes}x, relisted {pods.relists}x; "
            f"{len(unobserved)} pods first seen Running (not in the latencies)")
        # the before build may predate scripted pods: its Job would never complete
        with_job = args.job_pods and subject.name != "before"
        job_done, job_s = run_job(api, subject, args) if with_job else (0, math.nan)
        rss = sum(measure.peak_rss_mb(p) for p in pids)
    finally:
        if pods is not None:
            pods.stop()
        subject.stop()
        cluster.remove()
    latencies = [t - pods.first[uid] for uid, t in running.items() if uid not in unobserved]
    # the node's own part: scheduled (seen bound) -> seen Running
    on_node = [t - pods.bound[uid] for uid, t in running.items()
               if uid not in unobserved and uid in pods.bound]
    done = len(running) >= args.churn_pods
    return measure.ChurnResult(
        subject=subject.name, nodes=subject.n, pods=args.churn_pods,
        running=len(running),
        all_running_s=max(running.values()) - s0.t if done else math.nan,
        p50_s=measure.percentile(latencies, 50), p99_s=measure.percentile(latencies, 99),
        node_p50_s=measure.percentile(on_node, 50), node_p99_s=measure.percentile(on_node, 99),
        subject_cpu_s=s1.cpu["subject"] - s0.cpu["subject"],
        apiserver_cpu_s=s1.cpu["kube-apiserver"] - s0.cpu["kube-apiserver"],
        subject_rss_mb=rss, job_pods=args.job_pods if with_job else 0,
        job_succeeded=job_done, job_s=job_s, round=round_no,
        startup_s=latencies, node_startup_s=on_node,
        writes={k: v for k, v in measure.delta(s0.writes, s1.writes).items() if v},
        body={k: v for k, v in measure.delta(s0.body, s1.body).items() if v})


# ---- output
def machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor())
    mem_kb = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                  if ln.startswith("MemTotal:"))
    return (f"{os.cpu_count()} CPUs ({model}), {mem_kb / 1024 ** 2:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}")


def plot(results: list[measure.Result], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("API writes / node-min", "writes"), ("request bytes / node-min", "body_bytes"),
              ("etcd bytes put / node-min", "etcd_put_bytes"),
              ("subject CPU s / node-min", "subject_cpu"),
              ("API server CPU s / node-min", "apiserver_cpu"),
              ("subject peak RSS MB", "subject_rss_mb")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, attr) in zip(axes.flat, panels, strict=True):
        for subject in measure.SUBJECT_ORDER:
            rows = sorted((r for r in results if r.subject == subject), key=lambda r: r.nodes)
            if rows:
                ax.plot([r.nodes for r in rows], [getattr(r, attr) for r in rows],
                        marker="o", label=subject)
        ax.set_title(title)
        ax.set_xlabel("nodes")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("nodepulse vs legacy heartbeats vs KWOK, per node-minute (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_docs(results: list[measure.Result], args: argparse.Namespace, command: str,
               how: str, failures: list[str]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "scale.png")
    (out / "scale.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    versions = ", ".join(f"{n} {build.TOOLS[n].version}"
                         for n in ("kube-apiserver", "etcd", "kwok"))
    (out / "scale.md").write_text(f"""# Scale benchmark: nodepulse vs legacy heartbeats vs KWOK

Written by `bench/scale.py`; do not edit by hand.

- command: `{command}`
- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}
- machine: {machine()}
- control plane: {versions} (local, loopback, etcd with --unsafe-no-fsync)
- nodepulse ran as: {how}
- window: {args.minutes:g} min per phase after all nodes were Ready (and leased) and a
  {args.warmup_seconds:g} s warm-up; idle baseline {args.baseline_seconds:g} s per phase

Subjects: **nodepulse** = `nodepulse-agent` with default settings (Lease renewed every
10 s, NodeStatus on meaningful change or every 5 min), fake runtime, without its kubelet
API (`--enable-server=false`, as KWOK runs here without its node server); **before** (when
run) = the same settings on another build of the agent (`--before-agent`: the commit a
change started from), so before and after come from one run; **legacy** = the same
with `--heartbeat-mode=legacy` (full NodeStatus PATCH every 10 s, no Lease); **kwok** =
KWOK {build.TOOLS["kwok"].version} managing Nodes created by the benchmark
(`--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake`,
`--node-lease-duration-seconds={LEASE_SECONDS}`) with the stages kwokctl sets up when
leases are on: `node-initialize` and `node-heartbeat-with-lease` (conditions re-written
every 600-610 s), and for pods `pod-ready`, `pod-complete`, `pod-delete`, read from the
pinned module's `kustomize/stage/`.

Per node-minute over the window. Every (subject, N) phase runs on a fresh control
plane. Writes and request bytes come from the API server's own metrics
(`apiserver_request_total` verbs POST/PUT/PATCH/DELETE, `apiserver_request_body_size_bytes`),
the API server's identity-lease renewals taken out and the idle cluster's background
subtracted; etcd bytes from etcd's `{measure.ETCD_PUT_BYTES}` (key-value bytes put) and
`{measure.ETCD_WAL_BYTES}`, idle background subtracted. CPU seconds from /proc (API
server and etcd net of their idle use); RSS is the peak (VmHWM) of the phase, the
subject's summed over its processes. "stale max": nodes whose Lease (or, without a
Lease, Ready heartbeat) was older than {LEASE_SECONDS} s at the start or end of the window.

{measure.render_markdown(results)}
{"".join(f"{chr(10)}Failed phase: {f}{chr(10)}" for f in failures)}
![per node-minute costs](scale.png)
""")


def plot_churn(results: list[measure.ChurnResult], path: Path) -> None:
    """The pooled startup's tail (the share of pods slower than x), each round's p99
    and each round's costs, per subject."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter

    groups = measure.by_subject(results)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    tails = [("startup ms (first seen -> Running), all rounds", False),
             ("node part ms (bound -> Running), all rounds", True)]
    for ax, (title, node_part) in zip(axes[0][:2], tails, strict=True):
        for (subject, nodes), rs in groups.items():
            xs = sorted(measure.pool(measure.round_sample(r, node_part) for r in rs))
            shown = [(x * 1000, 1 - i / len(xs)) for i, x in enumerate(xs)
                     if math.isfinite(x) and x > 0]
            if shown:
                ax.step(*zip(*shown, strict=True), where="post", label=f"{subject} N={nodes}")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_ylabel("share of pods slower")
    per_round = [("startup p99 s by round", "p99_s"), ("subject CPU s by round", "subject_cpu_s"),
                 ("API server CPU s by round", "apiserver_cpu_s"),
                 ("subject peak RSS MB by round", "subject_rss_mb")]
    for ax, (title, attr) in zip([axes[0][2], *axes[1]], per_round, strict=True):
        for (subject, nodes), rs in groups.items():
            ax.plot([r.round for r in rs], [getattr(r, attr) for r in rs], marker="o",
                    label=f"{subject} N={nodes}")
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("pod churn: nodepulse vs KWOK, rounds alternating (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def churn_json(results: list[measure.ChurnResult], pools: list[measure.Pooled],
               found: list[measure.Interval]) -> str:
    """The tables, and every round with its per-pod seconds (to the microsecond), one
    round a line so the file stays readable."""
    def round_doc(r: measure.ChurnResult) -> dict[str, object]:
        doc = asdict(r)
        for key in ("startup_s", "node_startup_s"):
            doc[key] = [round(x, 6) for x in doc[key]]
        return doc

    head = {"bootstrap": {"unit": "whole rounds, each subject's independently",
                          "resamples": measure.BOOTSTRAP_RESAMPLES,
                          "seed": measure.BOOTSTRAP_SEED, "level": measure.BOOTSTRAP_LEVEL},
            "pooled": [asdict(p) for p in pools],
            "intervals": [{**asdict(i), "verdict": i.verdict} for i in found]}
    rounds = ",\n".join("  " + json.dumps(round_doc(r)) for r in results)
    return json.dumps(head, indent=1)[:-2] + f',\n "rounds": [\n{rounds}\n ]\n}}\n'


def write_churn_docs(results: list[measure.ChurnResult], args: argparse.Namespace,
                     command: str, how: str, failures: list[str]
                     ) -> tuple[list[measure.Pooled], list[measure.Interval]]:
    """churn.md, churn.json and churn.png in --out; the pooled tables they show."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pools, found = measure.pooled(results), measure.intervals(results)
    (out / "churn.json").write_text(churn_json(results, pools, found))
    plot_churn(results, out / "churn.png")
    job_text = "" if not args.job_pods else f"""

Then a Job of {args.job_pods} completions, {args.job_parallelism} at a time ("job s": the
Job created until its status counts them all succeeded, as the Job controller sees them).
Its pods are scripted on nodepulse's fake runtime to run {args.job_run_for} and exit 0
(`fake.nodepulse.dev/run-for`, `exit-code`:
[Scripted pods](../virtual-nodes.md#scripted-pods-the-fake-runtime)), each through a pod
worker, the runtime and its status writes; KWOK completes a Job's Running pods by its
default `pod-complete` stage, at once. ("before", an older build, has no Job phase.)"""
    kwok_text = "" if "kwok" not in args.subjects.split(",") else (
        f"- KWOK {build.TOOLS['kwok'].version} with the stages kwokctl applies when nodes "
        f"hold leases: {', '.join(f'`{Path(p).stem}`' for p in KWOK_STAGES)}\n")
    rounds = "".join(f"\n- {line}" for line in measure.render_rounds(results))
    failed = "".join(f"\nFailed round: {f}\n" for f in failures)
    writes_table = measure.render_churn_writes(results, markdown=True)
    body_table = measure.render_churn_writes(results, markdown=True, field="body",
                                             fmt="{:.0f}")
    (out / "churn.md").write_text(f"""# Pod churn: a Deployment across the nodes

Written by `bench/scale.py --churn`; do not edit by hand.

- command: `{command}`
- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}
- machine: {machine()}
- nodepulse ran as: {how}, fake runtime
{kwok_text}- rounds: {args.rounds} of each subject, in turn ({", ".join(args.subjects.split(","))},
  {args.subjects.split(",")[0]}, ...), each on a fresh control plane

One Deployment of {args.churn_pods} pods (node selector on the subject's nodes, all
taints tolerated) on a fresh local control plane once all nodes are Ready and the
controller manager has annotated them (its TTL controller writes each new Node once; for
nodes that register themselves that takes seconds after they are Ready). "all Running
s": Deployment created until the last pod was seen Running; p50/p99: per pod, first
seen by a watch until seen Running; "node p50/p99": from first seen bound to a node
(scheduled) until seen Running, the node's own part. Pod creation is paced by
kube-controller-manager's client rate limit (its defaults) and binding by
kube-scheduler's, for every subject alike. CPU seconds over the Deployment's churn.{job_text}

## All rounds pooled

Every round's pods together, per subject (a pod never seen Running counts as the
slowest). The interval is the {measure.BOOTSTRAP_LEVEL:.0%} percentile bootstrap of the
ratio of the pooled percentiles, {measure.BOOTSTRAP_RESAMPLES} resamples (seed
{measure.BOOTSTRAP_SEED}) that draw whole rounds with replacement, each subject's
independently: a round's pods share one control plane and its first burst, so the round,
not the pod, is what varies from run to run. Verdict: "met" when the whole interval is
below 1 (the first subject faster), "missed" when it is above 1, "tie" when it holds 1;
a subject with one round has no interval. Costs: each round's, min/median/max.

{measure.render_pooled(pools, found, markdown=True)}

![pooled startup tail and each round's figures](churn.png)

## Each round

{measure.render_churn(results, markdown=True)}
{rounds}

## API writes per pod

Write requests the API server took over the Deployment's churn (every client's: the
controllers' and the scheduler's too), per pod asked for, by resource and verb; the
median of each subject's rounds.

{writes_table}

Their request bytes per pod, by resource and verb (the API server counts them without
the subresource):

{body_table}
{failed}""")
    return pools, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="100,500,1000", help="comma-separated node counts")
    parser.add_argument("--minutes", type=float, default=5.0, help="measured window per phase")
    parser.add_argument("--subjects", default="nodepulse,legacy,kwok",
                        help="in this order; with --churn a subject may repeat")
    parser.add_argument("--warmup-seconds", type=float, default=60.0)
    parser.add_argument("--baseline-seconds", type=float, default=30.0,
                        help="idle window measuring the cluster's own background")
    parser.add_argument("--settle-seconds", type=float, default=10.0,
                        help="wait after the cluster comes up, before the idle window")
    parser.add_argument("--ready-timeout", type=float, default=120.0,
                        help="seconds for all nodes to be Ready (plus 0.5 s per node)")
    parser.add_argument("--agent-processes", choices=("auto", "virtual", "separate"),
                        default="auto", help="nodepulse as one --virtual-nodes process, or "
                        "one process per node (auto: virtual when the agent has it)")
    parser.add_argument("--split", type=int, default=1,
                        help="virtual nodes across this many agent processes, each with "
                        "its share (the chart's StatefulSet of agents)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--churn", action="store_true",
                        help="instead of the heartbeat phases: a Deployment of --churn-pods "
                        "pods across the nodes; time until all Running, startup latency "
                        "p50/p99, CPU (issue 8 item 3)")
    parser.add_argument("--churn-pods", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=None,
                        help="--churn: run the subjects' phases this many times, in turn, "
                        "each on a fresh control plane, and pool their pods (default 5; "
                        "the heartbeat phases run once)")
    parser.add_argument("--churn-timeout", type=float, default=900.0,
                        help="seconds for all pods to be Running (and for the Job)")
    parser.add_argument("--job-pods", type=int, default=0,
                        help="--churn: then a Job of this many completions (0: none)")
    parser.add_argument("--job-parallelism", type=int, default=100)
    parser.add_argument("--job-run-for", default="2s",
                        help="how long each Job pod runs on nodepulse's fake runtime")
    parser.add_argument("--before-agent", metavar="PATH", default="",
                        help="subject 'before': this nodepulse-agent (e.g. another checkout's "
                        "build) with nodepulse's settings, for before/after in one run")
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--nodes: {args.nodes!r} is not a comma-separated list of integers")
    if not sizes or min(sizes) <= 0:
        parser.error(f"--nodes: {args.nodes!r} needs positive node counts")
    subjects = [s for s in args.subjects.split(",") if s]
    unknown = set(subjects) - set(measure.SUBJECT_ORDER)
    if unknown:
        parser.error(f"--subjects: unknown {sorted(unknown)} (known: {measure.SUBJECT_ORDER})")
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    if ("before" in subjects) != bool(args.before_agent):
        parser.error("--subjects before and --before-agent PATH go together")
    if args.before_agent and not Path(args.before_agent).is_file():
        parser.error(f"--before-agent: {args.before_agent} is not a file")
    if args.churn_pods <= 0:
        parser.error("--churn-pods must be > 0")
    if args.split <= 0:
        parser.error("--split must be > 0")
    if args.rounds is None:
        args.rounds = CHURN_ROUNDS if args.churn else 1
    if args.rounds <= 0:
        parser.error("--rounds must be > 0")
    if not args.churn and (args.rounds > 1 or len(set(subjects)) < len(subjects)):
        parser.error("--rounds and a repeated subject go with --churn (the heartbeat "
                     "tables pair one phase per subject and node count)")
    subjects *= args.rounds
    help_text = agent_help()
    if "--runtime" not in help_text:
        if args.churn:
            parser.error("--churn: nodepulse-agent has no --runtime (the fake runtime "
                         "runs the pods)")
        AGENT_RUNTIME.clear()  # an agent from before runtimes were selectable
    if "--enable-server" not in help_text:
        AGENT_SERVER.clear()
    virtual = "--virtual-nodes" in help_text
    if args.agent_processes == "virtual" and not virtual:
        parser.error("--agent-processes virtual: nodepulse-agent has no --virtual-nodes")
    virtual = virtual and args.agent_processes != "separate"
    if args.split > 1 and not virtual:
        parser.error("--split goes with virtual nodes (--agent-processes virtual or auto)")
    how = (f"{args.split} process(es) per subject (--virtual-nodes)" if virtual
           else "one agent process per node (no --virtual-nodes)")
    log(f"nodepulse: {how}")

    workdir = Path(tempfile.mkdtemp(prefix="nodepulse-bench-scale-"))
    command = "python -m bench.scale " + " ".join(argv if argv is not None else sys.argv[1:])
    results: list[measure.Result] = []
    churns: list[measure.ChurnResult] = []
    failures: list[str] = []
    tables: tuple[list[measure.Pooled], list[measure.Interval]] = ([], [])
    for n in sizes:
        seen: dict[str, int] = {}
        for name in subjects:
            seen[name] = seen.get(name, 0) + 1  # a repeated subject's phases: -1, -2, ...
            tag = f"{name[:3]}-{n}" + (f"-{seen[name]}" if subjects.count(name) > 1 else "")
            phase_dir = workdir / tag
            phase_dir.mkdir()
            subject: Subject
            if name == "kwok":
                subject = KwokSubject(tag, n, phase_dir)
            elif name == "before":  # the same settings as nodepulse, another build
                subject = AgentSubject("efficient", virtual, tag, n, phase_dir,
                                       agent=Path(args.before_agent), name="before",
                                       split=args.split)
            else:
                subject = AgentSubject("efficient" if name == "nodepulse" else "legacy",
                                       virtual, tag, n, phase_dir, split=args.split)
            if args.churn:
                log(f"-- churn: {name} round {seen[name]}, {n} nodes, {args.churn_pods} pods")
                try:
                    churns.append(run_churn(subject, args, seen[name]))
                except Exception as e:  # a failed round is reported; the others still run
                    failures.append(f"{name} round {seen[name]} at {n} nodes: {e}")
                    log(f"  FAILED: {e}")
                print(measure.render_churn(churns), file=sys.stderr)
                if churns:  # written after every round: a late failure loses nothing
                    tables = write_churn_docs(churns, args, command, how, failures)
            else:
                log(f"-- {name}, {n} nodes, {args.minutes:g} min")
                try:
                    results.append(run_phase(subject, args))
                except Exception as e:  # a failed phase is reported; the others still run
                    failures.append(f"{name} at {n} nodes: {e}")
                    log(f"  FAILED: {e}")
                print(measure.render_text(results), file=sys.stderr)
                if results:  # written after every phase: a late failure loses nothing
                    write_docs(results, args, command, how, failures)
    if args.churn:
        print("pod churn: a Deployment's pods from first seen to seen Running (by one watch)")
        print(measure.render_churn(churns))
        for line in measure.render_rounds(churns):
            print(line)
        if churns:
            print(f"\nall rounds' pods pooled; {measure.BOOTSTRAP_LEVEL:.0%} intervals by "
                  f"{measure.BOOTSTRAP_RESAMPLES} resamples of whole rounds "
                  f"(seed {measure.BOOTSTRAP_SEED}); costs per round min/median/max")
            print(measure.render_pooled(*tables))
            print("\nAPI writes per pod over the Deployment's churn, every client's "
                  "(median of the rounds)")
            print(measure.render_churn_writes(churns))
            print("their request bytes per pod")
            print(measure.render_churn_writes(churns, field="body", fmt="{:.0f}"))
        for f in failures:
            print(f"FAILED: {f}")
        print(f"wrote {args.out}/churn.md, churn.json, churn.png; logs in {workdir}")
        return 1 if failures or not churns else 0
    print("per node-minute over the window; RSS = peak MB of the phase")
    print(measure.render_text(results))
    for f in failures:
        print(f"FAILED: {f}")
    print(f"wrote {args.out}/scale.md, scale.json, scale.png; logs in {workdir}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
