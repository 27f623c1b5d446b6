"""A real local control plane for e2e tests and the main job: `python -m nodepulse_dev`."""

from nodepulse_dev.cluster import Cluster, LocalCluster

__all__ = ["Cluster", "LocalCluster"]
