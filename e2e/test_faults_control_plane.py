"""Control-plane faults on the real local control plane (issue 9, faults 1-3).

Two agents run for the whole module as real processes with node credentials
(system:node:<name>): one on a private containerd (CRI), one on the process runtime.
Each reaches the API server through its own loopback TCP proxy (e2e/harness/tcpproxy.py),
which forwards untouched until a test cuts it (while the API server is down, the proxy
ends each new connection at once, as a refused connection would). Their Lease runs on
10 s / renew 2 s.

1. API server stopped 20 s, then started: no running pod is restarted (same container
   id, start time and process); the Lease is renewed promptly once the API server is
   back (it lapses at most for the outage); the pod watch comes back without a LIST of
   pods by the node (audit log, per user); a container killed, a static pod removed
   and one added during the outage are all reported afterwards: the API's pod statuses
   equal the runtime's own records.
2. etcd stopped and started: the agents carry on (Lease, new pods, nothing restarted).
   Then a watch that expires: while the agents are cut off, pods change, etcd is
   compacted past every resourceVersion they hold and the API server restarts (its
   watch cache forgets old revisions): on reconnecting each agent relists exactly once
   and emits only the real differences (one ADD, one REMOVE, one UPDATE; one container
   started, no duplicate start).
3. Network cut longer than the grace period, with the operator running a
   NodeStatusPolicy (lease 10 s, grace 15 s) over these nodes: the operator marks the
   nodes Ready=Unknown and taints them unreachable (NoSchedule, NoExecute); the pods
   tolerate NoExecute and keep running; on recovery the agents renew, the taints go,
   Ready is True again, and no pod was ever stopped (same processes throughout,
   restartCount 0, no ContainerDied). The pod watch resumed without a relist.

Every fault is undone in `finally` (proxies forward again, etcd and the API server run),
because later modules share this control plane. Everything started here is stopped by
PID; the module's pods, Nodes, Leases, policy and namespace are deleted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness import waits
from e2e.harness.ports import free_port
from e2e.harness.processes import alive, marked
from e2e.harness.promtext import samples
from e2e.harness.tcpproxy import TcpProxy, proxied_kubeconfig
from e2e.harness.waits import first_seen
from nodeagent.api.policy import GROUP, HEARTBEAT_ANNOTATION, PLURAL, VERSION
from nodeagent.runtime.base import ANNOTATION_RESTART_COUNT, LABEL_POD_UID
from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE
from nodepulse_dev.processes import stop_process

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "charts" / "nodepulse" / "crds"
AGENT = Path(sys.executable).parent / "nodepulse-agent"
OPERATOR = Path(sys.executable).parent / "nodepulse-operator"
RUN = uuid.uuid4().hex[:5]
POOL_LABEL = "nodepulse-e2e/faults"
TAINT_KEY = "nodepulse.dev/e2e-faults"
UNREACHABLE = "node.kubernetes.io/unreachable"
LEASE_SECONDS, RENEW_SECONDS = 10, 2  # the agents' own settings, and the policy's
RETRY_SECONDS = 2.0  # a failed renewal is retried after min(2 s, renew interval)
APISERVER_DOWN = 20.0
ETCD_DOWN = 10.0
GRACE = 15
# PLEG reports a new pod's sandbox and its one container each as ContainerStarted
STARTS_PER_POD = 2
# exits at once on SIGTERM (a shell PID 1 ignores signals it does not trap)
WORKLOAD = ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"]
T = TypeVar("T")


# ---- small helpers
def eventually(pred: Callable[[], T | None], what: str, timeout: float = 60.0,
               every: float = 0.25) -> T:
    """waits.eventually, with API and connection errors counting as "not yet": the
    control plane may be coming back."""
    return waits.eventually(pred, what, timeout, every, tolerate=(ApiException, OSError))


def each(agents: list[NodeAgent], pred: Callable[[NodeAgent], T | None], what: str,
         timeout: float = 60.0) -> dict[str, T]:
    """`eventually` for every agent in turn; what each one's predicate returned."""
    return {a.name: eventually(functools.partial(pred, a), f"{what} ({a.name})", timeout)
            for a in agents}


def reported(agents: list[NodeAgent], since: dict[str, dict[str, float]], starts: int,
             what: str) -> None:
    """The API shows Running as soon as an agent started a pod; its PLEG reports the
    starts a relist (or a runtime event) later. Wait until each agent's PLEG counted
    `starts` more ContainerStarted than in `since` (its counters())."""
    each(agents, lambda a: a.counters()["started"] - since[a.name]["started"] >= starts,
         what, 20)


