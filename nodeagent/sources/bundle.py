"""All pod sources of one agent, wired to one merge: what the agent's main builds.

    sources = PodSources(api, SourcesConfig(node_names=[node], pod_manifest_path=...),
                         clock, events=NodeEvents(api, node, clock))
    loop = SyncLoop(..., updates=sources.updates, sources_ready=sources.ready, ...)
    await asyncio.gather(sources.run(), loop.run(), ...)

Static pods (folder, URL) need exactly one node name: they are named and bound per
node. The API source serves one or many names (virtual-node mode).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from kubernetes import client

from nodeagent.api.clock import Clock
from nodeagent.sources.api import APISource
from nodeagent.sources.file import FileSource
from nodeagent.sources.http import HTTPSource
from nodeagent.sources.merge import Merge
from nodeagent.sources.mirror import MirrorManager
from nodeagent.sources.problems import EventSink, Problems
from nodeagent.sources.types import PodUpdate, Source, SourcesReady


@dataclasses.dataclass(frozen=True)
class SourcesConfig:
    node_names: tuple[str, ...]
    pod_manifest_path: str | None = None      # --pod-manifest-path (staticPodPath)
    file_check_frequency: float = 20.0        # --file-check-frequency
    manifest_url: str | None = None           # --manifest-url (staticPodURL)
    manifest_url_headers: dict[str, str] = dataclasses.field(default_factory=dict)
    http_check_frequency: float = 20.0        # --http-check-frequency
    watch_api: bool = True                    # False: static pods only (standalone)
    allow_privileged: bool = False            # --allow-privileged (allowPrivileged):
    # static pods with hostNetwork/hostPID/hostIPC or a privileged container


class PodSources:
    def __init__(self, api: client.ApiClient | None, cfg: SourcesConfig, clock: Clock, *,
                 events: EventSink | None = None) -> None:
        if not cfg.node_names:
            raise ValueError("pod sources need at least one node name")
        static = bool(cfg.pod_manifest_path or cfg.manifest_url)
        if static and len(cfg.node_names) != 1:
            raise ValueError("--pod-manifest-path and --manifest-url need exactly one node "
                             f"name, not {len(cfg.node_names)}")
        if cfg.watch_api and api is None:
            raise ValueError("the API source needs an API client")
        configured = {s for s, on in ((Source.API, cfg.watch_api),
                                      (Source.FILE, bool(cfg.pod_manifest_path)),
                                      (Source.HTTP, bool(cfg.manifest_url))) if on}
        self.merge = Merge(configured, Problems(events))
        self.parts: list[APISource | FileSource | HTTPSource | MirrorManager] = []
        # called when the API server answers again after an outage: the API source's
        # own hook list (the same list object), so hooks added later reach it too
        self.on_api_reconnect: list[Callable[[], None]] = []
        self.on_mirror_created: list[Callable[[], None]] = []  # the same list, likewise
        node = cfg.node_names[0]
        if cfg.watch_api and api is not None:
            source = APISource(api, cfg.node_names, self.merge, clock)
            source.on_reconnect = self.on_api_reconnect
            self.parts.append(source)
        if cfg.pod_manifest_path:
            self.parts.append(FileSource(cfg.pod_manifest_path, node, self.merge, clock,
                                         check_frequency=cfg.file_check_frequency,
                                         allow_privileged=cfg.allow_privileged))
        if cfg.manifest_url:
            self.parts.append(HTTPSource(cfg.manifest_url, node, self.merge, clock,
                                         headers=cfg.manifest_url_headers,
                                         check_frequency=cfg.http_check_frequency,
                                         allow_privileged=cfg.allow_privileged))
        if static and cfg.watch_api and api is not None:
            mirrors = MirrorManager(api, node, self.merge, clock)
            self.on_api_reconnect.append(mirrors.resync_now)
            mirrors.on_created = self.on_mirror_created
            self.parts.append(mirrors)

    @property
    def updates(self) -> asyncio.Queue[PodUpdate]:
        return self.merge.updates

    @property
    def ready(self) -> SourcesReady:
        return self.merge.ready

    def api_answered(self) -> None:
        """The node's other requests reach the API server again: the API source's
        backoff ends now."""
        for p in self.parts:
            if isinstance(p, APISource):
                p.api_answered()

    async def run(self) -> None:
        """Run every source (and the mirror manager) until cancelled."""
        tasks = [asyncio.create_task(p.run(), name=type(p).__name__) for p in self.parts]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
