"""What the node adds to every pod it runs, the same for every part of the pod half."""

from __future__ import annotations

from dataclasses import dataclass, field

from nodeagent.pods.admission import AdmissionSettings
from nodeagent.pods.dns import DnsSettings


@dataclass(frozen=True)
class NodePodSettings:
    """The node's name and address as its pods see them, admission, names and resolver,
    and where the files the agent writes for pods go."""
    node_name: str = ""
    host_ip: str = ""        # the node's InternalIP: status.hostIP, host-network pods' IP
    dns: DnsSettings = field(default_factory=DnsSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    log_root: str = ""      # container logs, for runtimes that write files
    pods_dir: str = ""      # <root-dir>/pods: each pod's managed /etc/hosts ("": none)
    seccomp_root: str = ""  # <root-dir>/seccomp: where Localhost seccomp profiles are
    memory_capacity: int = 0  # the node's memory in bytes: Burstable OOM score adjustments
    # False (virtual nodes and the fake runtime, whose containers run nothing): no
    # resolver configuration, volumes planned but not made (nothing could read them; no
    # ConfigMap, Secret or token read), no container lifecycle Events (`Pulled` for an
    # image already there, `Created`, `Started`: they would only load the API server)
    runs_workloads: bool = True

    def pod_ip(self, host_network: bool, sandbox_ip: str) -> str:
        return self.host_ip if host_network else sandbox_ip


@dataclass(frozen=True)
class PodTiming:
    """How often the pod half acts, the same for every node."""
    sync_frequency: float = 60.0      # periodic resync of each pod
    resync_jitter: float = 0.5        # ... up to this fraction later (PodWorkers)
    call_timeout: float = 60.0        # any runtime call but the PLEG's
    crash_backoff_initial: float = 10.0
    crash_backoff_max: float = 300.0
    crash_backoff_reset: float = 600.0
    error_initial: float = 1.0        # a failed sync is retried after this, doubling
    error_max: float = 60.0           # ... up to this
    drain_timeout: float = 15.0       # on stop, how long runtime calls may still run