def now_rfc3339() -> str:
    """Now, as the audit log writes requestReceivedTimestamp (comparable as text)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_pod_lists(cluster: Cluster, node: str, since: str) -> list[str]:
    """LISTs of pods by system:node:<node> since `since`, from the audit log."""
    return [e["requestReceivedTimestamp"] for e in cluster.audit_events()
            if e["user"]["username"] == f"system:node:{node}" and e["verb"] == "list"
            and e["objectRef"].get("resource") == "pods"
            and e["requestReceivedTimestamp"] > since]


def tolerations(node: str) -> list[dict[str, Any]]:
    # unreachable NoExecute without tolerationSeconds: the taint-eviction controller
    # leaves the pod alone however long the node is cut off
    return [{"key": TAINT_KEY, "operator": "Equal", "value": node, "effect": "NoSchedule"},
            {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute"},
            {"key": UNREACHABLE, "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists"}]


def pod_body(name: str, node: str, namespace: str, *, static: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 5, "automountServiceAccountToken": False,
        "containers": [{"name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                        "command": WORKLOAD, "env": [{"name": "NP_E2E", "value": node}]}]}
    if not static:
        spec.update(nodeName=node, tolerations=tolerations(node))
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": "faults"}},
            "spec": spec}


@dataclass(frozen=True)
class RtContainer:
    """One container as the runtime's own records have it."""
    id: str
    pod_uid: str
    name: str
    restart_count: int
    running: bool
    started_at: str
    pid: int | None  # the process that must never change while the pod runs


# ---- one agent, its runtime and its proxy
@dataclass
class NodeAgent:
    name: str
    kind: str  # "containerd" | "process"
    root: Path
    manifests: Path
    proxy: TcpProxy
    port: int
    proc: subprocess.Popen[bytes]
    ctd: Any = None  # nodepulse_dev.containerd.Containerd
    log: Path = field(default_factory=Path)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def healthz(self) -> str:
        """"ok", or the code and reason /healthz gives."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz",
                                        timeout=5) as r:
                return "ok" if r.status == 200 else f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}: {e.read().decode(errors='replace')}"

    def counters(self) -> dict[str, float]:
        """The agent's own account of its pod watch and of what it started."""
        t = self.metrics()
        n = self.name
        return {
            "relists": samples(t, "nodepulse_source_api_relists_total"),
            "lists_gone": samples(t, "nodepulse_source_api_lists_total", reason="gone"),
            "lists_gone_list": samples(t, "nodepulse_source_api_lists_total", reason="gone",
                                       how="list"),
            "resumes": samples(t, "nodepulse_source_api_watch_resumes_total"),
            "add": samples(t, "nodepulse_source_updates_total", op="ADD", source="api"),
            "update": samples(t, "nodepulse_source_updates_total", op="UPDATE", source="api"),
            "remove": samples(t, "nodepulse_source_updates_total", op="REMOVE", source="api"),
            "delete": samples(t, "nodepulse_source_updates_total", op="DELETE", source="api"),
            "started": samples(t, "nodepulse_pleg_events_total", node=n,
                               type="ContainerStarted"),
            "died": samples(t, "nodepulse_pleg_events_total", node=n, type="ContainerDied"),
            "lease_ok": samples(t, "nodepulse_lease_renewals_total", result="success"),
        }

    def workload_pid(self, c: RtContainer) -> int:
        """The container's workload process (the process runtime starts it under a
        small wrapper that records its exit)."""
        assert c.pid is not None and c.pid > 1, c
        if self.kind == "containerd":
            return c.pid
        children = Path(f"/proc/{c.pid}/task/{c.pid}/children").read_text().split()
        assert len(children) == 1, (c, children)
        return int(children[0])

    def runtime(self) -> dict[str, RtContainer]:
        """Every container of ours the runtime holds, by id (not through the agent)."""
        out: dict[str, RtContainer] = {}
        if self.kind == "containerd":
            with self.ctd.channel() as ch:
                rt = pb_grpc.RuntimeServiceStub(ch)
                for c in rt.ListContainers(pb.ListContainersRequest(), timeout=10).containers:
                    if LABEL_POD_UID not in c.labels:
                        continue
                    st = rt.ContainerStatus(pb.ContainerStatusRequest(
                        container_id=c.id, verbose=True), timeout=10)
                    info = json.loads(st.info.get("info") or "{}")
                    running = st.status.state == pb.CONTAINER_RUNNING
                    out[c.id] = RtContainer(
                        c.id, c.labels[LABEL_POD_UID], c.metadata.name,
                        int(c.annotations.get(ANNOTATION_RESTART_COUNT, c.metadata.attempt)),
                        running, str(st.status.started_at),
                        int(info["pid"]) if running and info.get("pid") else None)
            return out
        for path in (self.root / "process" / "containers").glob("*.json"):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # replaced or removed as we read
            pid = rec.get("pid")
            running = rec.get("state") == "RUNNING" and bool(pid) and alive(int(pid))
            out[rec["id"]] = RtContainer(rec["id"], rec["pod_uid"], rec["name"],
                                         int(rec.get("restart_count") or 0), running,
                                         str(rec.get("started_at")),
                                         int(pid) if running else None)
        return out


