"""nodepulse-agent: command line entry point."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import uvloop

from nodeagent import __version__, config
from nodeagent.api.client import ClientConfigError, load_credentials
from nodeagent.runtime.base import ContainerRuntimeError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodepulse-agent",
        description="A light kubelet-style node agent: registers its Node, renews its "
                    "Lease, reports NodeStatus only on meaningful change, and runs the "
                    "pods bound to it. Every flag can also be set as NODEPULSE_<FLAG> "
                    "(e.g. NODEPULSE_NODE_NAME) or as a camelCase key in --config.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    config.add_flags(parser)
    return parser


async def _serve(cfg: config.AgentConfig, flags: dict[str, object]) -> None:
    from nodeagent.agent import Agent, Externals  # the heavy imports only when running
    from nodeagent.api.clock import RealClock
    from nodeagent.api.kube import RestKube
    from nodeagent.collector import Collector

    # every caller retries with its own deadline (tenacity for the Lease); requests and
    # watches (a ConfigMap or Secret that pods use has a watch of its own) run on the
    # event loop over aiohttp connections (nodeagent/api/rest.py)
    kube = RestKube(load_credentials(cfg.kubeconfig), component="agent")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # the process's garbage collection (a policy of the process, not of the Agent, which
    # tests run many of in one process)
    clock = RealClock()
    collector = asyncio.create_task(Collector(clock).run(), name="collector")
    try:
        ext = Externals(kube, clock, flags=flags, env=os.environ)
        await Agent(cfg, ext).run(stop)
    finally:
        collector.cancel()
        await kube.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    flags = vars(parser.parse_args(argv))
    try:
        cfg = config.load(flags)
    except config.ConfigError as e:
        print(f"nodepulse-agent: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # uvloop: the same asyncio, its loop and transports in C (docs/architecture.md,
        # "Dependencies")
        uvloop.run(_serve(cfg, flags))
    except (ClientConfigError, ContainerRuntimeError, config.ConfigError) as e:
        print(f"nodepulse-agent: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
