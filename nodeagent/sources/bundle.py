"""All pod sources of one agent, wired to one merge: what the agent's main builds.

    sources = PodSources(kube, SourcesConfig(node_names=[node], pod_manifest_path=...),
                         clock, events=NodeEvents(kube, node, clock, node_uid=...))
    loop = SyncLoop(..., updates=sources.updates, sources_ready=sources.ready, ...)
    await asyncio.gather(sources.run(), loop.run(), ...)

Static pods (folder, URL) need exactly one node name: they are named and bound per
node. The API source serves one or many names (virtual-node mode).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import Clock
from nodeagent.api.kube import Kube
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
    def __init__(self, kube: Kube | None, cfg: SourcesConfig, clock: Clock, *,
                 answered: ApiAnswered, node_uid: Callable[[], str | None],
                 events: EventSink | None = None) -> None:
        if not cfg.node_names:
            raise ValueError("pod sources need at least one node name")
        static = bool(cfg.pod_manifest_path or cfg.manifest_url)
        if static and len(cfg.node_names) != 1:
            raise ValueError("--pod-manifest-path and --manifest-url need exactly one node "
                             f"name, not {len(cfg.node_names)}")
        if cfg.watch_api and kube is None:
            raise ValueError("the API source needs an API client")
        configured = {s for s, on in ((Source.API, cfg.watch_api),
                                      (Source.FILE, bool(cfg.pod_manifest_path)),
                                      (Source.HTTP, bool(cfg.manifest_url))) if on}
        self.merge = Merge(configured, Problems(events))
        self.parts: list[APISource | FileSource | HTTPSource | MirrorManager] = []
        node = cfg.node_names[0]
        if cfg.watch_api and kube is not None:
            self.parts.append(APISource(kube, cfg.node_names, self.merge, clock,
                                        answered=answered))
        if cfg.pod_manifest_path:
            self.parts.append(FileSource(cfg.pod_manifest_path, node, self.merge, clock,
                                         check_frequency=cfg.file_check_frequency,
                                         allow_privileged=cfg.allow_privileged))
        if cfg.manifest_url:
            self.parts.append(HTTPSource(cfg.manifest_url, node, self.merge, clock,
                                         headers=cfg.manifest_url_headers,
                                         check_frequency=cfg.http_check_frequency,
                                         allow_privileged=cfg.allow_privileged))
        if static and cfg.watch_api and kube is not None:
            self.parts.append(MirrorManager(kube, node, self.merge, clock, node_uid=node_uid,
                                            answered=answered))

    @property
    def updates(self) -> asyncio.Queue[PodUpdate]:
        return self.merge.updates

    @property
    def ready(self) -> SourcesReady:
        return self.merge.ready

    async def run(self) -> None:
        """Run every source (and the mirror manager) until cancelled."""
        tasks = [asyncio.create_task(p.run(), name=type(p).__name__) for p in self.parts]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