def mismatches(core: client.CoreV1Api, a: NodeAgent) -> list[str]:
    """Where the API's pods on this node disagree with the runtime: every container
    the API reports is the runtime's latest attempt, in the same state, with the same
    restart count; every running container is one the API reports running."""
    rt = a.runtime()
    problems: list[str] = []
    api_running: set[str] = set()
    for p in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={a.name}").items:
        who = f"{p.metadata.namespace}/{p.metadata.name}"
        if p.metadata.deletion_timestamp:
            problems.append(f"{who}: still being deleted")
            continue
        statuses = (p.status and p.status.container_statuses) or []
        if len(statuses) != len(p.spec.containers):
            problems.append(f"{who}: {len(statuses)} container statuses")
        for cs in statuses:
            cid = (cs.container_id or "").partition("://")[2]
            r = rt.get(cid)
            if r is None:
                problems.append(f"{who}/{cs.name}: API says {cs.container_id!r}, the "
                                "runtime has no such container")
                continue
            latest = max((c for c in rt.values()
                          if c.pod_uid == r.pod_uid and c.name == r.name),
                         key=lambda c: c.restart_count)
            if latest.id != r.id:
                problems.append(f"{who}/{cs.name}: API shows attempt {r.restart_count}, "
                                f"the runtime has {latest.restart_count}")
            if bool(cs.state and cs.state.running) != r.running:
                problems.append(f"{who}/{cs.name}: API running={bool(cs.state.running)}, "
                                f"runtime running={r.running}")
            if cs.restart_count != r.restart_count:
                problems.append(f"{who}/{cs.name}: restartCount {cs.restart_count} in the "
                                f"API, {r.restart_count} in the runtime")
            if r.running:
                api_running.add(cid)
    extra = {cid for cid, r in rt.items() if r.running} - api_running
    if extra:
        problems.append(f"the runtime runs containers the API does not show: {sorted(extra)}")
    return problems


def converged(core: client.CoreV1Api, agents: list[NodeAgent]) -> Callable[[], bool]:
    last: list[str] = []

    def check() -> bool:
        last[:] = [f"{a.name}: {m}" for a in agents for m in mismatches(core, a)]
        return not last
    check.last = last  # type: ignore[attr-defined]
    return check


def wait_converged(core: client.CoreV1Api, agents: list[NodeAgent], what: str,
                   timeout: float = 90) -> None:
    check = converged(core, agents)
    try:
        eventually(check, what, timeout, every=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}: {check.last}") from None  # type: ignore[attr-defined]


def pod_container(core: client.CoreV1Api, name: str, namespace: str
                  ) -> client.V1ContainerStatus | None:
    try:
        p = core.read_namespaced_pod(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    cs = (p.status.container_statuses or [None])[0] if p.status else None
    return cs if cs and cs.state and cs.state.running and cs.ready else None


@dataclass(frozen=True)
class Witness:
    """A running pod as API and runtime see it, to show later it was never restarted."""
    pod: str
    namespace: str
    container_id: str
    started_at: Any
    restart_count: int
    rt: RtContainer

    @classmethod
    def take(cls, core: client.CoreV1Api, a: NodeAgent, pod: str, ns: str) -> Witness:
        cs = eventually(lambda: pod_container(core, pod, ns), f"{pod} Running on {a.name}",
                        90)
        cid = cs.container_id.partition("://")[2]
        return cls(pod, ns, cs.container_id, cs.state.running.started_at, cs.restart_count,
                   a.runtime()[cid])

    def check(self, core: client.CoreV1Api, a: NodeAgent, ns: str) -> None:
        cs = pod_container(core, self.pod, ns)
        assert cs is not None, f"{a.name}: {self.pod} is not Running in the API"
        assert (cs.container_id, cs.state.running.started_at, cs.restart_count) == (
            self.container_id, self.started_at, self.restart_count), \
            f"{a.name}: {self.pod} was restarted: {cs}"
        now = a.runtime().get(self.rt.id)
        assert now == self.rt, f"{a.name}: {self.pod}'s container changed: {self.rt} -> {now}"
        assert self.rt.pid is not None and alive(self.rt.pid)


# ---- fixtures
@pytest.fixture(scope="module")
def core(cluster: Cluster) -> Iterator[client.CoreV1Api]:
    api = cluster.api_client()
    yield client.CoreV1Api(api)
    api.close()


@pytest.fixture(scope="module")
def ns(core: client.CoreV1Api) -> Iterator[str]:
    name = f"faults-{RUN}"
    core.create_namespace({"metadata": {"name": name}})
    eventually(lambda: core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items, "the default ServiceAccount")
    yield name
    with contextlib.suppress(ApiException):
        core.delete_namespace(name)


@pytest.fixture(scope="module")
def agents(cluster: Cluster, core: client.CoreV1Api, ns: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeAgent]]:
    if not hasattr(cluster, "pids"):
        pytest.fail("these faults need the local control plane (NODEPULSE_E2E_KUBECONFIG "
                    "names a cluster whose processes are not ours to stop)")
    from nodepulse_dev.containerd import start_containerd  # says which package is missing

    api_port = int(cluster.server.rsplit(":", 1)[1])
    started: list[NodeAgent] = []
    ctd = None
    try:
        for kind in ("containerd", "process"):
            name = f"flt-{'ctd' if kind == 'containerd' else 'proc'}-{RUN}"
            root = tmp_path_factory.mktemp(name)
            manifests = root / "manifests"
            manifests.mkdir()
            proxy = TcpProxy("127.0.0.1", api_port).start()
            kubeconfig = proxied_kubeconfig(cluster.node_kubeconfig(name), proxy.port,
                                            root / "kubeconfig")
            if kind == "containerd":
                ctd = start_containerd()
                runtime = ctd.agent_flags
            else:
                runtime = ["--runtime=process"]
            port = free_port()
            argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
                    f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{port}",
                    f"--pod-manifest-path={manifests}",
                    f"--node-lease-duration-seconds={LEASE_SECONDS}",
                    f"--node-lease-renew-interval={RENEW_SECONDS}s",
                    f"--node-labels={POOL_LABEL}={RUN}",
                    f"--register-with-taints={TAINT_KEY}={name}:NoSchedule", *runtime]
            log = cluster.log_dir / f"agent-{name}.log"  # kept when a test fails
            with log.open("ab") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
            started.append(NodeAgent(name, kind, root, manifests, proxy, port, proc,
                                     ctd if kind == "containerd" else None, log))
        each(started, lambda a: a.proc.poll() is None and ready(core, a.name),
             "registered and Ready", 90)
        yield started
    finally:
        teardown(core, ns, started, ctd)


