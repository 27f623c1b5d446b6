"""The agent's composition root: shared machinery plus one NodeController per node.

Shared, whatever the number of nodes: one API client, one renewal scheduler with its
own thread pool, one status ticker with another, one node watch, one health server.
A host agent speaks for one node; virtual nodes add more controllers to the same.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry

from nodeagent import __version__
from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import Clock
from nodeagent.api.kube import Kube
from nodeagent.api.serve import HealthServer
from nodeagent.config import VIRTUAL_LABEL, AgentConfig, ConfigError, load
from nodeagent.node.controller import (
    ImageLister,
    NodeController,
    NodeControllerConfig,
    NodeSpec,
    Readiness,
)
from nodeagent.node.host import HostProbe, HostReadError, HostReadings
from nodeagent.node.metrics import NodeMetrics
from nodeagent.node.scheduler import Blocking, DueScheduler
from nodeagent.node.status import StatusSettings
from nodeagent.node.watch import NodeWatch

if TYPE_CHECKING:
    from nodeagent.pods import Pods

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


@dataclasses.dataclass(frozen=True)
class Pools:
    """The threads blocking work runs on: the Lease writes on their own, so a renewal
    never waits behind status work (host readings, status PATCHes, registration)."""

    lease: concurrent.futures.Executor
    status: concurrent.futures.Executor

    @classmethod
    def of(cls, cfg: AgentConfig) -> Pools:
        return cls(concurrent.futures.ThreadPoolExecutor(cfg.lease_concurrency,
                                                         thread_name_prefix="lease"),
                   concurrent.futures.ThreadPoolExecutor(cfg.status_concurrency,
                                                         thread_name_prefix="status"))


class Agent:
    def __init__(self, cfg: AgentConfig, kube: Kube, clock: Clock, *,
                 answered: ApiAnswered | None = None, uids: dict[str, str] | None = None,
                 pools: Pools | None = None,
                 pods: Pods | None = None, images: ImageLister | None = None,
                 readiness: Readiness | None = None, registry: CollectorRegistry = REGISTRY,
                 flags: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        """`pods`: the node's pod machinery (nodeagent.pods); it also supplies the
        image list, the runtime version and readiness unless those are given."""
        self.cfg = cfg
        self.clock = clock
        self.pods = pods
        self.answered = answered or ApiAnswered(clock)
        self.registry = registry
        self._flags = dict(flags or {})
        self._env = env
        self.pools = pools or Pools.of(cfg)
        self.status_call = Blocking(self.pools.status)
        self.nodes: dict[str, NodeController] = {}
        self.uids: dict[str, str] = {} if uids is None else uids
        self.probe = host_probe(cfg)
        self.shared_readings = SharedReadings(self.probe.read, self.clock)
        self.settings = status_settings(cfg)
        self.metrics = NodeMetrics(registry)
        self.renewals: DueScheduler[str] = DueScheduler(self.clock, self._renew, "renewals")
        self.ticker: DueScheduler[str] = DueScheduler(self.clock, self._tick, "status")
        self.node_config = NodeControllerConfig(
            kube=kube.using(self.pools.status), lease_kube=kube.using(self.pools.lease),
            clock=clock, metrics=self.metrics, heartbeat=cfg.heartbeat, status=self.settings,
            # virtual nodes share one reading of the host; a host node reads it every tick
            probe=self.shared_readings.read if cfg.virtual else self.probe.read,
            status_call=self.status_call, renewals=self.renewals, ticker=self.ticker,
            answered=self.answered, uids=self.uids,
            images=images or (pods.images if pods else None),
            readiness=readiness or (pods.readiness if pods else None), legacy=cfg.legacy)
        self.kube = kube
        self.watch: NodeWatch | None = None
        self.health: HealthServer | None = None
        self._config_mtime = self._mtime()

    # -- nodes --
    def add_node(self, spec: NodeSpec,
                 probe: Callable[[], HostReadings] | None = None) -> NodeController:
        config = self.node_config
        if probe is not None:
            config = dataclasses.replace(config, probe=probe)
        node = NodeController(spec, dataclasses.replace(config, status=self.settings),
                              rng=random.Random())
        self.nodes[spec.name] = node
        self.metrics.nodes.set(len(self.nodes))
        return node

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
        self.watch = NodeWatch(self.kube, self.nodes, self.clock, agent_id=self.cfg.agent_id,
                               answered=self.answered)
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

    async def shutdown(self, tasks: Sequence[asyncio.Task[Any]]) -> None:
        """No new work; writes already sent finish before the pools close."""
        log.info("stopping")
        if self.watch:
            self.watch.stop()
        if self.pods:
            await self.pods.stop()  # pods keep running; a restarted agent adopts them
        await self.renewals.stop()
        await self.ticker.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pool in (self.pools.lease, self.pools.status):
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
        if self.health:
            self.health.stop()
        log.info("stopped")
