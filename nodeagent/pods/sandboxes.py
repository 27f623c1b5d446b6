"""A pod's sandbox, made as the kubelet makes it: its names (hostname cut to 63
characters, or the FQDN with setHostnameAsFQDN), its resolver, the handler of its
RuntimeClass, its cgroup parent (the pod's cgroup, cgroups.py), and what is left of an
earlier sandbox stopped first."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from nodeagent.api.client import brief
from nodeagent.api.kube import RUNTIME_CLASSES, Kube
from nodeagent.events import WARNING, Events
from nodeagent.pods.cgroups import PodCgroups
from nodeagent.pods.decide import grace_of
from nodeagent.pods.dns import hostname_and_domain, kernel_hostname, pod_dns
from nodeagent.pods.podupdate import Pod
from nodeagent.pods.runtimecalls import RuntimeCalls
from nodeagent.pods.settings import NodePodSettings
from nodeagent.runtime.base import Container, Sandbox, SandboxConfig, SandboxState

log = logging.getLogger(__name__)


class NoRuntimeClass(Exception):
    """The pod's RuntimeClass cannot be read."""


class Sandboxes:
    def __init__(self, calls: RuntimeCalls, kube: Kube, events: Events | None,
                 settings: NodePodSettings, cgroups: PodCgroups) -> None:
        """`kube`: where the pods' RuntimeClasses are read; `cgroups`: the pods' cgroups
        (the syncer makes a pod's before its sandbox)."""
        self.calls = calls
        self.kube = kube
        self.events = events
        self.settings = settings
        self.cgroups = cgroups

    def config(self, pod: Pod, attempt: int) -> SandboxConfig:
        """The sandbox's config with the names the node gives it. Raises PodDnsError."""
        sc = SandboxConfig.from_pod(pod, attempt=attempt, log_root=self.settings.log_root)
        sc.cgroup_parent = self.cgroups.parent(pod)
        if not sc.host_network:
            host, domain = hostname_and_domain(pod, self.settings.dns.cluster_domain)
            sc.hostname = kernel_hostname(pod, host, domain)
        return sc

    async def _handler(self, pod: Pod) -> str:
        """The handler of the pod's RuntimeClass ("" without one)."""
        name = (pod.get("spec") or {}).get("runtimeClassName")
        if not name:
            return ""
        try:
            rc = await self.kube.get(RUNTIME_CLASSES, str(name), timeout=10.0)
        except Exception as e:
            raise NoRuntimeClass(f"RuntimeClass {name!r} (spec.runtimeClassName): "
                                 f"{brief(e)}") from e
        return str(rc.get("handler") or "")

    async def make(self, pod: Pod, attempt: int, stop_first: Sequence[Container]) -> Sandbox:
        """Stop `stop_first` (what runs of an earlier sandbox), then make the sandbox.
        Raises ContainerRuntimeError, PodDnsError or NoRuntimeClass."""
        rt = self.calls.runtime
        for c in stop_first:
            await self.calls(rt.stop_container(c.id, grace_of(pod)), "stop_container",
                             grace_of(pod))
        sc = self.config(pod, attempt)
        if self.settings.runs_workloads:
            names = pod_dns(pod, self.settings.dns)
            for reason, message in names.warnings:
                if self.events is not None:
                    self.events.pod(pod, WARNING, reason, message)
            sc.dns = names.config
        sc.runtime_handler = await self._handler(pod)
        sid = await self.calls(rt.run_sandbox(sc), "run_sandbox")
        # the new sandbox's ip comes from the runtime; read it back once
        fresh = await self.calls(rt.pod_status(sc.uid), "pod_status")
        for s in fresh.sandboxes:
            if s.id == sid:
                return s
        return Sandbox(id=sid, pod_uid=sc.uid, name=sc.name, namespace=sc.namespace,
                       attempt=attempt, state=SandboxState.READY,
                       host_network=sc.host_network)
