"""nodepulse-agent: command line entry point."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import uvloop

from nodeagent import __version__, config
from nodeagent.api.client import ClientConfigError
from nodeagent.node.host import startup_refusal
from nodeagent.runtime.base import ContainerRuntimeError

log = logging.getLogger("nodeagent")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodepulse-agent",
        description="A light kubelet-style node agent: registers its Node, renews its "
                    "Lease, reports NodeStatus only on meaningful change, and runs the "
                    "pods bound to it. Every flag can also be set as NODEPULSE_<FLAG> "
                    "(e.g. NODEPULSE_NODE_NAME) or as a camelCase key in --config; the "
                    "kubelet's flags and KubeletConfiguration are taken too "
                    "(docs/kubelet-dropin.md).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    config.add_flags(parser)
    return parser


async def _serve(cfg: config.AgentConfig, flags: dict[str, object]) -> None:
    from nodeagent.agent import Agent, Externals  # the heavy imports only when running
    from nodeagent.api.client import load_credentials
    from nodeagent.api.clock import RealClock
    from nodeagent.api.kube import RestKube
    from nodeagent.collector import Collector

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    clock = RealClock()
    rotation = None
    if cfg.bootstrap_kubeconfig or cfg.rotate_certificates:
        # a client certificate through TLS bootstrap (waits for its CSR to be signed; a
        # stop ends the wait), or rotated: cryptography is imported only then
        from nodeagent.api.bootstrap import (
            ClientCertRotation,
            ClientCertSettings,
            client_credentials,
        )
        certs = ClientCertSettings(
            node=cfg.node_name, kubeconfig=Path(cfg.kubeconfig) if cfg.kubeconfig else None,
            bootstrap_kubeconfig=Path(cfg.bootstrap_kubeconfig) if cfg.bootstrap_kubeconfig
            else None, cert_dir=Path(cfg.cert_dir), rotate=cfg.rotate_certificates)
        getting = asyncio.ensure_future(client_credentials(certs, clock))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({getting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not getting.done():
            getting.cancel()
            await asyncio.gather(getting, return_exceptions=True)
            return
        creds = getting.result()
    else:
        creds = load_credentials(cfg.kubeconfig)
    # every caller retries with its own deadline (tenacity for the Lease); requests and
    # watches (a ConfigMap or Secret that pods use has a watch of its own) run on the
    # event loop over aiohttp connections (nodeagent/api/rest.py)
    kube = RestKube(creds, component="agent")
    if cfg.rotate_certificates:
        rotation = asyncio.create_task(ClientCertRotation(
            certs, creds, kube.separate(1), clock).run(stop), name="client-cert")
    # the process's garbage collection (a policy of the process, not of the Agent, which
    # tests run many of in one process)
    collector = asyncio.create_task(Collector(clock).run(), name="collector")
    try:
        ext = Externals(kube, clock, flags=flags, env=os.environ)
        await Agent(cfg, ext).run(stop)
    finally:
        collector.cancel()
        if rotation is not None:
            rotation.cancel()
            await asyncio.gather(rotation, return_exceptions=True)
        await kube.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    flags = vars(parser.parse_args(argv))
    try:
        cfg, notes = config.load_with_notes(flags)
    except config.ConfigError as e:
        print(f"nodepulse-agent: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for note in notes:  # the kubelet's settings this agent does not do, each by name
        log.warning("%s", note)
    refusal = startup_refusal(fail_swap_on=cfg.fail_swap_on,
                              fail_cgroup_v1=cfg.fail_cgroup_v1, proc=cfg.proc_path)
    if refusal:
        print(f"nodepulse-agent: error: {refusal}", file=sys.stderr)
        return 2
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
