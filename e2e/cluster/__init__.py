"""A real local control plane for e2e tests and the main job: `python -m e2e.cluster`."""

from e2e.cluster.cluster import Cluster, LocalCluster

__all__ = ["Cluster", "LocalCluster"]
