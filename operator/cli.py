"""nodepulse-operator: command line entry point."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvloop
from nodeoperator import __version__
from nodeoperator.modes import CLUSTER_GRACE_DEFAULT, COEXIST, MODES, parse_duration

from nodeagent.api.client import ClientConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodepulse-operator",
        description="Manages NodeStatusPolicy resources and, through them, Nodes and "
                    "their Leases: effective heartbeat policy per node, stale-lease "
                    "detection, Ready=Unknown, unreachable taints and paced eviction. "
                    "Run two replicas: one leads (a Lease), the other stands by.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--kubeconfig", help="kubeconfig to use (default: $KUBECONFIG, "
                        "in-cluster, ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context")
    parser.add_argument("--identity", help="this replica's name in the leader Lease "
                        "(default: $POD_NAME or hostname_pid)")
    parser.add_argument("--leader-election-namespace",
                        default=os.environ.get("POD_NAMESPACE", "kube-system"),
                        help="namespace of the leader Lease (default: $POD_NAMESPACE or "
                        "kube-system)")
    parser.add_argument("--leader-election-name", default="nodepulse-operator",
                        help="name of the leader Lease (default: %(default)s)")
    parser.add_argument("--leader-lease-duration", type=float, default=15.0, metavar="S",
                        help="a standby takes over after the Lease is unchanged this long "
                        "(default: %(default)s)")
    parser.add_argument("--leader-renew-deadline", type=float, default=10.0, metavar="S",
                        help="the leader stops acting when it could not renew for this long "
                        "(default: %(default)s)")
    parser.add_argument("--leader-retry-period", type=float, default=2.0, metavar="S",
                        help="how often to renew or try to acquire (default: %(default)s)")
    parser.add_argument("--monitor-period", type=float, default=2.0, metavar="S",
                        help="how often Lease freshness is checked (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve /metrics, /healthz, /readyz on this port (0: any free "
                        "port; default: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address for --metrics-port (default: %(default)s)")
    parser.add_argument("--node-lifecycle", choices=MODES, default=COEXIST,
                        help="coexist: kube-controller-manager's node-lifecycle controller "
                        "runs (managed clusters, kind and kubeadm by default); the operator "
                        "only marks nodes sooner than it would and never undoes it. "
                        "exclusive: that controller is off (--controllers=*,-node-lifecycle-"
                        "controller) and the operator does its work (default: %(default)s)")
    parser.add_argument("--node-monitor-grace-period", default=f"{CLUSTER_GRACE_DEFAULT:g}s",
                        metavar="DURATION",
                        help="coexist mode: the controller manager's --node-monitor-grace-"
                        "period, e.g. 40s (default: %(default)s, its default since "
                        "Kubernetes 1.32)")
    parser.add_argument("--writers", type=int, default=32,
                        help="API writes in flight at once, at most; more wait, a stale "
                        "node's marking first (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from nodeoperator.app import Options, run
    from nodeoperator.modes import Lifecycle

    try:
        lifecycle = Lifecycle(args.node_lifecycle, parse_duration(args.node_monitor_grace_period))
    except ValueError as e:
        print(f"nodepulse-operator: --node-monitor-grace-period: {e}", file=sys.stderr)
        return 2

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("kopf").setLevel(logging.WARNING)
    opts = Options(kubeconfig=args.kubeconfig, context=args.context,
                   election_namespace=args.leader_election_namespace,
                   election_name=args.leader_election_name,
                   lease_duration=args.leader_lease_duration,
                   renew_deadline=args.leader_renew_deadline,
                   retry_period=args.leader_retry_period,
                   monitor_period=args.monitor_period,
                   metrics_host=args.metrics_host, metrics_port=args.metrics_port,
                   writers=args.writers, lifecycle=lifecycle)
    identity = args.identity or os.environ.get("POD_NAME")
    if identity:
        opts.identity = identity
    if opts.writers < 1:
        print(f"nodepulse-operator: --writers must be at least 1, got {opts.writers}",
              file=sys.stderr)
        return 2
    if not (opts.retry_period < opts.renew_deadline < opts.lease_duration):
        print("nodepulse-operator: need --leader-retry-period < --leader-renew-deadline < "
              "--leader-lease-duration", file=sys.stderr)
        return 2
    try:
        # the agent's event loop, uvloop (docs/architecture.md, "Dependencies")
        uvloop.run(run(opts))
    except ClientConfigError as e:
        print(f"nodepulse-operator: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
