"""python -m nodepulse_dev up|down|env|build|node-kubeconfig NAME"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nodepulse_dev import build
from nodepulse_dev.cluster import LocalCluster

# Remembers where the cluster that `up` started keeps its state, for `down` and `env`.
POINTER = build.cache_root() / "current-cluster"


def current() -> LocalCluster | None:
    if not POINTER.exists():
        return None
    workdir = Path(POINTER.read_text().strip())
    return LocalCluster(workdir) if (workdir / "state.json").exists() else None


def print_env(cluster: LocalCluster) -> None:
    bins = {p.parent for p in build.ensure(["kubectl", "helm"], log=lambda _: None).values()}
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    print(f"export PATH={':'.join(str(b) for b in sorted(bins))}:$PATH")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nodepulse-dev",
                                     description="The local Kubernetes control plane.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="build (once) and start etcd, kube-apiserver, "
                              "kube-controller-manager and kube-scheduler")
    sub.add_parser("down", help="stop every process by PID and remove the state")
    sub.add_parser("env", help="print shell exports for kubectl and helm")
    sub.add_parser("build", help="only build the pinned binaries into the cache")
    nk = sub.add_parser("node-kubeconfig", help="write a kubeconfig for system:node:NAME")
    nk.add_argument("name")
    args = parser.parse_args(argv)

    running = current()
    if args.cmd == "build":
        for name, path in build.ensure().items():
            print(f"{name}: {path}")
    elif args.cmd == "up":
        if running:
            print(f"already up: {running.server}", file=sys.stderr)
        else:
            running = LocalCluster().up(log=lambda m: print(m, file=sys.stderr))
            POINTER.parent.mkdir(parents=True, exist_ok=True)
            POINTER.write_text(str(running.workdir))
        print_env(running)
    elif running is None:
        print("no local cluster is up (start one with `python -m nodepulse_dev up`)",
              file=sys.stderr)
        return 0 if args.cmd == "down" else 1
    elif args.cmd == "down":
        running.remove()
        POINTER.unlink(missing_ok=True)
        print("control plane stopped", file=sys.stderr)
    elif args.cmd == "env":
        print_env(running)
    elif args.cmd == "node-kubeconfig":
        print(running.node_kubeconfig(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
