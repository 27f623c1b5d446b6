"""nodepulse-operator: command line entry point."""

from __future__ import annotations

import argparse
import sys

from nodeoperator import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodepulse-operator",
        description="Manages NodeStatusPolicy resources and, through them, Nodes and "
                    "their Leases: effective heartbeat policy per node, stale-lease "
                    "detection, conditions, taints and paced eviction.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--kubeconfig", help="kubeconfig to use (default: in-cluster)")
    return parser


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    print("nodepulse-operator: the operator handlers are not built yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