def ready(core: client.CoreV1Api, name: str) -> bool:
    try:
        n = core.read_node(name)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])


def teardown(core: client.CoreV1Api, ns: str, agents: list[NodeAgent], ctd: Any) -> None:
    """Pods removed through the agents (they must stop every container), then the
    agents, proxies and containerd by PID, a sweep, and the Nodes and Leases."""
    for a in agents:
        a.proxy.resume()
        for f in a.manifests.iterdir():
            f.unlink()
    with contextlib.suppress(ApiException):
        core.delete_collection_namespaced_pod(ns)
    cleaned = {a.name: False for a in agents}
    for a in agents:
        if a.proc.poll() is None:
            with contextlib.suppress(AssertionError):
                cleaned[a.name] = eventually(functools.partial(lambda n: not marked(n), a.name),
                                             f"{a.name}'s cleanup", 40)
    for a in agents:
        stop_process(a.proc)
        a.proxy.stop()
    if ctd is not None:
        ctd.stop()  # sandboxes, shims, containerd, by PID
    leftovers = {a.name: marked(a.name) for a in agents}
    for pids in leftovers.values():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    coord = client.CoordinationV1Api(core.api_client)
    for a in agents:
        with contextlib.suppress(ApiException):
            core.delete_node(a.name)
        with contextlib.suppress(ApiException):
            coord.delete_namespaced_lease(a.name, "kube-node-lease")
    assert not any(leftovers.values()), f"processes left running: {leftovers}"
    assert all(cleaned.values()), f"the agents did not stop deleted pods' containers: {cleaned}"


@pytest.fixture
def restore(cluster: Cluster, agents: list[NodeAgent]) -> Iterator[None]:
    """Whatever the test did or where it failed: the proxies forward and etcd and the
    API server run again (later test modules share them)."""
    yield
    for a in agents:
        a.proxy.resume()
    cluster.ensure_running()


def pod_watch_live(core: client.CoreV1Api, ns: str, agents: list[NodeAgent], pod: str,
                   what: str, timeout: float = 15.0) -> None:
    """Each agent's pod watch delivers again: a label put on its pod `<pod>-<node>` now
    arrives as an UPDATE within `timeout` (a watch left in a long backoff would not)."""
    before = {a.name: a.counters()["update"] for a in agents}
    for a in agents:
        core.patch_namespaced_pod(f"{pod}-{a.name}", ns,
                                  {"metadata": {"labels": {"poke": str(time.time_ns())}}})
    each(agents, lambda a: a.counters()["update"] > before[a.name], what, timeout)


def lease_renew_time(coord: client.CoordinationV1Api, name: str) -> float:
    lease = coord.read_namespaced_lease(name, "kube-node-lease")
    return float(lease.spec.renew_time.timestamp())


def log_tail(agents: list[NodeAgent], n: int = 40) -> str:
    return "\n".join(f"--- {a.name}\n" + "\n".join(
        a.log.read_text(errors="replace").splitlines()[-n:]) for a in agents)


