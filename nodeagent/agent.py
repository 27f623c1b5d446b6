"""The agent's composition root: shared machinery plus one NodeController per node.

Shared, whatever the number of nodes: one API client, one renewal scheduler with its
own thread pool, one status ticker with another, one node watch, one health server.
A host agent speaks for one node; virtual nodes add more controllers to the same.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kubernetes import client
from prometheus_client import REGISTRY, CollectorRegistry

from nodeagent import __version__
from nodeagent.api.clock import Clock, RealClock
from nodeagent.api.policy import AGENT_LABEL
from nodeagent.api.serve import HealthServer
from nodeagent.config import VIRTUAL_LABEL, AgentConfig, ConfigError, load
from nodeagent.node.controller import ImageLister, NodeController, NodeSpec, Readiness
from nodeagent.node.host import HostProbe, HostReadError, HostReadings
from nodeagent.node.kube import Kube, Obj, RealKube
from nodeagent.node.metrics import NodeMetrics
from nodeagent.node.scheduler import Blocking, DueScheduler
from nodeagent.node.status import StatusSettings
from nodeagent.node.watch import NodeWatch

if TYPE_CHECKING:
    from nodeagent.pods import Pods
    from nodeagent.server.kubeapi import ServerApi
    from nodeagent.server.setup import ServerBundle

log = logging.getLogger(__name__)


def status_settings(cfg: AgentConfig) -> StatusSettings:
    return StatusSettings(max_pods=cfg.max_pods, thresholds=cfg.eviction_hard,
                          system_reserved=dict(cfg.system_reserved),
                          max_images=cfg.heartbeat.maxImagesInStatus,
                          agent_version=f"v{__version__}-nodepulse")  # semver: tools parse it


class SharedReadings:
    """One host reading shared by every node for `ttl` seconds: 1000 virtual nodes'
    status ticks read /proc once a second, not 1000 times. Called from status threads."""

    def __init__(self, read: Callable[[], HostReadings], clock: Clock, ttl: float = 1.0) -> None:
        self._read = read
        self.clock = clock
        self.ttl = ttl
        self.reads = 0
        self._lock = threading.Lock()
        self._at = -math.inf
        self._value: HostReadings | HostReadError | None = None

    def read(self) -> HostReadings:
        with self._lock:
            now = self.clock.monotonic()
            if self._value is None or now - self._at >= self.ttl:
                try:
                    self._value = self._read()
                except HostReadError as e:
                    self._value = e  # the same failure for everyone until the next read
                self._at = now
                self.reads += 1
            value = self._value
        if isinstance(value, HostReadError):
            raise value
        return value


def node_specs(cfg: AgentConfig) -> list[NodeSpec]:
    """The Nodes this process speaks for: one host node, or the virtual ones (labelled
    nodepulse.dev/virtual=true and tainted with the virtual taints)."""
    if not cfg.virtual:
        return [NodeSpec(cfg.node_name, cfg.agent_id, labels=dict(cfg.node_labels),
                         taints=cfg.register_with_taints)]
    labels = {**cfg.node_labels, VIRTUAL_LABEL: "true"}
    taints = list(cfg.register_with_taints)
    taints += [t for t in cfg.virtual_node_taints
               if (t["key"], t["effect"]) not in {(u["key"], u["effect"]) for u in taints}]
    return [NodeSpec(name, cfg.agent_id, labels=labels, taints=taints)
            for name in cfg.virtual_node_names]


def host_probe(cfg: AgentConfig) -> HostProbe:
    return HostProbe(root_dir=cfg.root_dir, proc=cfg.proc_path, node_ips=cfg.node_ips,
                     overrides=cfg.host_overrides)


class Agent:
    def __init__(self, cfg: AgentConfig, api: client.ApiClient | None = None, *,
                 kube: Kube | None = None, clock: Clock | None = None,
                 images: ImageLister | None = None, readiness: Readiness | None = None,
                 registry: CollectorRegistry = REGISTRY,
                 flags: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None,
                 lease_executor: concurrent.futures.Executor | None = None,
                 status_executor: concurrent.futures.Executor | None = None,
                 watch_executor: concurrent.futures.Executor | None = None,
                 pods: Pods | None = None, server_api: ServerApi | None = None) -> None:
        """`pods`: the node's pod machinery (nodeagent.pods); it also supplies the
        image list, the runtime version and readiness unless those are given."""
        if kube is None:
            if api is None:
                raise ValueError("Agent needs an ApiClient (or a Kube)")
            kube = RealKube(api)
        self.cfg = cfg
        self.kube = kube
        self.clock = clock or RealClock()
        self.pods = pods
        self.images = images or (pods.images if pods else None)
        self.readiness = readiness or (pods.readiness if pods else None)
        self.metrics = NodeMetrics(registry)
        self.registry = registry
        self._flags = dict(flags or {})
        self._env = env
        self.lease_call = Blocking(lease_executor or concurrent.futures.ThreadPoolExecutor(
            cfg.lease_concurrency, thread_name_prefix="lease"))
        self.status_call = Blocking(status_executor or concurrent.futures.ThreadPoolExecutor(
            cfg.status_concurrency, thread_name_prefix="status"))
        self.watch_call = Blocking(watch_executor or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="watch"))
        self.nodes: dict[str, NodeController] = {}
        self.renewals: DueScheduler[str] = DueScheduler(self.clock, self._renew, "renewals")
        self.ticker: DueScheduler[str] = DueScheduler(self.clock, self._tick, "status")
        self.probe = host_probe(cfg)
        self.shared_readings = SharedReadings(self.probe.read, self.clock)
        self.settings = status_settings(cfg)
        self.watch: NodeWatch | None = None
        self._api_answered_at = -math.inf
        self.health: HealthServer | None = None
        self._config_mtime = self._mtime()
        # the kubelet API (nodeagent.server), when cfg.port is set and pods run here
        self.server_api = server_api
        if server_api is None and api is not None:
            from nodeagent.server.kubeapi import RealServerApi
            self.server_api = RealServerApi(api)
        self.kubelet_api: ServerBundle | None = None

    # -- nodes --
    def add_node(self, spec: NodeSpec, probe: Callable[[], HostReadings] | None = None) -> NodeController:
        # virtual nodes share one reading of the host; a host node reads it every tick
        default = self.shared_readings.read if self.cfg.virtual else self.probe.read
        node = NodeController(
            spec, self.kube, self.clock, self.metrics, heartbeat=self.cfg.heartbeat,
            settings=self.settings, probe=probe or default,
            lease_call=self.lease_call, status_call=self.status_call,
            renewals=self.renewals, ticker=self.ticker, images=self.images,
            readiness=self.readiness, legacy=self.cfg.legacy, rng=random.Random())
        node.lease.on_recovered = self._api_answered
        self.nodes[spec.name] = node
        self.metrics.nodes.set(len(self.nodes))
        return node

    def _api_answered(self) -> None:
        """A Lease renewal went through after failing: the API server answers again.
        The watches waiting out a backoff reconnect now, not up to 8 s (Node) or 30 s
        (pods) later, so pods bound during an outage start that much sooner. Once a
        second at most: a thousand virtual nodes' Leases recover together."""
        now = self.clock.monotonic()
        if now - self._api_answered_at < 1.0:
            return
        self._api_answered_at = now
        if self.watch is not None:
            self.watch.api_answered()
        if self.pods is not None:
            self.pods.api_answered()

    async def _renew(self, name: str) -> float | None:
        node = self.nodes.get(name)
        return await node.renew() if node else None

    async def _tick(self, name: str) -> float | None:
        node = self.nodes.get(name)
        if node is None:
            return None
        if node is next(iter(self.nodes.values())):
            await self._maybe_reload()  # once per update period, not once per node
        return await node.tick()

    def _on_node(self, kind: str, obj: Obj) -> None:
        node = self.nodes.get((obj.get("metadata") or {}).get("name", ""))
        if node is None:
            return
        if kind == "DELETED":
            log.warning("node %s: deleted; it will be registered again", node.name)
            node.registered = False
            self.renewals.cancel(node.name)
            return
        node.on_node(obj)

    # -- health --
    def healthz(self) -> str | None:
        problems = [p for n in self.nodes.values() if (p := n.health())]
        if not problems:
            return None
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return "; ".join(problems[:3]) + more

    def readyz(self) -> str | None:
        waiting = [n.name for n in self.nodes.values() if not n.registered]
        return f"not registered yet: {', '.join(waiting[:5])}" if waiting else None

    # -- live config: host overrides and eviction thresholds follow the file --
    def _mtime(self) -> float | None:
        path = self.cfg.config_file
        try:
            return path.stat().st_mtime if path else None
        except OSError:
            return None

    async def _maybe_reload(self) -> None:
        mtime = self._mtime()
        if mtime == self._config_mtime or self.cfg.config_file is None:
            return
        self._config_mtime = mtime
        try:
            cfg = load(self._flags, self._env)
        except ConfigError as e:
            log.warning("config file changed but was refused; keeping the last good one: %s", e)
            return
        live = ("eviction_hard", "host_overrides", "system_reserved", "max_pods")
        # Every other setting is read once at start.
        changed = [f.name for f in dataclasses.fields(cfg)
                   if f.name not in live and getattr(cfg, f.name) != getattr(self.cfg, f.name)]
        if changed:
            log.warning("config file: %s only take effect on restart", ", ".join(changed))
        self.cfg = dataclasses.replace(self.cfg, **{f: getattr(cfg, f) for f in live})
        self.probe.overrides = dict(self.cfg.host_overrides)
        self.settings = dataclasses.replace(status_settings(self.cfg),
                                            runtime_version=self.settings.runtime_version)
        for node in self.nodes.values():
            node.settings = self.settings
        log.info("config file reloaded: eviction thresholds %s",
                 ",".join(t.text() for t in self.cfg.eviction_hard))

    # -- run --
    async def run(self, stop: asyncio.Event) -> None:
        if not self.nodes:
            for spec in node_specs(self.cfg):
                self.add_node(spec)
        # one node: a single-object watch (all node credentials allow); many: one
        # label-selector watch for all of them
        one = len(self.nodes) == 1
        self.watch = NodeWatch(
            self.kube, self.clock, self.watch_call, self._on_node,
            field_selector=f"metadata.name={next(iter(self.nodes))}" if one else "",
            label_selector="" if one else f"{AGENT_LABEL}={self.cfg.agent_id}")
        if self.cfg.healthz_bind_address:
            host, port = self.cfg.healthz_bind_address
            try:
                self.health = HealthServer(host, port, self.registry)
            except OSError as e:
                raise ConfigError(f"--healthz-bind-address: cannot listen on {host}:{port}: "
                                  f"{e.strerror or e}") from e
            self.health.health_checks["heartbeat"] = self.healthz
            self.health.ready_checks["registered"] = self.readyz
            if self.pods:
                self.health.health_checks["pleg"] = self.pods.health
            self.health.start()
            log.info("serving /healthz and /metrics on %s:%d", host, self.health.port)
        tasks = [asyncio.create_task(self.renewals.run(), name="renewals"),
                 asyncio.create_task(self.ticker.run(), name="status"),
                 asyncio.create_task(self.watch.run(), name="watch")]
        if self.pods:
            await self.pods.start()  # the runtime's version is in the first NodeStatus
            self.settings = dataclasses.replace(self.settings,
                                                runtime_version=self.pods.runtime_version)
            api_port = await self._serve_kubelet_api()
            if api_port is not None:  # in the first NodeStatus too
                self.settings = dataclasses.replace(self.settings, kubelet_port=api_port)
            for node in self.nodes.values():
                node.settings = self.settings
            tasks.append(asyncio.create_task(self.pods.wait(), name="pods"))
        for node in self.nodes.values():
            node.start()
        log.info("agent running: %d node(s), heartbeat mode %s", len(self.nodes),
                 self.cfg.heartbeat_mode)
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not waiter and t.exception():
                log.error("agent loop %s ended: %r", t.get_name(), t.exception())
        await self.shutdown(tasks + [waiter])

    async def _serve_kubelet_api(self) -> int | None:
        """Start the kubelet API; its port, or None when it is not served."""
        if self.cfg.port is None or self.pods is None or self.server_api is None:
            return None
        from nodeagent.server import setup
        try:
            addresses = [a for _, a in self.probe.read().addresses]
        except HostReadError:
            addresses = list(self.cfg.node_ips)
        checks = {"heartbeat": self.healthz, "pleg": self.pods.health}
        self.kubelet_api = setup.build(self.cfg, self.pods, self.server_api, clock=self.clock,
                                       registry=self.registry, addresses=addresses,
                                       health_checks=checks)
        return await self.kubelet_api.start()

    async def shutdown(self, tasks: Sequence[asyncio.Task[Any]]) -> None:
        """No new work; writes already sent finish before the pools close."""
        log.info("stopping")
        if self.watch:
            self.watch.stop()
        if self.kubelet_api:
            await self.kubelet_api.stop()
        if self.pods:
            await self.pods.stop()  # pods keep running; a restarted agent adopts them
        await self.renewals.stop()
        await self.ticker.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.lease_call.shutdown)
        await asyncio.to_thread(self.status_call.shutdown)
        # the watch thread may sit in a long read; its stream was closed above
        with contextlib.suppress(Exception):
            self.watch_call.executor.shutdown(wait=False, cancel_futures=True)
        if self.health:
            self.health.stop()
        log.info("stopped")
