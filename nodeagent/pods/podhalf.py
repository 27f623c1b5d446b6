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
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from nodeagent.api.clock import Clock
from nodeagent.pods.loops import NodeLoops
from nodeagent.runtime import ContainerRuntimeError, ContainerState, PodRuntimeStatus, Runtime
from nodeagent.runtime.logrotation import LogRotation

log = logging.getLogger(__name__)


class Part(Protocol):
    """A pod source (or the mirror pod manager): runs until cancelled."""

    async def run(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class PodsConfig:
    image_refresh: float = 10.0  # seconds; the default NodeStatus update period
    down_retry: float = 1.0      # seconds between runtime readings while it is down
    log_rotation: tuple[int, int] | None = None  # (max size, max files) of container
    # logs; None: not rotated


class Pods:
    def __init__(self, runtime: Runtime, clock: Clock, loops: NodeLoops,
                 sources: Sequence[Part] = (), config: PodsConfig = PodsConfig()) -> None:
        self.runtime = runtime
        self.clock = clock
        self.loops = loops
        self.sources = tuple(sources)
        self.config = config
        self.runtime_version = ""   # "<name>://<version>", as nodeInfo shows it
        self.runtime_problem: str | None = None
        self._images: list[dict[str, Any]] = []
        self._tasks: list[asyncio.Task[Any]] = []
        rotation = config.log_rotation
        self.log_rotation = None if rotation is None else LogRotation(
            runtime, self.running_logs, clock, max_size=rotation[0], max_files=rotation[1])

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

    def runtime_pod(self, uid: str) -> PodRuntimeStatus:
        return self.loops.pleg.cache.get(uid).status

    def running_logs(self) -> Iterator[tuple[str, str]]:
        """(container id, log path) of every running container, for log rotation: read
        as it goes (the rotation lets the event loop run between them)."""
        cache = self.loops.pleg.cache
        for uid in cache.uids():  # a copy
            for c in cache.get(uid).status.containers:  # a pod gone meanwhile: none
                if c.state == ContainerState.RUNNING and c.log_path:
                    yield c.id, c.log_path

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
        self._tasks = [self.loops.start(),
                       asyncio.create_task(self._refresh_loop(), name="runtime-refresh"),
                       *(asyncio.create_task(p.run(), name=type(p).__name__)
                         for p in self.sources)]
        if self.log_rotation is not None:
            self._tasks.append(asyncio.create_task(self.log_rotation.run(), name="log-rotation"))

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
        with contextlib.suppress(ContainerRuntimeError):
            await self.runtime.close()
        self._tasks = []