# ---- the proxy itself (no cluster needed)
def test_tcpproxy_cut_and_resume() -> None:
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def echo() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=reply, args=(c,), daemon=True).start()

    def reply(c: socket.socket) -> None:
        with contextlib.suppress(OSError), c:
            while data := c.recv(1024):
                c.sendall(data)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    try:
        with TcpProxy("127.0.0.1", server.getsockname()[1]) as proxy:
            c1 = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
            c1.sendall(b"ping")
            assert c1.recv(16) == b"ping"
            proxy.cut()
            assert c1.recv(16) == b""  # the open connection was dropped
            c2 = socket.create_connection(("127.0.0.1", proxy.port), timeout=1)
            c2.sendall(b"lost")
            with pytest.raises(TimeoutError):
                c2.recv(16)  # blackholed: no answer, no reset
            # the proxy took c2 while cut (its accept may come after the recv's 1 s)
            eventually(lambda: proxy.blackholed == 1, "the proxy holding c2", 10)
            proxy.resume()
            assert c2.recv(16) == b""  # closed when the cut ends
            c3 = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
            c3.sendall(b"back")
            assert c3.recv(16) == b"back"
            assert (proxy.dropped, proxy.blackholed, proxy.forwarded) == (1, 1, 2)
            for c in (c1, c2, c3):
                c.close()
    finally:
        stop.set()
        t.join(5)
        server.close()


# ---- fault 1
def test_apiserver_down_20s(cluster: Cluster, core: client.CoreV1Api, ns: str,
                            agents: list[NodeAgent], restore: None) -> None:
    coord = client.CoordinationV1Api(core.api_client)
    for a in agents:
        for p in ("keep", "kill"):
            core.create_namespaced_pod(ns, pod_body(f"{p}-{a.name}", a.name, ns))
        (a.manifests / "gone.json").write_text(json.dumps(
            pod_body("gone", a.name, ns, static=True)))
    keep = {a.name: Witness.take(core, a, f"keep-{a.name}", ns) for a in agents}
    kill = {a.name: Witness.take(core, a, f"kill-{a.name}", ns) for a in agents}
    for a in agents:
        Witness.take(core, a, f"gone-{a.name}", ns)  # the mirror pod Running
    wait_converged(core, agents, "API and runtimes to agree before the outage")
    before = {a.name: a.counters() for a in agents}

    restarted = now_rfc3339()
    last_renewed = {a.name: lease_renew_time(coord, a.name) for a in agents}
    t_down = time.time()  # it stops serving at once; the process may take a while to exit
    cluster.stop_apiserver()
    print(f"\nkube-apiserver exited {time.time() - t_down:.1f}s after SIGTERM")
    try:
        for a in agents:  # during the outage: a container dies, static pods come and go
            os.kill(a.workload_pid(kill[a.name].rt), signal.SIGKILL)
            (a.manifests / "gone.json").unlink()
            (a.manifests / "new.json").write_text(json.dumps(
                pod_body("new", a.name, ns, static=True)))
        # the agents act without the API server: the killed container is replaced
        each(agents, lambda a: any(
            c.running and c.restart_count == 1 and c.pod_uid == kill[a.name].rt.pod_uid
            for c in a.runtime().values()),
            "the killed container restarted while the API server is down", APISERVER_DOWN)
        time.sleep(max(0.0, t_down + APISERVER_DOWN - time.time()))
        assert all(a.proc.poll() is None for a in agents), log_tail(agents)
    finally:
        cluster.start_apiserver()
    t_up = time.time()
    print(f"API server down {t_up - t_down:.1f}s (stopped {APISERVER_DOWN:.0f}s + start)")

    # the Lease: renewed once the API server answers again, not a renew interval later
    renewed = each(agents, lambda a: (t := lease_renew_time(coord, a.name)) > t_up - 5 and t,
                   "the Lease renewed after the outage", 30)
    for a in agents:
        r1 = renewed[a.name]
        lapse = r1 - (last_renewed[a.name] + LEASE_SECONDS)  # expired this long
        print(f"{a.name}: Lease renewed {r1 - t_up:+.1f}s after the API server was ready; "
              f"expired for {max(0.0, lapse):.1f}s of the {t_up - t_down:.1f}s outage")
        # retried every 2 s through the outage, not after a backoff grown by it; 5 s
        # to spare for a loaded machine
        assert r1 - t_up <= RETRY_SECONDS + 5, \
            f"{a.name}: Lease renewed {r1 - t_up:.1f}s after the API server was back"
        assert lapse <= t_up - t_down, f"{a.name}: the Lease lapsed longer than the outage"

    # every status written: the killed container's restart, the static pods' mirrors
    restarts = each(agents, lambda a: (c := pod_container(core, f"kill-{a.name}", ns))
                    and c.restart_count == 1 and c, "the killed pod's restartCount 1", 90)
    print(f"restartCount 1 in the API {time.time() - t_up:.1f}s after the API server was back")
    each(agents, lambda a: pod_container(core, f"new-{a.name}", ns),
         "the mirror of the static pod added during the outage Running", 90)
    print(f"the new static pod's mirror Running {time.time() - t_up:.1f}s after")
    for a in agents:
        cs = restarts[a.name]
        assert cs.last_state.terminated and cs.last_state.terminated.exit_code == 137
        assert cs.container_id != kill[a.name].container_id

        def mirror_gone(a: NodeAgent = a) -> bool:
            try:
                core.read_namespaced_pod(f"gone-{a.name}", ns)
            except ApiException as e:
                return e.status == 404
            return False
        eventually(mirror_gone, f"the mirror of the static pod removed during the outage "
                   f"on {a.name} deleted", 90)
    wait_converged(core, agents, "API pod statuses to equal the runtimes' records")
    pod_watch_live(core, ns, agents, "keep", "the pod watch delivering after the restart")
    print(f"API == runtimes {time.time() - t_up:.1f}s after the API server was back")

    # no running pod was restarted, and each agent stayed healthy
    for a in agents:
        keep[a.name].check(core, a, ns)
        assert a.proc.poll() is None and a.healthz() == "ok"
        assert ready(core, a.name)
    # the pod watch came back without a LIST of pods by the node (the scheduler and
    # controller manager may relist; the node must not)
    for a in agents:
        after = a.counters()
        lists = node_pod_lists(cluster, a.name, restarted)
        print(f"{a.name}: after the restart resumes +{after['resumes'] - before[a.name]['resumes']:.0f}"
              f" relists +{after['relists'] - before[a.name]['relists']:.0f} (the new watch "
              f"cache answers an old resourceVersion with 410 -> streaming relist), "
              f"pod LISTs by the node: {len(lists)}")
        assert lists == [], f"{a.name} LISTed pods after the API server restart: {lists}"
        assert after["lists_gone_list"] == before[a.name]["lists_gone_list"]
        assert after["relists"] - before[a.name]["relists"] <= 1
        # nothing re-added or removed but what really changed
        assert after["add"] - before[a.name]["add"] == 0
        assert after["remove"] - before[a.name]["remove"] == 0


