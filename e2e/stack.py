"""The whole system on one machine, in the foreground: the local control plane, the
CRDs, the operator and one agent. Ctrl-C (or SIGTERM) stops every process by PID.

    python -m e2e.stack [--node-name NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from e2e.cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "charts" / "nodepulse" / "crds"
AGENT_HEALTH = "127.0.0.1:10248"
OPERATOR_METRICS_PORT = 8081


class Stack:
    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.cluster = LocalCluster()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        c = self.cluster
        c.up(log=lambda m: print(m, file=sys.stderr))
        subprocess.run([str(c.binary("kubectl")), f"--kubeconfig={c.kubeconfig}", "apply",
                        "--server-side", "-f", str(CRDS)], check=True, stdout=subprocess.DEVNULL)
        bindir = Path(sys.executable).parent
        self._spawn("operator", [str(bindir / "nodepulse-operator"),
                                 f"--kubeconfig={c.kubeconfig}",
                                 f"--metrics-port={OPERATOR_METRICS_PORT}"])
        self._spawn("agent", [str(bindir / "nodepulse-agent"), f"--node-name={self.node_name}",
                              f"--kubeconfig={c.node_kubeconfig(self.node_name)}",
                              f"--root-dir={c.workdir / 'agent'}",
                              f"--healthz-bind-address={AGENT_HEALTH}"])

    def _spawn(self, name: str, args: list[str]) -> None:
        with open(self.cluster.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL,
                                                start_new_session=True)

    def stop(self) -> None:
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            print(f"{name} stopped ({proc.returncode})", file=sys.stderr)
        self.cluster.remove()

    def exited(self) -> str | None:
        """The name of a program that stopped by itself, if any."""
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)


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
nodepulse is running: control plane, operator, agent for node {args.node_name!r}.
  export KUBECONFIG={stack.cluster.kubeconfig}
  {kubectl} get nodes,leases -A            # the Node and its Lease
  {kubectl} get nodestatuspolicies         # policies (kubectl get nsp)
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
