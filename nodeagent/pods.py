"""The pod half of the agent: sources -> sync loop -> runtime, for one node.

    pods = Pods.from_config(cfg, api, clock)     # runtime, pod sources, sync loop
    Agent(cfg, api, pods=pods)                   # it feeds NodeStatus (images, runtime
                                                 # version, readiness) and /healthz

The runtime's image list is cached here and refreshed on its own period, because the
node status is computed in a worker thread and the runtime's calls are coroutines of
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client
from prometheus_client import REGISTRY, CollectorRegistry

from nodeagent.api.clock import Clock
from nodeagent.config import AgentConfig
from nodeagent.node.host import HostProbe, HostReadError
from nodeagent.podstatus import PodStatusWriter
from nodeagent.runtime import (
    ContainerRuntimeError,
    ContainerState,
    PodRuntimeStatus,
    Runtime,
    make_runtime,
)
from nodeagent.runtime.logs import LogRotation
from nodeagent.sources.bundle import PodSources, SourcesConfig
from nodeagent.sources.events import NodeEvents
from nodeagent.sources.types import PodUpdate, SourcesReady
from nodeagent.syncloop import NodeLoops, SyncLoop, SyncLoopConfig

log = logging.getLogger(__name__)

IMAGE_REFRESH = 10.0  # seconds; the default NodeStatus update period
DOWN_RETRY = 1.0      # seconds between runtime readings while it is down


def build_runtime(cfg: AgentConfig, host_ip: str = "") -> Runtime:
    """The runtime the config names; process runtime state lives under --root-dir."""
    opts: dict[str, Any] = {}
    kind = cfg.runtime
    if kind == "auto" and cfg.virtual:
        kind = "fake"
    if kind == "cri" and cfg.virtual:  # config.load refuses it too; a clear error here
        raise ContainerRuntimeError("the cri runtime cannot serve virtual nodes; use "
                                    "--runtime fake or process")
    if kind == "auto":
        from nodeagent.runtime import socket_path
        kind = "cri" if Path(socket_path(cfg.container_runtime_endpoint)).exists() else "process"
    if kind == "process":
        opts = {"state_dir": Path(cfg.root_dir) / "process", "host_ip": host_ip}
    elif kind == "fake":
        opts = {"host_ip": host_ip or "192.0.2.10"}
    return make_runtime(kind, cfg.container_runtime_endpoint, **opts)


def host_ip(cfg: AgentConfig, probe: HostProbe) -> str:
    """The node's first InternalIP (pods report it as hostIP)."""
    if cfg.node_ips:
        return cfg.node_ips[0]
    try:
        addresses = probe.read().addresses
    except HostReadError:
        return ""
    return next((a for t, a in addresses if t == "InternalIP"), "")