# ---- fault 2
def test_etcd_restart(cluster: Cluster, core: client.CoreV1Api, ns: str,
                      agents: list[NodeAgent], restore: None) -> None:
    coord = client.CoordinationV1Api(core.api_client)
    start = {a.name: a.counters() for a in agents}
    for a in agents:
        core.create_namespaced_pod(ns, pod_body(f"etcd-keep-{a.name}", a.name, ns))
    keep = {a.name: Witness.take(core, a, f"etcd-keep-{a.name}", ns) for a in agents}
    reported(agents, start, STARTS_PER_POD, "the PLEG to report the kept pod's starts")
    wait_converged(core, agents, "API and runtimes to agree before etcd stops")
    before = {a.name: a.counters() for a in agents}
    since = now_rfc3339()
    t_down = time.time()
    cluster.stop_etcd()
    try:
        time.sleep(max(0.0, t_down + ETCD_DOWN - time.time()))
        assert all(a.proc.poll() is None for a in agents), log_tail(agents)
    finally:
        cluster.start_etcd()  # returns when etcd and the API server are ready
    t_up = time.time()
    print(f"\netcd down {t_up - t_down:.1f}s")
    each(agents, lambda a: lease_renew_time(coord, a.name) > t_up,
         "the Lease renewed after etcd came back", 30)
    for a in agents:
        core.create_namespaced_pod(ns, pod_body(f"etcd-new-{a.name}", a.name, ns))
    for a in agents:
        Witness.take(core, a, f"etcd-new-{a.name}", ns)
        keep[a.name].check(core, a, ns)
    wait_converged(core, agents, "API and runtimes to agree after etcd's restart")
    # healthy again: the agents' own renewals went through (not only a write that
    # landed after its request had timed out)
    each(agents, lambda a: a.healthz() == "ok", "/healthz ok after etcd's restart", 20)
    # the API shows Running as soon as the agent started the pod, and its PLEG reports
    # the starts a relist (or a runtime event) later: wait for them, then for anything
    # more a relist would emit
    reported(agents, before, STARTS_PER_POD, "the PLEG to report the new pod's starts")
    time.sleep(2)
    for a in agents:
        after = a.counters()
        d = {k: after[k] - before[a.name][k] for k in after}
        lists = node_pod_lists(cluster, a.name, since)
        print(f"{a.name}: after etcd's restart relists +{d['relists']:.0f} resumes "
              f"+{d['resumes']:.0f}, pod LISTs by the node: {len(lists)}")
        assert a.proc.poll() is None, log_tail([a])
        assert ready(core, a.name)
        assert d["relists"] <= 1 and d["lists_gone_list"] == len(lists)
        assert (d["add"], d["remove"], d["update"]) == (1, 0, 0), d  # the new pod only
        assert d["started"] == STARTS_PER_POD, d  # the new pod's; nothing started twice


