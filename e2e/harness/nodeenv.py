"""One node for one test: its own runtime (a private containerd, or the process
runtime), its agent as a process with node credentials, its namespace; what the
runtime holds, read from the runtime itself; and a teardown that stops everything by
PID, sweeps what is left by the NP_E2E=<node> marker every container carries, and
deletes the Node. Used by e2e/test_faults_runtime.py, e2e/test_pleg_cri_events.py and
e2e/test_node_shutdown.py.

The Node registers with a NoSchedule taint nobody else tolerates; pods are bound to it
with spec.nodeName.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.namespaces import create_namespace
from e2e.harness.ports import free_port
from e2e.harness.processes import alive, environ, marked
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually, node_registered
from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-faults"
# exits at once on SIGTERM, also as PID 1 of a container (the trap is set); one
# long sleep, so 50 pods do not fork every second
WORKLOAD = ["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"]


# --- small helpers ------------------------------------------------------------------


def workloads(node: str) -> dict[str, list[int]]:
    """Pod name -> PIDs of the live workload shells (one per running container) of the
    node's containers, found in /proc: what really runs, whatever the runtime says."""
    want = [a.encode() for a in WORKLOAD]
    out: dict[str, list[int]] = {}
    for pid in marked(node):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
            if argv == want:
                name = environ(pid).get(b"POD_NAME", b"?").decode()
                out.setdefault(name, []).append(pid)
    return {k: sorted(v) for k, v in out.items()}


def running(p: client.V1Pod) -> bool:
    st = p.status
    return bool(st and st.phase == "Running" and st.container_statuses
                and all(c.ready and c.state.running for c in st.container_statuses))


