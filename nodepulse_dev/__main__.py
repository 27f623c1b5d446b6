"""nodepulse-dev: a local Kubernetes cluster of nodepulse nodes on one machine
(docs/dev-cluster.md).

    nodepulse-dev up [--virtual-nodes N] [--runtime cri|fake|none] [--foreground]
    nodepulse-dev scale --virtual-nodes N
    nodepulse-dev env
    nodepulse-dev down
    nodepulse-dev build [NAME ...] | node-kubeconfig NAME

`up` starts the cluster in a process of its own (the supervisor: it holds every other
process and stops them all, by PID, on `down`) and returns once every node is Ready;
with --foreground it is that process, and Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from nodepulse_dev import build
from nodepulse_dev.cluster import LocalCluster
from nodepulse_dev.devcluster import DevCluster, Options


def pointer() -> Path:
    """Where the workdir of the cluster that `up` started is written, for the other
    commands (NODEPULSE_DEV_CLUSTER: another file, for a second cluster)."""
    return Path(os.environ.get("NODEPULSE_DEV_CLUSTER")
                or build.cache_root() / "current-cluster")


def current() -> Path | None:
    """The running cluster's workdir, or None."""
    p = pointer()
    if not p.exists():
        return None
    workdir = Path(p.read_text().strip())
    return workdir if (workdir / "state.json").exists() else None


def supervisor_pid(workdir: Path) -> int | None:
    try:
        pid = int((workdir / "supervisor.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if supervising(pid) else None


def supervising(pid: int) -> bool:
    """The process `pid` runs and is a supervisor (a reused PID is not)."""
    try:
        return b"nodepulse" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodepulse-dev", description="A local Kubernetes cluster of nodepulse nodes: "
        "the control plane built from source, the operator, metrics-server, the host's "
        "node and a pool of virtual nodes.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the cluster (once built); returns when every "
                                   "node is Ready")
    up.add_argument("--virtual-nodes", type=int, default=0, metavar="N",
                    help="a pool of N virtual nodes (vn-0 ...), one agent, the fake runtime")
    up.add_argument("--runtime", choices=("cri", "fake", "none"), default="fake",
                    help="the host's node: its pods on a private containerd (cri; the "
                         "process runtime without containerd), simulated (fake, the "
                         "default), or no host node (none)")
    up.add_argument("--node-name", help="the host node's name (default: the hostname)")
    up.add_argument("--node-ip", help="the address nodes register and serve their kubelet "
                                      "API on (default: the default route's interface's; "
                                      "not loopback: the API server does not proxy there)")
    up.add_argument("--healthz-bind-address", default="127.0.0.1:10248",
                    help="the host agent's /healthz and /metrics")
    up.add_argument("--operator-metrics-port", type=int, default=8081)
    up.add_argument("--control-plane-only", action="store_true",
                    help="only etcd, kube-apiserver, kube-controller-manager, kube-scheduler")
    up.add_argument("--foreground", action="store_true",
                    help="stay in the foreground; Ctrl-C stops everything")
    up.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    scale = sub.add_parser("scale", help="change the number of virtual nodes")
    scale.add_argument("--virtual-nodes", type=int, required=True, metavar="N")
    sub.add_parser("down", help="stop every process by PID and remove the state")
    sub.add_parser("env", help="print shell exports for kubectl and helm")
    b = sub.add_parser("build", help="only build pinned binaries into the cache (by default "
                                     "the control plane and kubectl)")
    b.add_argument("names", nargs="*", metavar="NAME")
    b.add_argument("--idle", action="store_true",
                   help="build at idle CPU priority, letting a process that needs a program "
                        "now build it first (the e2e suite's background build)")
    nk = sub.add_parser("node-kubeconfig", help="write a kubeconfig for system:node:NAME")
    nk.add_argument("name")
    return parser


def options(args: argparse.Namespace) -> Options:
    o = Options(virtual_nodes=args.virtual_nodes, runtime=args.runtime,
                node_ip=args.node_ip, control_plane_only=args.control_plane_only,
                health_address=args.healthz_bind_address,
                operator_metrics_port=args.operator_metrics_port)
    if args.node_name:
        o.node_name = args.node_name
    if o.virtual_nodes < 0:
        raise SystemExit("nodepulse-dev up: --virtual-nodes must be 0 or more")
    return o


def summary(dev: DevCluster, foreground: bool) -> str:
    o = dev.options
    program = Path(sys.executable).parent / "nodepulse-dev"
    if o.control_plane_only:
        head = f"control plane up: {dev.cluster.server}"
    else:
        pools = [] if o.runtime == "none" else [f"node {o.node_name!r} (pods on {dev.runtime})"]
        if o.virtual_nodes:
            pools.append(f"{o.virtual_nodes} virtual node(s) vn-0 ... (the fake runtime)")
        head = (f"nodepulse is running: control plane, operator, metrics-server, "
                f"{' and '.join(pools)}; {len(dev.node_names())} node(s) Ready in "
                f"{dev.ready_seconds:.1f} s, registered at {dev.address}.")
    lines = [head, "Try:", *(f"  {s}" for s in (
        dev.suggestions() if not o.control_plane_only else
        [f"export KUBECONFIG={dev.cluster.kubeconfig}",
         f"export PATH={dev.cluster.binary('kubectl').parent}:$PATH",
         "kubectl get --raw /readyz"]))]
    lines.append("")
    if o.runtime != "none" and not o.control_plane_only:
        lines.append(f"static pods: put manifests in {dev.manifests}")
    lines += [f"logs: {dev.cluster.log_dir}",
              "Ctrl-C stops everything." if foreground else f"stop it: {program} down"]
    return "\n".join(lines)


def run_foreground(args: argparse.Namespace) -> int:
    """Start, serve `scale` requests (SIGHUP), stop on SIGINT or SIGTERM."""
    dev = DevCluster(options(args), args.workdir)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt
    # while starting, SIGTERM (a `down` meanwhile) interrupts as Ctrl-C does; a failed
    # or interrupted start stops what it started, keeps the logs and raises
    signal.signal(signal.SIGTERM, interrupt)
    (dev.workdir / "supervisor.pid").write_text(str(os.getpid()))
    pointer().parent.mkdir(parents=True, exist_ok=True)
    pointer().write_text(str(dev.workdir))  # `down` finds it while it starts too
    try:
        dev.start()
    except BaseException:
        forget(dev)
        raise
    stopping = threading.Event()
    rescale = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    signal.signal(signal.SIGHUP, lambda *_: rescale.set())
    try:
        text = summary(dev, foreground=args.workdir is None)
        print(text, flush=True)
        (dev.workdir / "ready").write_text(text)
        while not stopping.wait(0.5):
            if rescale.is_set():
                rescale.clear()
                request = dev.workdir / "scale-request"
                count = int(request.read_text())
                seconds = dev.scale(count)
                (dev.workdir / "scale-done").write_text(f"{count} {seconds:.1f}")
            if (gone := dev.exited()) is not None:
                print(f"{gone} exited; see {dev.cluster.log_dir / (gone + '.log')}",
                      file=sys.stderr)
                return 1
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop runs to its end
        dev.stop()
        forget(dev)


def forget(dev: DevCluster) -> None:
    """The pointer no longer names this cluster."""
    if pointer().exists() and pointer().read_text().strip() == str(dev.workdir):
        pointer().unlink()


def up(args: argparse.Namespace, argv: list[str]) -> int:
    running = current()
    if running is not None and supervisor_pid(running) is not None:
        print(f"a cluster is already up ({running}); `nodepulse-dev down` first",
              file=sys.stderr)
        return 1
    if args.foreground:
        return run_foreground(args)
    workdir = Path(tempfile.mkdtemp(prefix="nodepulse-dev-"))
    log = Path(f"{workdir}.log")  # kept when the workdir goes
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nodepulse_dev", *argv, "--foreground",
                                 f"--workdir={workdir}"], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    while not (workdir / "ready").exists():
        if proc.poll() is not None:
            print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
            print(f"nodepulse-dev up failed (exit {proc.returncode}); log: {log}",
                  file=sys.stderr)
            return 1
        time.sleep(0.2)
    print((workdir / "ready").read_text())
    return 0


