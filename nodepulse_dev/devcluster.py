"""The whole system on one machine: the local control plane (cluster.py), the CRDs, two
NodeStatusPolicies, the operator, metrics-server, an agent for the host's node (its
pods on a private containerd, or on the fake runtime) and an agent for a pool of
virtual nodes (the fake runtime, simulated usage). `nodepulse-dev up` runs it
(__main__.py); `make run` and the e2e suite use it.

Every agent registers its nodes with an address of this machine that the API server
will proxy to (it refuses loopback and link-local ones), so `kubectl get --raw
/api/v1/nodes/<node>/proxy/stats/summary` works, and serves its kubelet API there only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from nodepulse_dev import build
from nodepulse_dev.cluster import Cluster, LocalCluster
from nodepulse_dev.images import BUSYBOX_IMAGE
from nodepulse_dev.ports import free_port
from nodepulse_dev.processes import stop_process

# the chart's CRD (crds/ links to the chart's in a checkout; the wheel has the file)
CRD = (Path(__file__).parent / "crds" / "nodestatuspolicies.nodepulse.dev.yaml").resolve()
VIRTUAL_PREFIX = "vn"
VIRTUAL_LABEL = "nodepulse.dev/virtual"
POOL_LABEL = "nodepulse.dev/pool"
# Two pools with their own heartbeat: the host's node on the defaults, the virtual pool
# (many nodes, nothing real on them) on a slower, cheaper heartbeat.
POLICIES = [
    {"metadata": {"name": "default"},
     "spec": {"nodeSelector": {}, "priority": 0,
              "heartbeat": {"leaseDurationSeconds": 40, "renewIntervalSeconds": 10,
                            "statusUpdateFrequencySeconds": 10}}},
    {"metadata": {"name": "virtual-pool"},
     "spec": {"nodeSelector": {"matchLabels": {VIRTUAL_LABEL: "true"}}, "priority": 10,
              "heartbeat": {"leaseDurationSeconds": 120, "renewIntervalSeconds": 30,
                            "statusUpdateFrequencySeconds": 60},
              "failure": {"gracePeriodSeconds": 180}}},
]
# What a virtual node and its containers use unless a pod says otherwise
# (docs/virtual-nodes.md): a little, so `kubectl top` shows something real.
VIRTUAL_USAGE = ["--fake-cpu=5m", "--fake-memory=8Mi", "--fake-node-cpu=50m",
                 "--fake-node-memory=300Mi"]
METRICS_API = "v1beta1.metrics.k8s.io"
# A Deployment for the virtual pool whose pods say what they use (see the annotations)
EXAMPLE = {
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "virtual-load", "namespace": "default"},
    "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "virtual-load"}},
             "template": {
                 "metadata": {"labels": {"app": "virtual-load"},
                              "annotations": {"fake.nodepulse.dev/cpu": "sine(200m, 100m, 2m)",
                                              "fake.nodepulse.dev/memory": "64Mi"}},
                 "spec": {"nodeSelector": {VIRTUAL_LABEL: "true"},
                          "tolerations": [{"key": VIRTUAL_LABEL, "operator": "Exists",
                                           "effect": "NoSchedule"}],
                          "containers": [{"name": "app", "image": "example/app:1",
                                          "resources": {"requests": {"cpu": "100m"}}}]}}}}


def node_address() -> str:
    """An IPv4 address of this machine the API server will proxy to (pick_address), from
    `ip`. Traffic to it stays on this machine (the kernel's local table), like traffic
    to loopback."""
    try:
        addrs, routes = (subprocess.run(["ip", "-j", "-4", *what], check=True,
                                        capture_output=True, text=True).stdout
                         for what in (["addr", "show"], ["route", "show", "default"]))
        return pick_address(json.loads(addrs or "[]"), json.loads(routes or "[]"))
    except (OSError, subprocess.CalledProcessError, ValueError) as e:
        raise RuntimeError(f"cannot list this machine's addresses with `ip` (iproute2): {e}; "
                           "give one with --node-ip") from None


def pick_address(links: list[dict[str, Any]], default_routes: list[dict[str, Any]]) -> str:
    """From `ip -j addr` and `ip -j route show default`: the address of the default
    route's interface, else the first other one; never loopback, link-local, multicast
    (the API server does not proxy to those)."""
    found = []
    for link in links:
        for a in link.get("addr_info", []):
            address = ipaddress.ip_address(a.get("local", "0.0.0.0"))
            if address.version == 4 and not (address.is_loopback or address.is_link_local
                                             or address.is_unspecified or address.is_multicast):
                found.append((link.get("ifname", ""), str(address)))
    for dev in [r.get("dev") for r in default_routes]:
        for ifname, ip in found:
            if ifname == dev:
                return ip
    if found:
        return found[0][1]
    raise RuntimeError("this machine has no IPv4 address but loopback and link-local ones, "
                       "which the API server does not proxy to; add one (as root: ip link "
                       "add np0 type dummy && ip addr add 198.18.0.1/32 dev np0 && ip link "
                       "set np0 up) or give one with --node-ip")


@dataclasses.dataclass
class Options:
    """What `up` brings up. `runtime`: the host node's: "cri" (a private containerd;
    the process runtime when containerd is missing, unless `require_containerd`),
    "fake", or "none" (no host node)."""
    virtual_nodes: int = 0
    runtime: str = "fake"
    node_name: str = dataclasses.field(default_factory=lambda: socket.gethostname().lower())
    node_ip: str | None = None  # None: node_address()
    control_plane_only: bool = False
    metrics_server: bool = True
    require_containerd: bool = False
    health_address: str = "127.0.0.1:10248"  # the host agent's /healthz and /metrics
    operator_metrics_port: int = 8081


class DevCluster:
    """Start with start(), stop with stop() (every process by PID, the state removed).
    scale() restarts the virtual pool's agent with another count."""

    def __init__(self, options: Options, workdir: Path | None = None,
                 log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> None:
        self.options = options
        self.cluster = LocalCluster(workdir)
        self.log = log
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ctd: Any = None  # nodepulse_dev.containerd.Containerd when containerd runs
        self.runtime = ""  # what the host node's pods run on, in words
        self.address = ""
        self.ready_seconds = 0.0  # from start() to every node Ready

    # ---- where things are
    @property
    def workdir(self) -> Path:
        return self.cluster.workdir

    @property
    def manifests(self) -> Path:
        return self.workdir / "manifests"

    @property
    def example(self) -> Path:
        return self.workdir / "examples" / "virtual-load.yaml"

    def virtual_names(self, count: int | None = None) -> list[str]:
        n = self.options.virtual_nodes if count is None else count
        return [f"{VIRTUAL_PREFIX}-{i}" for i in range(n)]

    def node_names(self) -> list[str]:
        host = [] if self.options.runtime == "none" else [self.options.node_name]
        return host + self.virtual_names()

    # ---- lifecycle
    def start(self) -> DevCluster:
        started = time.monotonic()
        o = self.options
        if o.metrics_server and not o.control_plane_only:
            build.ensure(["metrics-server"], log=self.log)  # once, before the clock starts
        try:
            self.cluster.up(log=self.log)
            up = time.monotonic()
            if o.control_plane_only:
                return self
            self.address = o.node_ip or node_address()
            self._kubectl("apply", "--server-side", "-f", str(CRD))
            # served only once Established: a policy created before that is a 404
            self._kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRD))
            self._apply_policies()
            bindir = Path(sys.executable).parent
            self._spawn("operator", [str(bindir / "nodepulse-operator"),
                                     f"--kubeconfig={self.cluster.kubeconfig}",
                                     f"--metrics-port={o.operator_metrics_port}",
                                     *self.cluster.node_lifecycle_args()])
            if o.runtime != "none":
                self._start_host_agent()
            if o.virtual_nodes:
                self._start_virtual_agent(o.virtual_nodes)
            self.example.parent.mkdir(exist_ok=True)
            self.example.write_text(yaml.safe_dump(EXAMPLE, sort_keys=False))
            self.log(f"operator and agents started in {time.monotonic() - up:.1f} s")
            self.wait_ready(self.node_names())
            self.ready_seconds = time.monotonic() - started
            # after the nodes' registration burst, which its first scrapes would join
            if o.metrics_server:
                self._start_metrics_server()
        except BaseException:
            self.stop(remove=False)
            self.log(f"start failed; logs kept in {self.cluster.log_dir}")
            raise
        self.log(f"{len(self.node_names())} node(s) Ready {self.ready_seconds:.1f} s after "
                 "the start")
        return self

    def stop(self, remove: bool = True) -> None:
        """Stop every process; `remove`: delete the state folder (logs included)."""
        for name, proc in reversed(list(self.procs.items())):
            stop_process(proc)
            self.log(f"{name} stopped ({proc.returncode})")
        self.procs.clear()
        # a stopped agent leaves its pods running for the next one to adopt; here
        # nothing may outlive the cluster
        if self.ctd is not None:
            self.ctd.stop()  # sandboxes (containers, shims), then containerd, by PID
            self.ctd = None
            self.log("containerd stopped")
        elif (self.workdir / "agent" / "process").exists():
            asyncio.run(stop_process_pods(self.workdir / "agent" / "process"))
        if remove:
            self.cluster.remove()
        else:
            self.cluster.down()

    def exited(self) -> str | None:
        """The name of a program that stopped by itself, if any."""
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)

    def scale(self, count: int) -> float:
        """Run the virtual pool with `count` nodes: its agent restarted with that count
        (it adopts the Nodes it had), the Nodes beyond it deleted. Seconds until every
        node of the pool was Ready."""
        started = time.monotonic()
        old = self.options.virtual_nodes
        if "virtual" in self.procs:
            stop_process(self.procs.pop("virtual"))
        core = client.CoreV1Api(self.cluster.api_client())
        for name in self.virtual_names(old)[count:]:
            with contextlib.suppress(client.ApiException):
                core.delete_node(name)
        self.options.virtual_nodes = count
        if count:
            self._start_virtual_agent(count)
            self.wait_ready(self.virtual_names())
        return time.monotonic() - started

    def wait_ready(self, names: list[str]) -> None:
        """Returns when every node in `names` is Ready. It watches the Nodes (raw JSON
        lines: a list of a thousand Nodes every second, or the client's models of them,
        would cost the API server and this process seconds of CPU each)."""
        core = client.CoreV1Api(self.cluster.api_client())
        timeout = 120 + 0.5 * len(names)  # a loaded machine registers a few nodes a second
        want = set(names)
        deadline = time.monotonic() + timeout
        ready: set[str] = set()
        version = "0"  # from the API server's cache: every Node first, then changes
        while time.monotonic() < deadline:
            if (gone := self.exited()) is not None:
                raise RuntimeError(f"{gone} exited; see {self.cluster.log_dir / (gone + '.log')}")
            stream = core.list_node(watch=True, resource_version=version, timeout_seconds=5,
                                    _preload_content=False)
            try:
                for line in stream:
                    event = json.loads(line)
                    if event["type"] == "ERROR":  # too old a version: from the start again
                        version, ready = "0", set()
                        break
                    node = event["object"]
                    version = node["metadata"]["resourceVersion"]
                    name = node["metadata"]["name"]
                    if event["type"] != "DELETED" and any(
                            c["type"] == "Ready" and c["status"] == "True"
                            for c in (node.get("status") or {}).get("conditions") or []):
                        ready.add(name)
                    else:
                        ready.discard(name)
                    if want <= ready:
                        return
            finally:
                stream.release_conn()
        raise TimeoutError(f"{len(want - ready)} of {len(want)} node(s) not Ready within "
                           f"{timeout:.0f} s (e.g. {sorted(want - ready)[:3]})")

    # ---- pieces
    def _kubectl(self, *args: str) -> None:
        subprocess.run([str(self.cluster.binary("kubectl")),
                        f"--kubeconfig={self.cluster.kubeconfig}", *args],
                       check=True, stdout=subprocess.DEVNULL)

    def _apply_policies(self) -> None:
        api = client.CustomObjectsApi(self.cluster.api_client())
        for policy in POLICIES:
            body = {"apiVersion": "nodepulse.dev/v1alpha1", "kind": "NodeStatusPolicy",
                    **policy}
            api.create_cluster_custom_object("nodepulse.dev", "v1alpha1",
                                             "nodestatuspolicies", body)

    def _start_metrics_server(self) -> None:
        c = self.cluster
        port = free_port()
        self._spawn("metrics-server", metrics_server_argv(c, port, self.workdir / "metrics-server"))
        register_metrics_api(c.api_client(), port)

    def _start_host_agent(self) -> None:
        o, c = self.options, self.cluster
        runtime = ["--runtime=fake", *VIRTUAL_USAGE]
        self.runtime = "the fake runtime (simulated usage)"
        if o.runtime == "cri":
            runtime = ["--runtime=process"]
            self.runtime = "the process runtime (containerd is not installed)"
            if shutil.which("containerd"):
                from nodepulse_dev.containerd import start_containerd
                try:
                    self.ctd = start_containerd()
                except RuntimeError as e:
                    if o.require_containerd:
                        raise
                    self.runtime = f"the process runtime (containerd did not start: {e})"
                else:
                    self.runtime = f"containerd (pid {self.ctd.pid}, {self.ctd.endpoint})"
                    # its pods' cgroups under the containerd's own root: another agent
                    # on this host (a kubelet, another dev cluster) keeps /kubepods
                    runtime = self.ctd.agent_flags
            if o.require_containerd and self.ctd is None:
                raise RuntimeError("containerd is not installed (apt package containerd)")
        self.manifests.mkdir(exist_ok=True)
        # the kubelet API (kubectl logs, exec, top, get --raw .../proxy/...): the API
        # server dials the node's InternalIP and verifies a certificate from the cluster CA
        crt, key = c.node_serving_cert(o.node_name, (self.address,))
        self._spawn("agent", [agent_program(), f"--node-name={o.node_name}",
                              f"--kubeconfig={c.node_kubeconfig(o.node_name)}",
                              f"--root-dir={self.workdir / 'agent'}",
                              f"--pod-manifest-path={self.manifests}",
                              f"--healthz-bind-address={o.health_address}",
                              f"--node-ip={self.address}", f"--address={self.address}",
                              "--port=0", f"--node-labels={POOL_LABEL}=host",
                              f"--tls-cert-file={crt}", f"--tls-private-key-file={key}",
                              f"--client-ca-file={c.ca_file()}", *runtime])

    def _start_virtual_agent(self, count: int) -> None:
        """One process for the whole pool; it writes many Nodes, so it runs with the
        admin's credentials (as the chart's, under a ServiceAccount)."""
        c = self.cluster
        crt, key = c.node_serving_cert(VIRTUAL_PREFIX, (self.address,))
        self._spawn("virtual", [agent_program(), f"--virtual-nodes={count}",
                                f"--node-name-prefix={VIRTUAL_PREFIX}-",
                                f"--kubeconfig={c.kubeconfig}", "--runtime=fake",
                                f"--root-dir={self.workdir / 'virtual'}",
                                f"--healthz-bind-address=127.0.0.1:{free_port()}",
                                f"--node-ip={self.address}", f"--address={self.address}",
                                "--port=0", f"--node-labels={POOL_LABEL}=virtual",
                                f"--tls-cert-file={crt}", f"--tls-private-key-file={key}",
                                f"--client-ca-file={c.ca_file()}", *VIRTUAL_USAGE])

    def _spawn(self, name: str, args: list[str]) -> None:
        with open(self.cluster.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL,
                                                start_new_session=True)

    # ---- what to tell a person
    def suggestions(self) -> list[str]:
        """Commands to try, each one that works as printed (e2e/test_dev_cluster.py runs
        them all), in order."""
        o = self.options
        kubectl = str(self.cluster.binary("kubectl"))
        out = [f"export KUBECONFIG={self.cluster.kubeconfig}",
               f"export PATH={Path(kubectl).parent}:$PATH",
               f"kubectl get nodes,nsp -L {POOL_LABEL}   # the pools and their "
               "policies (NodeStatusPolicy)",
               "kubectl get nsp -o custom-columns=NAME:.metadata.name,NODES:.status.nodes,"
               "LEASE:.spec.heartbeat.leaseDurationSeconds,"
               "RENEW:.spec.heartbeat.renewIntervalSeconds,"
               "STATUS-EVERY:.spec.heartbeat.statusUpdateFrequencySeconds   "
               "# each pool's heartbeat",
               "kubectl get leases -n kube-node-lease    # one Lease per node"]
        if o.metrics_server:
            out += ["kubectl top node                         # usage, through metrics-server"]
        if o.runtime != "none":
            node = o.node_name
            out += [f"kubectl get --raw /api/v1/nodes/{node}/proxy/stats/summary   "
                    "# the kubelet API, through the API server",
                    f"kubectl get --raw /api/v1/nodes/{node}/proxy/pods"]
            if o.runtime == "cri":
                out += [f"kubectl run demo --image={BUSYBOX_IMAGE} --image-pull-policy=Never "
                        "-- sh -c 'echo hello from demo; sleep 3600'   # images are local",
                        "kubectl wait --for=condition=Ready pod/demo --timeout=120s",
                        "kubectl logs demo; kubectl exec demo -- uname -a   "
                        "# through the agent's kubelet API"]
            out += [f"curl -s http://{o.health_address}/metrics | grep ^nodepulse_ | head"
                    "   # the agent's metrics; /healthz too"]
        if o.virtual_nodes:
            vn = self.virtual_names()[0]
            out += [f"kubectl get --raw /api/v1/nodes/{vn}/proxy/metrics/resource   "
                    "# a virtual node's usage, its pods' and its own",
                    f"kubectl apply -f {self.example}   # pods on the virtual "
                    "pool that say what they use",
                    "kubectl rollout status deployment/virtual-load --timeout=120s",
                    "kubectl top pod -l app=virtual-load        # after a scrape "
                    "or two (10 s each)"]
        out += [f"curl -s http://127.0.0.1:{o.operator_metrics_port}/metrics | grep "
                "^nodepulse_operator_ | head   # the operator's metrics"]
        if o.virtual_nodes:
            program = Path(sys.executable).parent / "nodepulse-dev"
            out += [f"{program} scale --virtual-nodes {o.virtual_nodes + 2}   "
                    "# more virtual nodes (and back: the same with fewer)"]
        return out


