"""The whole system on one machine, in the foreground: the local control plane, the
CRDs, the operator and one agent that runs pods: on a private containerd when the
containerd binary is installed, else on the process runtime. Ctrl-C (or SIGTERM) stops
every process by PID: the agent, the pods' containers, containerd and its shims.

    python -m e2e.stack [--node-name NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from e2e.harness.processes import stop_process
from nodepulse_dev import LocalCluster
from nodepulse_dev.images import BUSYBOX_IMAGE

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "charts" / "nodepulse" / "crds"
AGENT_HEALTH = "127.0.0.1:10248"
OPERATOR_METRICS_PORT = 8081


class Stack:
    """require_containerd: fail instead of falling back to the process runtime (the
    upstream conformance run needs a CRI node). The addresses default to `make run`'s."""

    def __init__(self, node_name: str, *, health_address: str = AGENT_HEALTH,
                 operator_metrics_port: int = OPERATOR_METRICS_PORT,
                 require_containerd: bool = False) -> None:
        self.node_name = node_name
        self.health_address = health_address
        self.operator_metrics_port = operator_metrics_port
        self.require_containerd = require_containerd
        self.cluster = LocalCluster()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ctd: Any = None  # nodepulse_dev.containerd.Containerd when containerd runs
        self.runtime = ""

    @property
    def agent_root(self) -> Path:
        return self.cluster.workdir / "agent"

    @property
    def manifests(self) -> Path:
        return self.cluster.workdir / "manifests"

    def start(self) -> None:
        c = self.cluster
        c.up(log=lambda m: print(m, file=sys.stderr))
        subprocess.run([str(c.binary("kubectl")), f"--kubeconfig={c.kubeconfig}", "apply",
                        "--server-side", "-f", str(CRDS)], check=True, stdout=subprocess.DEVNULL)
        bindir = Path(sys.executable).parent
        self._spawn("operator", [str(bindir / "nodepulse-operator"),
                                 f"--kubeconfig={c.kubeconfig}",
                                 f"--metrics-port={self.operator_metrics_port}",
                                 *c.node_lifecycle_args()])
        runtime = ["--runtime=process"]
        self.runtime = "the process runtime (containerd is not installed)"
        if shutil.which("containerd"):
            from nodepulse_dev.containerd import start_containerd
            try:
                self.ctd = start_containerd()
            except RuntimeError as e:
                if self.require_containerd:
                    raise
                self.runtime = f"the process runtime (containerd did not start: {e})"
            else:
                self.runtime = f"containerd (pid {self.ctd.pid}, {self.ctd.endpoint})"
                runtime = ["--runtime=cri",
                           f"--container-runtime-endpoint={self.ctd.endpoint}"]
        if self.require_containerd and self.ctd is None:
            raise RuntimeError("containerd is not installed (apt package containerd)")
        self.manifests.mkdir(exist_ok=True)
        # the kubelet API (kubectl logs, exec, ...): the API server dials the node's
        # InternalIP and verifies a serving certificate from the cluster CA
        crt, key = c.node_serving_cert(self.node_name)
        self._spawn("agent", [str(bindir / "nodepulse-agent"), f"--node-name={self.node_name}",
                              f"--kubeconfig={c.node_kubeconfig(self.node_name)}",
                              f"--root-dir={self.agent_root}",
                              f"--pod-manifest-path={self.manifests}",
                              f"--healthz-bind-address={self.health_address}", "--node-ip=127.0.0.1",
                              f"--tls-cert-file={crt}", f"--tls-private-key-file={key}",
                              f"--client-ca-file={c.ca_file()}", *runtime])

    def _spawn(self, name: str, args: list[str]) -> None:
        with open(self.cluster.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL,
                                                start_new_session=True)

    def stop(self) -> None:
        for name, proc in reversed(list(self.procs.items())):
            stop_process(proc)
            print(f"{name} stopped ({proc.returncode})", file=sys.stderr)
        # a stopped agent leaves its pods running for the next one to adopt; here
        # nothing may outlive the stack
        if self.ctd is not None:
            self.ctd.stop()  # sandboxes (containers, shims), then containerd, by PID
            print("containerd stopped", file=sys.stderr)
        elif (self.agent_root / "process").exists():
            asyncio.run(stop_process_pods(self.agent_root / "process"))
        self.cluster.remove()

    def exited(self) -> str | None:
        """The name of a program that stopped by itself, if any."""
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.stack", description=__doc__)
    parser.add_argument("--node-name", default=socket.gethostname().lower())
    args = parser.parse_args(argv)

    stack = Stack(args.node_name)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        stack.start()
        kubectl = shutil.which("kubectl") or stack.cluster.binary("kubectl")
        print(f"""
nodepulse is running: control plane, operator, agent for node {args.node_name!r},
its pods on {stack.runtime}.
  export KUBECONFIG={stack.cluster.kubeconfig}
  {kubectl} get nodes,leases -A            # the Node and its Lease
  {kubectl} get nodestatuspolicies         # policies (kubectl get nsp)
  {kubectl} run demo --image={BUSYBOX_IMAGE} --image-pull-policy=Never -- sleep 3600
                                           # a pod on the agent's node (images are local)
  {kubectl} logs demo; {kubectl} exec -it demo -- sh   # through the agent's kubelet API
  static pods: put manifests in {stack.manifests}
  curl -s http://{AGENT_HEALTH}/metrics     # agent metrics; /healthz too
  curl -s http://127.0.0.1:{OPERATOR_METRICS_PORT}/metrics      # operator metrics
  logs: {stack.cluster.log_dir}
Ctrl-C stops everything.""", flush=True)
        while not stopping.wait(1):
            if (gone := stack.exited()) is not None:
                print(f"{gone} exited; see {stack.cluster.log_dir / (gone + '.log')}",
                      file=sys.stderr)
                return 1
        return 0
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            stack.stop()


if __name__ == "__main__":
    sys.exit(main())