def scale(workdir: Path, count: int) -> int:
    pid = supervisor_pid(workdir)
    if pid is None:
        print("the cluster's supervisor is not running", file=sys.stderr)
        return 1
    if count < 0:
        print("nodepulse-dev scale: --virtual-nodes must be 0 or more", file=sys.stderr)
        return 1
    done = workdir / "scale-done"
    done.unlink(missing_ok=True)
    (workdir / "scale-request").write_text(str(count))
    os.kill(pid, signal.SIGHUP)
    while not done.exists():
        if supervisor_pid(workdir) is None:
            print("the cluster stopped while scaling", file=sys.stderr)
            return 1
        time.sleep(0.2)
    n, seconds = done.read_text().split()
    print(f"{n} virtual node(s) Ready {seconds} s after the request")
    return 0


def down(workdir: Path) -> int:
    pid = supervisor_pid(workdir)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 120
        while supervising(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    if (workdir / "state.json").exists():  # the supervisor died without its stop
        LocalCluster(workdir).remove()
    pointer().unlink(missing_ok=True)
    Path(f"{workdir}.log").unlink(missing_ok=True)
    print("stopped", file=sys.stderr)
    return 0


def print_env(workdir: Path) -> None:
    # a first build says so on stderr: stdout is for the shell to evaluate
    built = build.ensure(["kubectl", "helm"], log=lambda m: print(m, file=sys.stderr))
    bins = {p.parent for p in built.values()}
    print(f"export KUBECONFIG={LocalCluster(workdir).kubeconfig}")
    print(f"export PATH={':'.join(str(b) for b in sorted(bins))}:$PATH")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "build":
        unknown = [n for n in args.names if n not in build.TOOLS]
        if unknown:
            parser.error(f"build: no pinned program {', '.join(unknown)} "
                         f"(one of {', '.join(build.TOOLS)})")
        if args.idle:
            build.build_at_idle_priority(args.names or build.SETUP)
            return 0
        for name, path in build.ensure(args.names or None).items():
            print(f"{name}: {path}")
        return 0
    if args.cmd == "up":
        return up(args, argv)
    workdir = current()
    if workdir is None:
        print("no local cluster is up (start one with `nodepulse-dev up`)", file=sys.stderr)
        return 0 if args.cmd == "down" else 1
    if args.cmd == "down":
        return down(workdir)
    if args.cmd == "scale":
        return scale(workdir, args.virtual_nodes)
    if args.cmd == "env":
        print_env(workdir)
    elif args.cmd == "node-kubeconfig":
        print(LocalCluster(workdir).node_kubeconfig(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