def pod_manifest(node: str, name: str, containers: int = 1, grace: int = 2) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"e2e": "faults"}},
            "spec": {
                "nodeName": node, "hostNetwork": True,
                "tolerations": [{"key": TAINT_KEY, "operator": "Exists"}],
                "terminationGracePeriodSeconds": grace,
                "automountServiceAccountToken": False,
                "containers": [{
                    "name": f"c{i}", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                    "command": WORKLOAD,
                    "env": [{"name": "NP_E2E", "value": node},
                            {"name": "POD_NAME",
                             "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}
                    for i in range(containers)]}}


# --- the runtime's own records ------------------------------------------------------

@dataclass
class RtContainer:
    id: str
    pod_uid: str
    name: str
    state: str   # RUNNING / EXITED / CREATED / UNKNOWN
    info: str = ""  # how a container that is not running ended (for failure messages)


@dataclass
class RtView:
    containers: list[RtContainer]
    sandboxes: dict[str, list[tuple[str, bool]]]  # pod uid -> [(sandbox id, ready)]

    def uids(self) -> set[str]:
        return {c.pod_uid for c in self.containers} | set(self.sandboxes)

    def of(self, uid: str) -> list[RtContainer]:
        return [c for c in self.containers if c.pod_uid == uid]


def cri_view(ctd: Any) -> RtView:
    """Everything containerd holds, from its CRI service (our own client, not the
    agent's)."""
    with ctd.channel() as ch:
        rt = pb_grpc.RuntimeServiceStub(ch)
        cs = rt.ListContainers(pb.ListContainersRequest(), timeout=10).containers
        sbs = rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items
        state = {pb.CONTAINER_CREATED: "CREATED", pb.CONTAINER_RUNNING: "RUNNING",
                 pb.CONTAINER_EXITED: "EXITED"}
        out = RtView([], {})
        for c in cs:
            info = ""
            if c.state != pb.CONTAINER_RUNNING:
                with contextlib.suppress(Exception):
                    st = rt.ContainerStatus(pb.ContainerStatusRequest(container_id=c.id),
                                            timeout=10).status
                    info = (f"exit {st.exit_code} {st.reason} {st.message!r} created "
                            f"{st.created_at} started {st.started_at} finished "
                            f"{st.finished_at}")
            out.containers.append(RtContainer(
                c.id, c.labels.get("io.kubernetes.pod.uid", "?"), c.metadata.name,
                state.get(c.state, "UNKNOWN"), info))
    for s in sbs:
        out.sandboxes.setdefault(s.metadata.uid, []).append(
            (s.id, s.state == pb.SANDBOX_READY))
    return out


def process_view(state_dir: Path) -> RtView:
    """What the process runtime holds: its record files, with RUNNING checked against
    /proc (the wrapper PID recorded must still live)."""
    out = RtView([], {})
    for f in sorted((state_dir / "containers").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            r = json.loads(f.read_text())
            st = r["state"]
            if st == "RUNNING" and not (r.get("pid") and alive(int(r["pid"]))):
                st = "EXITED"
            out.containers.append(RtContainer(
                r["id"], r["pod_uid"], r["name"], st,
                "" if st == "RUNNING" else f"exit {r.get('exit_code')} {r.get('reason')} "
                f"{r.get('message')!r} started {r.get('started_at')} finished "
                f"{r.get('finished_at')}"))
    for f in sorted((state_dir / "sandboxes").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            r = json.loads(f.read_text())
            out.sandboxes.setdefault(r["uid"], []).append((r["id"], r["state"] == "READY"))
    return out


# --- an agent process ---------------------------------------------------------------

class AgentProc:
    """nodepulse-agent as a real process with node credentials; start it again after
    a SIGKILL with the same flags and root dir (what a supervisor would do). Its log is
    root/agent.log unless `log` names another file (the root dir may be a slow disk)."""

    def __init__(self, name: str, root: Path, kubeconfig: Path, runtime_args: list[str],
                 environ: Mapping[str, str] | None = None, log: Path | None = None) -> None:
        """`environ`: variables added to the test's own for the agent."""
        self.name = name
        self.environ = dict(environ or {})
        self.root = root
        self.log = log or root / "agent.log"
        self.port = free_port()
        self.argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
                     f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{self.port}",
                     "--node-status-update-frequency=2s",
                     f"--register-with-taints={TAINT_KEY}={name}:NoSchedule", *runtime_args]
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with open(self.log, "ab") as log:
            log.write(f"--- start {self.starts} ---\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, **self.environ})
        self.starts += 1

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics",
                                        timeout=5) as r:
                return str(r.read().decode())
        except OSError:
            return ""  # (re)starting

    def sample(self, metric: str, **labels: str) -> float | None:
        text = self.metrics()
        if not text:
            return None
        return samples(text, metric, node=self.name, **labels)

    def healthz(self) -> tuple[int, str]:
        return http_get(f"http://127.0.0.1:{self.port}/healthz")

    def log_tail(self, n: int = 80) -> str:
        return "\n".join(self.log.read_text(errors="replace")
                         .splitlines()[-n:])


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status), str(r.read().decode())
    except urllib.error.HTTPError as e:
        return int(e.code), str(e.read().decode())


@dataclass
class Env:
    """One node for one test: its agent (process or in-process), runtime, namespace."""
    name: str
    kind: str                 # "containerd" | "process"
    root: Path
    core: client.CoreV1Api
    ns: str
    ctd: Any = None
    agent: AgentProc | None = None
    stoppers: list[Callable[[], None]] = field(default_factory=list)

    def view(self) -> RtView:
        if self.kind == "containerd":
            return cri_view(self.ctd)
        return process_view(self.root / "process")

    def pods(self) -> list[client.V1Pod]:
        return list(self.core.list_namespaced_pod(self.ns).items)

    def pod(self, name: str) -> client.V1Pod | None:
        try:
            return self.core.read_namespaced_pod(name, self.ns)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, name: str, containers: int = 1, grace: int = 2) -> client.V1Pod:
        return self.core.create_namespaced_pod(
            self.ns, pod_manifest(self.name, name, containers, grace))

    def ready_condition(self) -> dict[str, str]:
        node = self.core.read_node(self.name)
        c = next(c for c in node.status.conditions or [] if c.type == "Ready")
        return {"status": c.status, "reason": c.reason or "", "message": c.message or ""}

    def describe(self) -> str:
        lines = []
        for p in self.pods():
            cs = [(c.name, c.container_id, c.restart_count,
                   [k for k, v in (c.state.to_dict() or {}).items() if v])
                  for c in p.status.container_statuses or []]
            lines.append(f"{p.metadata.name} uid={p.metadata.uid} phase={p.status.phase} "
                         f"deleting={bool(p.metadata.deletion_timestamp)} {cs}")
        v = self.view()
        lines += [f"runtime: {c}" for c in v.containers]
        lines += [f"sandboxes: {uid} {sbs}" for uid, sbs in v.sandboxes.items()]
        lines.append(f"workloads: {workloads(self.name)}")
        if self.agent is not None:
            lines.append(self.agent.log_tail(400))
        return "\n".join(lines)


@contextlib.contextmanager
def node_env(cluster: Cluster, kind: str, tag: str, base: Path, build: str = "debian"
             ) -> Iterator[Env]:
    """A node name, its runtime (a private containerd of `build` for kind=containerd),
    namespace; teardown deletes the namespace through the agent (if one runs), stops whatever
    runs by PID and sweeps leftovers, then deletes the Node."""
    name = f"flt-{tag}-{os.getpid() % 10000}"
    root = base / name
    root.mkdir(parents=True)
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    env = Env(name, kind, root, core, name)
    try:
        if kind == "containerd":
            from nodepulse_dev.containerd import start_containerd
            # the pods are hostNetwork, so the bridge is never made; the CNI conf is there
            # so that the runtime's network is ready, as the Node's Ready condition needs
            env.ctd = start_containerd(build=build)
        create_namespace(core, env.ns)
        yield env
    finally:
        try:
            _teardown(env)
        finally:
            admin.close()


def _teardown(env: Env) -> None:
    with contextlib.suppress(ApiException):
        env.core.delete_namespace(env.ns)
    cleaned = True
    if env.agent is not None and env.agent.running() or env.stoppers:
        cleaned = False
        with contextlib.suppress(AssertionError):
            cleaned = eventually(lambda: not marked(env.name), "the agent's cleanup", 60)
    if env.agent is not None:
        env.agent.stop()
    for stop in env.stoppers:
        stop()
    if env.ctd is not None:
        env.ctd.stop()  # sandboxes, shims, containerd, by PID
    leftovers = marked(env.name)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ApiException):
        env.core.delete_node(env.name)
    assert not leftovers, f"processes left running: {leftovers}"
    assert cleaned, "the agent did not stop the containers of the deleted namespace"


def start_agent(cluster: Cluster, env: Env, *extra: str,
                environ: Mapping[str, str] | None = None) -> AgentProc:
    args: list[str] = (env.ctd.agent_flags if env.kind == "containerd"
                       else ["--runtime=process"])
    args += extra
    env.agent = AgentProc(env.name, env.root, cluster.node_kubeconfig(env.name), args,
                          environ)
    env.agent.start()
    node_registered(env.core, env.name, lambda: env.agent is not None and env.agent.running())
    return env.agent


def all_running(env: Env, names: list[str]) -> list[client.V1Pod] | None:
    pods = {p.metadata.name: p for p in env.pods()}
    ok = all(n in pods and running(pods[n]) for n in names)
    return [pods[n] for n in names] if ok else None
