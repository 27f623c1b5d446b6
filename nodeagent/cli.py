"""nodepulse-agent: command line entry point."""

from __future__ import annotations

import argparse
import sys

from nodeagent import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodepulse-agent",
        description="A light kubelet-style node agent: registers its Node, renews its "
                    "Lease, reports NodeStatus only on meaningful change, and runs the "
                    "pods bound to it.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--kubeconfig", help="kubeconfig with this node's credentials")
    parser.add_argument("--node-name", help="name of the Node to register (default: hostname)")
    return parser


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    print("nodepulse-agent: the agent loops are not built yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
