"""The system a soak runs, built from the e2e harness: on the local control plane, one
agent on a private containerd (its root dir on a slow disk when one can be made here),
one agent of N virtual nodes, both reaching the API server through a TCP proxy that
can be cut, two operator replicas and two NodeStatusPolicies (one per agent). And the
faults, one method per kind: each injects its fault, holds it, undoes it, and returns
when the system part it touched answers again.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client

from e2e.harness.nodeenv import AgentProc, cri_view
from e2e.harness.operators import (
    ELECTION,
    RUN,
    Operator,
    OperatorCredentials,
    apply_crds,
    leader,
)
from e2e.harness.pools import policy
from e2e.harness.processes import marked
from e2e.harness.promtext import samples
from e2e.harness.slowdisk import SlowDisk, available
from e2e.harness.tcpproxy import TcpProxy, proxied_kubeconfig
from e2e.harness.waits import eventually
from nodeagent.api.policy import GROUP, HEARTBEAT_ANNOTATION, PLURAL, VERSION
from nodepulse_dev import LocalCluster

# what an API call raises when the API server refuses it or cannot be reached
API_DOWN = (client.ApiException, urllib3.exceptions.HTTPError)

# the policies: the containerd node's Lease 20 s (renewed every 5 s), grace 40 s; the
# virtual nodes' 40 s (every 10 s), grace 60 s
POLICIES = {"cri": {"lease": 20, "grace": 40}, "virtual": {"lease": 40, "grace": 60}}
POOL_LABEL = "nodepulse-e2e/pool"


class Rig:
    def __init__(self, cluster: LocalCluster, workdir: Path, virtual_nodes: int,
                 log: Callable[[str], None]) -> None:
        self.cluster, self.workdir, self.log = cluster, workdir, log
        self.virtual_count = virtual_nodes
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.cri_name = f"soak-{RUN}-cri"
        self.virtual_prefix = f"soak-{RUN}-vn"
        self.virtual_names = [f"{self.virtual_prefix}-{i}" for i in range(virtual_nodes)]
        self.pools = {"cri": f"{RUN}-soak-cri", "virtual": f"{RUN}-soak-virtual"}
        self.creds = OperatorCredentials(cluster.kubeconfig, "kube-system", ELECTION)
        self.ctd: Any = None
        self.disk: SlowDisk | None = None
        self.disk_note = ""
        self.proxy: TcpProxy | None = None
        self.cri: AgentProc | None = None
        self.virtual: AgentProc | None = None
        self.operators: list[Operator] = []
        self.policy_names: dict[str, str] = {}
        self.rng = random.Random(0)  # which operator dies when no leader is known

    @property
    def cri_root(self) -> Path:
        return self.workdir / "agent-root"

    def pool_of(self, node: str) -> str:
        return "cri" if node == self.cri_name else "virtual"

    def nodes(self) -> list[str]:
        return [self.cri_name, *self.virtual_names]

    # ---- start and stop
    def start(self) -> None:
        from nodepulse_dev.containerd import start_containerd

        os.environ.setdefault("NODEPULSE_PORT", "0")  # the kubelet API on a free port
        apply_crds(self.cluster)
        api = self.cluster.api_client()
        for pool, p in POLICIES.items():
            self.policy_names[pool] = policy(api, f"soak-{pool}", f"soak-{pool}",
                                             grace=p["grace"], lease=p["lease"])
        self.ctd = start_containerd()
        reason = available()
        if reason is None:
            self.disk = SlowDisk(self.workdir / "agent-disk", self.cri_root).mount()
            self.disk_note = "a FUSE passthrough that sleeps before each operation"
        else:
            self.cri_root.mkdir(parents=True, exist_ok=True)
            self.disk_note = f"not injected: {reason}"
        self.proxy = TcpProxy("127.0.0.1", self.cluster.ports["kube-apiserver"]).start()
        cri_config = proxied_kubeconfig(self.cluster.node_kubeconfig(self.cri_name),
                                        self.proxy.port, self.workdir / "cri.kubeconfig")
        self.cri = AgentProc(self.cri_name, self.cri_root, cri_config, [
            "--runtime=cri", f"--container-runtime-endpoint={self.ctd.endpoint}",
            f"--node-labels={POOL_LABEL}={self.pools['cri']}"], log=self.logs / "agent-cri.log")
        virtual_config = proxied_kubeconfig(self.cluster.kubeconfig, self.proxy.port,
                                            self.workdir / "virtual.kubeconfig")
        vroot = self.workdir / "virtual-root"
        vroot.mkdir(exist_ok=True)
        self.virtual = AgentProc(self.virtual_prefix, vroot, virtual_config, [
            "--runtime=fake", "--virtual-nodes", str(self.virtual_count),
            "--node-name-prefix", self.virtual_prefix,
            f"--node-labels={POOL_LABEL}={self.pools['virtual']}"],
            log=self.logs / "agent-virtual.log")
        self.cri.start()
        self.virtual.start()
        self.operators = [self._operator("a"), self._operator("b")]
        core = client.CoreV1Api(api)
        want = {**{n: self.policy_names["virtual"] for n in self.virtual_names},
                self.cri_name: self.policy_names["cri"]}

        def ready() -> bool:
            have = {}
            for n in core.list_node(label_selector=f"{POOL_LABEL} in "
                                    f"({self.pools['cri']},{self.pools['virtual']})").items:
                ann = (n.metadata.annotations or {}).get(HEARTBEAT_ANNOTATION, "")
                if ann and any(c.type == "Ready" and c.status == "True"
                               for c in n.status.conditions or []):
                    have[n.metadata.name] = f'"policy":"{want.get(n.metadata.name)}"' in ann
            return len(have) == len(want) and all(have.values())
        eventually(ready, f"{len(want)} nodes Ready under their policies", 300, every=2)
        eventually(lambda: leader(api, self.creds) in {o.identity for o in self.operators},
                   "an operator leader", 60)
        api.close()

    def _operator(self, suffix: str) -> Operator:
        return Operator(self.cluster, f"op-{RUN}-soak-{suffix}", self.creds)

    def restore(self) -> None:
        """Undo whatever fault is under way (after an error or an interruption)."""
        if self.proxy is not None:
            self.proxy.resume()
        if self.disk is not None:
            self.disk.fast()
        with contextlib.suppress(Exception):
            self.cluster.ensure_running()
        if self.ctd is not None and (self.ctd.proc is None or self.ctd.proc.poll() is not None):
            with contextlib.suppress(Exception):
                self.ctd.start_daemon()
        for agent in (self.cri, self.virtual):
            if agent is not None and not agent.running():
                agent.start()
        for i, op in enumerate(self.operators):
            if op.proc.poll() is not None:
                self.operators[i] = self._operator(op.identity.rsplit("-", 1)[1])

    def stop(self, namespace: str | None) -> list[str]:
        """Delete the workload (its pods stopped by their agents), stop everything by
        PID, delete the Nodes, Leases and policies; what was left running (swept). The
        processes are stopped even when the API cannot be reached (a control plane the
        faults left down)."""
        api = self.cluster.api_client()
        core = client.CoreV1Api(api)
        if namespace:
            with contextlib.suppress(*API_DOWN):
                core.delete_namespace(namespace)
            if self.cri is not None and self.cri.running():
                with contextlib.suppress(AssertionError):
                    eventually(lambda: not marked(self.cri_name), "the workload's containers "
                               "stopped by the agent", 120, every=1)
        for agent in (self.virtual, self.cri):
            if agent is not None:
                agent.stop()
        for op in self.operators:
            op.kill(signal.SIGTERM)
        if self.ctd is not None:
            self.ctd.stop()
        if self.disk is not None:
            self.disk.unmount()
        if self.proxy is not None:
            self.proxy.stop()
        leftovers = marked(self.cri_name)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        coord = client.CoordinationV1Api(api)
        for n in self.nodes():
            for delete in (lambda n=n: core.delete_node(n),
                           lambda n=n: coord.delete_namespaced_lease(n, "kube-node-lease")):
                with contextlib.suppress(*API_DOWN):
                    delete()
        custom = client.CustomObjectsApi(api)
        for name in self.policy_names.values():
            with contextlib.suppress(*API_DOWN):
                custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)
        api.close()
        return [f"pid {p}" for p in leftovers]

    # ---- processes the checks read
    def processes(self) -> dict[str, tuple[int, int | None]]:
        """role -> (pid, metrics port) of each program that runs now."""
        out: dict[str, tuple[int, int | None]] = {}
        for role, agent in (("agent-cri", self.cri), ("agent-virtual", self.virtual)):
            if agent is not None and agent.proc is not None and agent.running():
                out[role] = (agent.proc.pid, agent.port)
        for op in self.operators:
            if op.proc.poll() is None:
                out[f"operator-{op.identity.rsplit('-', 1)[1]}"] = (op.proc.pid, op.port)
        return out

    def leaders(self) -> dict[str, float | None]:
        """identity -> its nodepulse_operator_leader gauge (None: not answering)."""
        out: dict[str, float | None] = {}
        for op in self.operators:
            try:
                out[op.identity] = samples(op.metrics(), "nodepulse_operator_leader")
            except OSError:
                out[op.identity] = None
        return out

    def runtime_view(self) -> Any:
        return cri_view(self.ctd)

    # ---- the faults: fault(kind)(hold, delay) injects, holds, undoes; returns a note
    def fault(self, kind: str) -> Callable[[float, float, threading.Event], str]:
        return getattr(self, "_" + kind.replace("-", "_"))

    def _apiserver_kill(self, hold: float, delay: float, stop: threading.Event) -> str:
        self.cluster.kill_apiserver()
        stop.wait(hold)
        for attempt in range(4):
            try:
                self.cluster.start_apiserver()
                return "" if attempt == 0 else f"started at the attempt {attempt + 1}"
            except RuntimeError:  # it exits when etcd (another lane's fault) stays away
                if attempt == 3:
                    raise
                stop.wait(5)
        return ""

    def _apiserver_stop(self, hold: float, delay: float, stop: threading.Event) -> str:
        self.cluster.pause_apiserver()
        try:
            stop.wait(hold)
        finally:
            self.cluster.resume_apiserver()
        return ""

    def _etcd_restart(self, hold: float, delay: float, stop: threading.Event) -> str:
        self.cluster.stop_etcd()
        stop.wait(hold)
        self.cluster.start_etcd(wait_apiserver=False)
        return ""

    def _etcd_compact(self, hold: float, delay: float, stop: threading.Event) -> str:
        rev = self.cluster.etcd_revision()
        self.cluster.compact_etcd(rev)
        return f"revision {rev}"

    def _containerd_restart(self, hold: float, delay: float, stop: threading.Event) -> str:
        self.ctd.kill_daemon()
        stop.wait(hold)
        self.ctd.start_daemon()
        return ""

    def _agent_kill(self, hold: float, delay: float, stop: threading.Event) -> str:
        return self._kill_agent(self.cri, hold, stop)

    def _virtual_agent_kill(self, hold: float, delay: float, stop: threading.Event) -> str:
        return self._kill_agent(self.virtual, hold, stop)

    @staticmethod
    def _kill_agent(agent: AgentProc | None, hold: float, stop: threading.Event) -> str:
        assert agent is not None
        if agent.running():
            agent.sigkill()
        stop.wait(hold)
        agent.start()
        return ""

    def _operator_leader_kill(self, hold: float, delay: float, stop: threading.Event) -> str:
        deadline = time.monotonic() + 10
        victim = None
        while victim is None and time.monotonic() < deadline and not stop.is_set():
            victim = next((o for o in self.operators if self.leaders().get(o.identity) == 1),
                          None)
            if victim is None:
                stop.wait(0.5)
        note = ""
        if victim is None:  # no replica says it leads (an API outage): kill either
            victim = self.rng.choice(self.operators)
            note = "no replica led: killed one at random"
        victim.kill(signal.SIGKILL)
        stop.wait(hold)
        if victim in self.operators:  # (restore() may have started it again already)
            self.operators[self.operators.index(victim)] = self._operator(
                victim.identity.rsplit("-", 1)[1])
        return note or f"killed {victim.identity}"

    def _network_cut(self, hold: float, delay: float, stop: threading.Event) -> str:
        assert self.proxy is not None
        self.proxy.cut()
        try:
            stop.wait(hold)
        finally:
            self.proxy.resume()
        return ""

    def _slow_disk(self, hold: float, delay: float, stop: threading.Event) -> str:
        if self.disk is None:
            stop.wait(hold)
            return self.disk_note
        self.disk.slow(delay)
        try:
            stop.wait(hold)
        finally:
            self.disk.fast()
        return f"{delay * 1000:.0f} ms per operation"

