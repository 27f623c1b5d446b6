"""The node agent's heartbeat metrics. No per-node labels: one process may speak for
thousands of nodes."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from nodeagent.metrics import per_registry


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.lease_renewals = Counter(
            "nodepulse_lease_renewals", "Lease renewal attempts by result "
            "(success, created, conflict, retried, failed)", ["result"], registry=registry)
        # each result's child, looked up once for every node of the process
        self.renewals_by_result = {r: self.lease_renewals.labels(r) for r in
                                   ("success", "created", "conflict", "retried", "failed")}
        self.lease_latency = Histogram(
            "nodepulse_lease_renewal_duration_seconds",
            "Time from a renewal's due time to its success, retries included",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40),
            registry=registry)
        self.status_reports = Counter(
            "nodepulse_node_status_reports", "NodeStatus patches sent, by reason "
            "(register, change, period, legacy)", ["reason"], registry=registry)
        self.status_patch_bytes = Histogram(
            "nodepulse_node_status_patch_bytes", "Request body size of NodeStatus patches",
            buckets=(256, 512, 1024, 2048, 4096, 8192, 16384, 65536), registry=registry)
        self.status_errors = Counter(
            "nodepulse_node_status_errors", "NodeStatus patches that failed",
            registry=registry)
        self.policy_updates = Counter(
            "nodepulse_heartbeat_policy_updates", "Heartbeat settings from the Node "
            "annotation, by result (applied, refused, cleared)", ["result"], registry=registry)
        self.nodes = Gauge("nodepulse_nodes", "Nodes this process speaks for",
                           registry=registry)


# the one NodeMetrics of a registry: every node of a process counts into it
node_metrics = per_registry(NodeMetrics)
