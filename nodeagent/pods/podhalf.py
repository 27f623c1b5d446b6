"""The pod half of the agent, for every node of the process: the pod sources, the sync
loops (nodeagent.pods.loops) and the runtime they drive. Built by the agent's composition
root (nodeagent.agent), which also hands the node status what is read here: the
runtime's version, its image list, and readiness.

The runtime's image list is cached here and refreshed on its own period, because the
node status is computed in a worker thread and the runtime's calls are coroutines of
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from nodeagent.api.clock import Clock
from nodeagent.pods.loops import NodeLoops
from nodeagent.pods.pleg import PodCache
from nodeagent.pods.podstatus import Ending
from nodeagent.pods.podupdate import pod_node_name
from nodeagent.runtime import (
    ContainerRuntimeError,
    ContainerState,
    ImageInfo,
    PodRuntimeStatus,
    Runtime,
)

log = logging.getLogger(__name__)


class Runnable(Protocol):
    """A part that works until cancelled: a pod source, the mirror pod manager, log
    rotation."""

    async def run(self) -> None: ...


class Closable(Protocol):
    """A part every node's loop shares, closed once they have all stopped: the image
    pulls, the ConfigMap/Secret and Service watches."""

    async def close(self) -> None: ...


def running_logs(cache: PodCache) -> Iterator[tuple[str, str]]:
    """(container id, log path) of every running container the PLEG's cache holds, for
    log rotation: read as it goes (the rotation lets the event loop run between them)."""
    for uid in cache.uids():  # a copy
        for c in cache.get(uid).status.containers:  # a pod gone meanwhile: none
            if c.state == ContainerState.RUNNING and c.log_path:
                yield c.id, c.log_path


def runtime_not_ready(conditions: dict[str, tuple[bool, str]]) -> str | None:
    """Why the node is not ready by the runtime's conditions, in the kubelet's words."""
    if not conditions.get("RuntimeReady", (True, ""))[0]:
        return (f"container runtime status check may not have completed yet: "
                f"RuntimeReady=false {conditions['RuntimeReady'][1]}").strip()
    if not conditions.get("NetworkReady", (True, ""))[0]:
        return (f"container runtime network not ready: NetworkReady=false "
                f"{conditions['NetworkReady'][1]}").strip()
    return None


@dataclasses.dataclass(frozen=True)
class PodsConfig:
    image_refresh: float = 10.0  # seconds; the default NodeStatus update period
    down_retry: float = 1.0      # seconds between runtime readings while it is down


class Pods:
    def __init__(self, runtime: Runtime, clock: Clock, loops: NodeLoops,
                 sources: Sequence[Runnable] = (), background: Sequence[Runnable] = (),
                 shared: Sequence[Closable] = (), config: PodsConfig = PodsConfig(),
                 on_images: Callable[[list[ImageInfo]], None] | None = None) -> None:
        """`sources`: the pod sources and the mirror pod manager; `background`: other
        parts that run beside the loops (log rotation, the Service watch, eviction,
        garbage collection); `shared`: what the loops share, closed after them;
        `on_images`: told each image list read (the image collector)."""
        self.runtime = runtime
        self.clock = clock
        self.loops = loops
        self.sources = tuple(sources)
        self.background = tuple(background)
        self.shared = tuple(shared)
        self.config = config
        self.on_images = on_images
        self.runtime_version = ""   # "<name>://<version>", as nodeInfo shows it
        self.runtime_problem: str | None = None
        self._images: list[dict[str, Any]] = []
        self._tasks: list[asyncio.Task[Any]] = []

    # -- what the node status and health server read (any thread) --
    def images(self) -> list[dict[str, Any]]:
        return list(self._images)  # the last good list while the runtime is down

    def readiness(self) -> str | None:
        """A reason for Ready=False: the runtime cannot be reached (its version/image
        reading, or PLEG's relists failing in a row), or PLEG is stuck."""
        return (self.runtime_problem or self.loops.pleg.runtime_problem()
                or self.loops.health())

    def health(self) -> str | None:
        return self.loops.health()

    # -- what the kubelet API reads (nodeagent.server.podhost.PodHost) --
    def find_pod(self, namespace: str, name: str) -> tuple[str, dict[str, Any]] | None:
        for loop in self.loops.loops.values():
            for pod in loop.pods.values():
                meta = pod.get("metadata") or {}
                if meta.get("name") == name and (meta.get("namespace") or "default") == namespace:
                    return loop.node_name, pod
        return None

    def all_pods(self) -> list[dict[str, Any]]:
        return [pod for loop in self.loops.loops.values() for pod in loop.pods.values()]

    def node_pods(self, node: str) -> list[dict[str, Any]]:
        loop = self.loops.loops.get(node)
        return list(loop.pods.values()) if loop is not None else []

    def runtime_pod(self, uid: str) -> PodRuntimeStatus:
        return self.loops.pleg.cache.get(uid).status

    # -- what graceful node shutdown uses (nodeagent.shutdown) --
    def active_pods(self) -> list[dict[str, Any]]:
        """Every node's pods that have not ended."""
        return [pod for loop in self.loops.loops.values() for pod in loop.active()]

    async def end_pod(self, pod: dict[str, Any], grace: float, reason: str,
                      message: str) -> None:
        """Stop a pod as the node's own decision, within `grace` seconds (or its own
        shorter grace period): its final status is Failed with this reason and message
        and a DisruptionTarget condition (podstatus.Ending); returns once it is written."""
        loop = self.loops.loops[pod_node_name(pod)]
        await loop.end(pod, grace, Ending(reason, message, disruption=message))

    # -- running --
    async def refresh(self) -> None:
        """Runtime version, conditions and image list; a failure, or a condition the
        runtime reports false, is kept as the runtime's problem (the kubelet's node is
        NotReady while its runtime, or the runtime's network, is not ready)."""
        try:
            v = await asyncio.wait_for(self.runtime.version(), 10.0)
            conditions = await asyncio.wait_for(self.runtime.conditions(), 10.0)
            images = await asyncio.wait_for(self.runtime.list_images(), 10.0)
        except (ContainerRuntimeError, TimeoutError) as e:
            if self.runtime_problem is None:
                log.warning("container runtime: %s", e)
            self.runtime_problem = f"container runtime is down: {e}"
            return
        problem = runtime_not_ready(conditions)
        if problem != self.runtime_problem:
            if problem:
                log.warning("%s", problem)
            else:
                log.info("container runtime is ready")
        self.runtime_problem = problem
        self.runtime_version = f"{v.runtime_name}://{v.runtime_version}"
        self._images = [{"names": list(i.names), "sizeBytes": i.size_bytes}
                        for i in images if i.names]
        if self.on_images is not None:
            self.on_images(images)

    async def start(self) -> None:
        """First runtime reading (before the node reports), then the loops."""
        await self.refresh()
        log.info("pods: runtime %s%s", self.runtime_version or type(self.runtime).__name__,
                 f" ({self.runtime_problem})" if self.runtime_problem else "")
        self._tasks = [self.loops.start(),
                       asyncio.create_task(self._refresh_loop(), name="runtime-refresh"),
                       *(asyncio.create_task(p.run(), name=type(p).__name__)
                         for p in (*self.sources, *self.background))]

    async def _refresh_loop(self) -> None:
        while True:
            # while the runtime is down, look again soon: Ready comes back within a
            # second of the runtime, not one image period later
            down = self.runtime_problem is not None or self.loops.pleg.runtime_problem()
            every = self.config.image_refresh
            await self.clock.sleep(min(self.config.down_retry, every) if down else every)
            await self.refresh()

    async def wait(self) -> None:
        """Until one of the loops ends (which is a failure: they run until stopped)."""
        await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)

    async def stop(self) -> None:
        """Stop the loops; pods keep running in the runtime for the next agent to adopt."""
        for t in self._tasks[1:]:
            t.cancel()
        await asyncio.gather(*self._tasks[1:], return_exceptions=True)
        await self.loops.stop()
        for part in self.shared:
            await part.close()
        with contextlib.suppress(ContainerRuntimeError):
            await self.runtime.close()
        self._tasks = []