def test_expired_watch_relists_once(cluster: Cluster, core: client.CoreV1Api, ns: str,
                                    agents: list[NodeAgent], restore: None) -> None:
    for a in agents:
        for p in ("stay", "drop", "relabel"):
            core.create_namespaced_pod(ns, pod_body(f"{p}-{a.name}", a.name, ns))
    stay = {a.name: Witness.take(core, a, f"stay-{a.name}", ns) for a in agents}
    drop = {a.name: Witness.take(core, a, f"drop-{a.name}", ns) for a in agents}
    for a in agents:
        Witness.take(core, a, f"relabel-{a.name}", ns)
    wait_converged(core, agents, "API and runtimes to agree before the cut")
    # every event is delivered (the relabel pod's status write came back too)
    time.sleep(2)
    before = {a.name: a.counters() for a in agents}
    since = now_rfc3339()
    for a in agents:
        a.proxy.cut()
    # what the agents miss: a pod added, one deleted at once, one relabelled
    for a in agents:
        core.create_namespaced_pod(ns, pod_body(f"added-{a.name}", a.name, ns))
        core.delete_namespaced_pod(f"drop-{a.name}", ns, grace_period_seconds=0)
        core.patch_namespaced_pod(f"relabel-{a.name}", ns,
                                  {"metadata": {"labels": {"tier": "changed"}}})
    revision = cluster.etcd_revision()
    cluster.compact_etcd(revision)  # no resourceVersion the agents hold is in etcd now
    cluster.restart_apiserver()     # nor in the new watch cache
    print(f"\netcd compacted at revision {revision}; API server restarted")
    for a in agents:
        a.proxy.resume()

    for a in agents:
        Witness.take(core, a, f"added-{a.name}", ns)
    each(agents, lambda a: not ((c := a.runtime().get(drop[a.name].rt.id)) and c.running),
         "the deleted pod's container stopped (or removed)", 60)
    wait_converged(core, agents, "API and runtimes to agree after the relist")
    time.sleep(2)  # anything more the relist would emit has come by now
    for a in agents:
        stay[a.name].check(core, a, ns)
        after = a.counters()
        d = {k: after[k] - before[a.name][k] for k in after}
        lists = node_pod_lists(cluster, a.name, since)
        print(f"{a.name}: relists +{d['relists']:.0f} (LIST {d['lists_gone_list']:.0f}, "
              f"streaming {d['lists_gone'] - d['lists_gone_list']:.0f}), "
              f"ADD +{d['add']:.0f} UPDATE +{d['update']:.0f} REMOVE +{d['remove']:.0f}, "
              f"containers started +{d['started']:.0f}")
        assert d["relists"] == 1 and d["lists_gone"] == 1, d  # exactly one relist
        assert len(lists) == d["lists_gone_list"], lists  # a LIST only if not streamed
        # only the real differences: one pod added, one removed, one relabelled
        assert (d["add"], d["remove"], d["update"], d["delete"]) == (1, 1, 1, 0), d
        assert d["started"] == STARTS_PER_POD, d  # the added pod's; no duplicate start
        assert a.healthz() == "ok"


# ---- fault 3
class Operator:
    def __init__(self, cluster: Cluster) -> None:
        self.port = free_port()
        self.log = cluster.log_dir / f"operator-faults-{RUN}.log"
        args = [str(OPERATOR), "--kubeconfig", str(cluster.kubeconfig),
                "--identity", f"faults-{RUN}",
                "--leader-election-name", f"nodepulse-operator-faults-{RUN}",
                "--metrics-port", str(self.port), "--monitor-period", "1",
                *cluster.node_lifecycle_args()]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        stop_process(self.proc)


def unreachable_effects(core: client.CoreV1Api, name: str) -> set[str]:
    return {t.effect for t in core.read_node(name).spec.taints or [] if t.key == UNREACHABLE}


def ready_status(core: client.CoreV1Api, name: str) -> str | None:
    return next((c.status for c in core.read_node(name).status.conditions or []
                 if c.type == "Ready"), None)


