"""Wiring: kopf watches Nodes and NodeStatusPolicies into the indexes, a plain watch
(leasewatch.py) does the same for the node Leases; the leader elector and the one monitor
loop run beside kopf in its event loop.

kopf handlers here only read events (no create/update handlers, so kopf writes no
progress annotations or finalizers): every write is the monitor's, and only the
leader's. kopf runs standalone (no kopf peering); HA is the Lease election.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from typing import Any

import kopf
from nodeoperator.election import KubeLeaseBackend, LeaderElector
from nodeoperator.leasewatch import LeaseWatch
from nodeoperator.modes import Lifecycle
from nodeoperator.monitor import Monitor
from nodeoperator.nodeevents import NodeEvents
from nodeoperator.state import Store
from nodeoperator.sync import InitialSync
from nodeoperator.writes import EVENT_WRITERS, KubeWriter

from nodeagent.api.client import load_credentials
from nodeagent.api.clock import Clock, RealClock
from nodeagent.api.kube import RestKube
from nodeagent.api.policy import GROUP, PLURAL, VERSION
from nodeagent.api.serve import HealthServer

log = logging.getLogger("nodeoperator")

@dataclasses.dataclass
class Options:
    kubeconfig: str | None = None
    context: str | None = None
    identity: str = dataclasses.field(
        default_factory=lambda: f"{socket.gethostname()}_{os.getpid()}")
    election_namespace: str = "kube-system"
    election_name: str = "nodepulse-operator"
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    monitor_period: float = 2.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no endpoint
    writers: int = 32
    lifecycle: Lifecycle = dataclasses.field(default_factory=Lifecycle)


def connection_info(kubeconfig: str | None, context: str | None) -> kopf.ConnectionInfo:
    """The same credentials nodeagent.api.client loads, in kopf's form."""
    creds = load_credentials(kubeconfig, context)
    scheme, _, token = (creds.authorization() or "").partition(" ")
    basic = creds.username is not None
    return kopf.ConnectionInfo(
        server=creds.server, ca_path=creds.ca_file, ca_data=creds.ca_data,
        insecure=creds.insecure, username=creds.username, password=creds.password,
        scheme=None if basic else scheme or None, token=None if basic else token or None,
        certificate_path=creds.cert_file, certificate_data=creds.cert_data,
        private_key_path=creds.key_file, private_key_data=creds.key_data,
        proxy_url=creds.proxy)


def build_registry(store: Store, opts: Options) -> kopf.OperatorRegistry:
    # The event handlers are coroutines: kopf would run plain functions in a thread
    # pool, a hop that costs more than the handler itself at hundreds of events/s.
    reg = kopf.OperatorRegistry()

    @kopf.on.login(registry=reg)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(opts.kubeconfig, opts.context)

    @kopf.on.event("", "v1", "nodes", registry=reg)
    async def node_event(type: str | None, body: Any, **_: Any) -> None:  # noqa: A002 (kopf's)
        store.node_event(type, body)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=reg)
    async def policy_event(type: str | None, body: Any, **_: Any) -> None:  # noqa: A002
        store.policy_event(type, body)

    return reg


def settings() -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    s.posting.enabled = False  # the standby must not write, not even Events
    s.watching.server_timeout = 300
    s.queueing.idle_timeout = 60  # keep the per-object workers of busy Nodes
    return s


async def run(opts: Options, clock: Clock | None = None) -> None:
    clock = clock or RealClock()
    store = Store(clock)
    kube = RestKube(load_credentials(opts.kubeconfig, opts.context), component="operator")
    elector = LeaderElector(KubeLeaseBackend(kube, opts.election_namespace,
                                             opts.election_name),
                            clock, opts.identity, duration=opts.lease_duration,
                            renew_deadline=opts.renew_deadline, retry=opts.retry_period)
    writer = KubeWriter(kube, workers=opts.writers)
    events = NodeEvents(writer, clock, instance=opts.identity, concurrency=EVENT_WRITERS)
    leases = LeaseWatch(kube, store, clock)
    # The monitor's first period waits for complete views: kopf's first lists of Nodes
    # and policies (sync.py) and the first Lease list.
    synced = InitialSync(kube, store, clock)
    monitor = Monitor(store, clock, writer, period=opts.monitor_period,
                      is_leader=lambda: elector.leading,
                      api_ok_since=lambda: elector.api_ok_since, parallel=opts.writers,
                      events=events, synced=(synced.done, leases.listed),
                      lifecycle=opts.lifecycle)
    events.after = monitor.marked.wait  # a mass marking's Events wait for it to be done
    ready = asyncio.Event()
    server = None
    if opts.metrics_port is not None:
        server = HealthServer(opts.metrics_host, opts.metrics_port)
        server.ready_checks["watching"] = (
            lambda: None if ready.is_set() and leases.listed.is_set() and synced.done.is_set()
            else "the watches have not listed every Node, policy and Lease yet")
        server.start()
        log.info("metrics and health on http://%s:%d", opts.metrics_host, server.port)
    log.info("starting as %s (leader Lease %s/%s), node lifecycle %s", opts.identity,
             opts.election_namespace, opts.election_name,
             "exclusive" if opts.lifecycle.exclusive else
             f"coexist (the controller manager's grace {opts.lifecycle.cluster_grace:g}s)")
    tasks = [asyncio.create_task(elector.run(), name="election"),
             asyncio.create_task(leases.run(), name="lease-watch"),
             asyncio.create_task(synced.run(), name="initial-sync"),
             asyncio.create_task(monitor.run(), name="monitor")]
    try:
        # kopf watches only cluster-scoped resources (Nodes, policies): clusterwide, so
        # it neither lists nor watches Namespaces. standalone: no kopf peering (and no
        # peering CRDs); the Lease election is the HA. It handles SIGINT/SIGTERM.
        await kopf.operator(registry=build_registry(store, opts), settings=settings(),
                            standalone=True, clusterwide=True, ready_flag=ready)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:  # the Events of the last writes, briefly
            await asyncio.wait_for(events.drain(), 2)
        except TimeoutError:
            log.info("Events not posted at shutdown were dropped")
        await elector.release()
        if server:
            server.stop()
        await kube.aclose()
        log.info("stopped")
