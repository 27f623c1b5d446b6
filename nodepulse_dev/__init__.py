"""nodepulse-dev: a local Kubernetes cluster of nodepulse nodes (docs/dev-cluster.md).
The control plane built from source (build.py, cluster.py, pki.py), a private containerd
and its images (containerd.py, images.py), an image registry for tests (registry.py),
and the whole system of `make run` (devcluster.py, __main__.py). Neither program
imports it."""

from nodepulse_dev.cluster import Cluster, LocalCluster

__all__ = ["Cluster", "LocalCluster"]