class Pods:
    def __init__(self, *, runtime: Runtime, clock: Clock, node_name: str,
                 updates: asyncio.Queue[PodUpdate], sources_ready: SourcesReady,
                 run_sources: Callable[[], Coroutine[Any, Any, None]] | None = None,
                 api_client: client.ApiClient | None = None,
                 status_writer: PodStatusWriter | None = None, host_ip: str = "",
                 config: SyncLoopConfig | None = None,
                 registry: CollectorRegistry = REGISTRY,
                 image_refresh: float = IMAGE_REFRESH,
                 node_names: Sequence[str] = (), label: str = "",
                 log_rotation: tuple[int, int] | None = None) -> None:
        """`node_names`: more than one is virtual-node mode: one PLEG for the runtime,
        one SyncLoop per node (NodeLoops); `label` names the shared PLEG in metrics.
        `log_rotation`: (max size, max files) of container logs; None: not rotated."""
        self.runtime = runtime
        self.clock = clock
        self.node_name = node_name
        self.node_names = tuple(node_names) or (node_name,)
        self.run_sources = run_sources
        self.image_refresh = image_refresh
        self.loop: SyncLoop | NodeLoops
        if len(self.node_names) > 1:
            self.loop = NodeLoops(runtime=runtime, clock=clock, node_names=self.node_names,
                                  updates=updates, sources_ready=sources_ready,
                                  api_client=api_client, status_writer=status_writer,
                                  host_ip=host_ip, config=config, registry=registry,
                                  label=label or node_name)
        else:
            self.loop = SyncLoop(runtime=runtime, clock=clock, node_name=node_name,
                                 updates=updates, sources_ready=sources_ready,
                                 api_client=api_client, status_writer=status_writer,
                                 host_ip=host_ip, config=config, registry=registry)
        self.runtime_version = ""   # "<name>://<version>", as nodeInfo shows it
        self.runtime_problem: str | None = None
        self._images: list[dict[str, Any]] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self.log_rotation = None if log_rotation is None else LogRotation(
            runtime, self.running_logs, clock, max_size=log_rotation[0],
            max_files=log_rotation[1])
        # called when the node's own requests reach the API server again after failing
        self.on_api_answered: list[Callable[[], None]] = []

    @classmethod
    def from_config(cls, cfg: AgentConfig, api: client.ApiClient, clock: Clock, *,
                    host_ip: str = "", registry: CollectorRegistry = REGISTRY,
                    runtime: Runtime | None = None) -> Pods:
        """`runtime`: use this one instead of the one the config names (an embedding
        program or a test wrapping the runtime, e.g. to inject faults)."""
        runtime = runtime or build_runtime(cfg, host_ip)
        # virtual nodes: one API pod watch for all names (static pods are refused)
        sources = PodSources(api, SourcesConfig(
            node_names=cfg.node_names, pod_manifest_path=cfg.pod_manifest_path,
            file_check_frequency=cfg.file_check_frequency, manifest_url=cfg.manifest_url,
            manifest_url_headers=dict(cfg.manifest_url_headers),
            http_check_frequency=cfg.http_check_frequency,
            allow_privileged=cfg.allow_privileged),
            clock, events=NodeEvents(api, cfg.node_name, clock))
        logs = Path(cfg.root_dir) / "logs" / "pods"
        pods = cls(runtime=runtime, clock=clock, node_name=cfg.node_name,
                   updates=sources.updates, sources_ready=sources.ready,
                   run_sources=sources.run, api_client=api, host_ip=host_ip,
                   config=SyncLoopConfig(log_root=str(logs.resolve())), registry=registry,
                   node_names=cfg.node_names, label=cfg.agent_id,
                   log_rotation=(cfg.container_log_max_size, cfg.container_log_max_files))
        sources.on_api_reconnect.append(pods.loop.retry_writes_now)
        sources.on_mirror_created.append(pods.loop.retry_writes_now)
        pods.on_api_answered.append(sources.api_answered)
        return pods

    def api_answered(self) -> None:
        for hook in self.on_api_answered:
            hook()

    # -- what the node status and health server read (any thread) --
    def images(self) -> list[dict[str, Any]]:
        return list(self._images)  # the last good list while the runtime is down

    def readiness(self) -> str | None:
        """A reason for Ready=False: the runtime cannot be reached (its version/image
        reading, or PLEG's relists failing in a row), or PLEG is stuck."""
        return (self.runtime_problem or self.loop.pleg.runtime_problem()
                or self.loop.health())

    def health(self) -> str | None:
        return self.loop.health()

    # -- what the kubelet API reads (nodeagent.server.app.PodHost) --
    def _loops(self) -> list[SyncLoop]:
        return list(self.loop.loops.values()) if isinstance(self.loop, NodeLoops) \
            else [self.loop]

    def find_pod(self, namespace: str, name: str) -> tuple[str, dict[str, Any]] | None:
        for loop in self._loops():
            for pod in loop.pods.values():
                meta = pod.get("metadata") or {}
                if meta.get("name") == name and (meta.get("namespace") or "default") == namespace:
                    return loop.node_name, pod
        return None

    def all_pods(self) -> list[dict[str, Any]]:
        return [pod for loop in self._loops() for pod in loop.pods.values()]

    def runtime_pod(self, uid: str) -> PodRuntimeStatus:
        return self.loop.pleg.cache.get(uid).status

    def running_logs(self) -> list[tuple[str, str]]:
        """(container id, log path) of every running container, for log rotation."""
        cache = self.loop.pleg.cache
        return [(c.id, c.log_path) for uid in cache.uids() for c in cache.get(uid).status.containers
                if c.state == ContainerState.RUNNING and c.log_path]

    # -- running --
    async def refresh(self) -> None:
        """Runtime version and image list; a failure is kept as the runtime's problem."""
        try:
            v = await asyncio.wait_for(self.runtime.version(), 10.0)
            images = await asyncio.wait_for(self.runtime.list_images(), 10.0)
        except (ContainerRuntimeError, TimeoutError) as e:
            if self.runtime_problem is None:
                log.warning("container runtime: %s", e)
            self.runtime_problem = f"container runtime is down: {e}"
            return
        if self.runtime_problem is not None:
            log.info("container runtime is back")
        self.runtime_problem = None
        self.runtime_version = f"{v.runtime_name}://{v.runtime_version}"
        self._images = [{"names": list(i.names), "sizeBytes": i.size_bytes}
                        for i in images if i.names]

    async def start(self) -> None:
        """First runtime reading (before the node reports), then the loops."""
        await self.refresh()
        log.info("pods: runtime %s%s", self.runtime_version or type(self.runtime).__name__,
                 f" ({self.runtime_problem})" if self.runtime_problem else "")
        self._tasks = [self.loop.start(),
                       asyncio.create_task(self._refresh_loop(), name="runtime-refresh")]
        if self.run_sources is not None:
            self._tasks.append(asyncio.create_task(self.run_sources(), name="pod-sources"))
        if self.log_rotation is not None:
            self._tasks.append(asyncio.create_task(self.log_rotation.run(), name="log-rotation"))

    async def _refresh_loop(self) -> None:
        while True:
            # while the runtime is down, look again soon: Ready comes back within a
            # second of the runtime, not one image period later
            down = self.runtime_problem is not None or self.loop.pleg.runtime_problem()
            await self.clock.sleep(min(DOWN_RETRY, self.image_refresh) if down
                                   else self.image_refresh)
            await self.refresh()

    async def wait(self) -> None:
        """Until one of the loops ends (which is a failure: they run until stopped)."""
        await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)

    async def stop(self) -> None:
        """Stop the loops; pods keep running in the runtime for the next agent to adopt."""
        for t in self._tasks[1:]:
            t.cancel()
        await asyncio.gather(*self._tasks[1:], return_exceptions=True)
        await self.loop.stop()
        with contextlib.suppress(ContainerRuntimeError):
            await self.runtime.close()
        self._tasks = []