def agent_program() -> str:
    return str(Path(sys.executable).parent / "nodepulse-agent")


def metrics_server_argv(cluster: Cluster, port: int, cert_dir: Path) -> list[str]:
    """metrics-server on loopback `port`, scraping every node at its InternalIP and the
    port in its daemonEndpoints (a virtual node's own), verifying its certificate."""
    admin = str(cluster.kubeconfig)
    return [str(cluster.binary("metrics-server")), f"--kubeconfig={admin}",
            f"--authentication-kubeconfig={admin}", f"--authorization-kubeconfig={admin}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", f"--cert-dir={cert_dir}",
            "--kubelet-use-node-status-port", "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-certificate-authority={cluster.ca_file()}",
            # its shortest resolution; it must exceed the kubelet request timeout
            "--metric-resolution=10s", "--kubelet-request-timeout=5s", "-v=1"]


def register_metrics_api(api: client.ApiClient, port: int) -> None:
    """metrics.k8s.io served by a metrics-server process on loopback `port`: the
    aggregator dials an ExternalName Service's name."""
    core = client.CoreV1Api(api)
    with contextlib.suppress(client.ApiException):
        core.delete_namespaced_service("metrics-server", "kube-system")
    core.create_namespaced_service("kube-system", {
        "metadata": {"name": "metrics-server"},
        "spec": {"type": "ExternalName", "externalName": "localhost", "ports": [{"port": port}]}})
    reg = client.ApiregistrationV1Api(api)
    with contextlib.suppress(client.ApiException):
        reg.delete_api_service(METRICS_API)
    reg.create_api_service({
        "metadata": {"name": METRICS_API},
        "spec": {"group": "metrics.k8s.io", "version": "v1beta1",
                 "insecureSkipTLSVerify": True, "groupPriorityMinimum": 100,
                 "versionPriority": 100,
                 "service": {"namespace": "kube-system", "name": "metrics-server",
                             "port": port}}})


async def stop_process_pods(state_dir: Path) -> None:
    """Stop and remove every container the process runtime recorded (SIGTERM to its
    process group by the recorded PID, SIGKILL after 10 s)."""
    from nodeagent.runtime.process import ProcessRuntime
    rt = ProcessRuntime(state_dir)
    try:
        listed = await rt.relist()
        await asyncio.gather(*(rt.stop_container(c.id, 10) for c in listed.containers
                               if c.state != "EXITED"))
        for c in listed.containers:
            await rt.remove_container(c.id)
        for sb in listed.sandboxes:
            await rt.remove_sandbox(sb.id)
        if listed.containers:
            print(f"{len(listed.containers)} pod container(s) stopped", file=sys.stderr)
    finally:
        await rt.close()