def test_network_cut_past_grace(cluster: Cluster, core: client.CoreV1Api, ns: str,
                                agents: list[NodeAgent], restore: None) -> None:
    kubectl = str(cluster.binary("kubectl"))
    subprocess.run([kubectl, "--kubeconfig", str(cluster.kubeconfig), "apply", "-f",
                    str(CRDS)], check=True, capture_output=True, timeout=60)
    subprocess.run([kubectl, "--kubeconfig", str(cluster.kubeconfig), "wait",
                    "--for=condition=Established", "--timeout=60s",
                    f"crd/{PLURAL}.{GROUP}"], check=True, capture_output=True, timeout=90)
    custom = client.CustomObjectsApi(core.api_client)
    policy = f"faults-{RUN}"
    custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeStatusPolicy",
        "metadata": {"name": policy},
        "spec": {"nodeSelector": {"matchLabels": {POOL_LABEL: RUN}},
                 "heartbeat": {"leaseDurationSeconds": LEASE_SECONDS},
                 # NoExecute pacing (a token bucket) would taint the second node 10 s
                 # after the first at the default 6/min
                 "failure": {"gracePeriodSeconds": GRACE, "taintUnreachable": True,
                             "noExecuteTaintsPerMinute": 60}}})
    op = Operator(cluster)
    try:
        eventually(op.ready, "the operator ready", 60)
        start = {a.name: a.counters() for a in agents}
        for a in agents:
            core.create_namespaced_pod(ns, pod_body(f"cut-{a.name}", a.name, ns))

        def policy_applied(a: NodeAgent) -> bool:
            ann = (core.read_node(a.name).metadata.annotations or {}).get(HEARTBEAT_ANNOTATION)
            return bool(ann) and json.loads(str(ann)).get("policy") == policy
        each(agents, policy_applied, "the policy on the node", 60)
        each(agents, lambda a: ready_status(core, a.name) == "True"
             and not unreachable_effects(core, a.name), "Ready, untainted")
        for a in agents:
            Witness.take(core, a, f"cut-{a.name}", ns)
        reported(agents, start, STARTS_PER_POD, "the PLEG to report the cut pod's starts")
        # every pod running on the nodes (earlier tests' too) must outlive the cut
        witnesses = {a.name: [Witness.take(core, a, p.metadata.name, p.metadata.namespace)
                              for p in core.list_pod_for_all_namespaces(
                                  field_selector=f"spec.nodeName={a.name}").items]
                     for a in agents}
        before = {a.name: a.counters() for a in agents}
        since = now_rfc3339()

        def never_stopped() -> None:
            for a in agents:
                for w in witnesses[a.name]:
                    assert w.rt.pid is not None and alive(w.rt.pid), \
                        f"{a.name}: {w.pod}'s process {w.rt.pid} stopped"

        coord = client.CoordinationV1Api(core.api_client)
        for a in agents:
            a.proxy.cut()
        t_cut = time.monotonic()
        # the last renewal that got through (one in flight at the cut may still land,
        # which only makes the grace end later)
        renewed = {a.name: lease_renew_time(coord, a.name) for a in agents}
        try:
            def tainted(name: str) -> bool:
                never_stopped()
                return (ready_status(core, name) == "Unknown"
                        and unreachable_effects(core, name) == {"NoSchedule", "NoExecute"})
            tainted_at = first_seen([a.name for a in agents], tainted,
                                    "Ready=Unknown and the unreachable taints", GRACE + 45,
                                    tolerate=(ApiException, OSError))
            took = time.monotonic() - t_cut
            print(f"\ncut off: Ready=Unknown and tainted {took:.1f}s after the cut "
                  f"(grace {GRACE}s)")
            for a in agents:
                silent = tainted_at[a.name] - renewed[a.name]
                assert silent >= GRACE - 0.2, \
                    f"{a.name} tainted {silent:.1f}s after its last renewal, grace {GRACE}s"
            # tainted NoExecute for a while: the tolerating pods stay, nothing stops
            for _ in range(8):
                never_stopped()
                time.sleep(0.5)
            for a in agents:
                assert pod_container(core, f"cut-{a.name}", ns) is not None
                assert a.proc.poll() is None
        finally:
            for a in agents:
                a.proxy.resume()
        t_back = time.time()

        each(agents, lambda a: lease_renew_time(coord, a.name) > t_back,
             "the Lease renewed after the cut", 30)

        def healed() -> bool:
            never_stopped()
            return all(not unreachable_effects(core, a.name)
                       and ready_status(core, a.name) == "True" for a in agents)
        eventually(healed, "taints removed and Ready=True after the cut", 60)
        pod_watch_live(core, ns, agents, "cut", "the pod watch delivering after the cut")
        wait_converged(core, agents, "API and runtimes to agree after the cut")
        for a in agents:
            for w in witnesses[a.name]:
                w.check(core, a, w.namespace)
            after = a.counters()
            d = {k: after[k] - before[a.name][k] for k in after}
            print(f"{a.name}: watch resumes +{d['resumes']:.0f} relists +{d['relists']:.0f}"
                  f" ContainerDied +{d['died']:.0f}")
            assert d["died"] == 0 and d["started"] == 0, d  # no pod stopped or restarted
            # the API server kept the resourceVersion: resumed, no relist, no LIST
            assert d["relists"] == 0 and d["resumes"] >= 1, d
            assert node_pod_lists(cluster, a.name, since) == []
            assert a.healthz() == "ok"
    finally:
        op.stop()
        with contextlib.suppress(ApiException):
            custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, policy)
