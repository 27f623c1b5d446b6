"""What the kubelet API reads of the pods bound to this process's nodes: the pod half
(nodeagent.pods.podhalf.Pods) gives it, the server reads through it."""

from __future__ import annotations

from typing import Any, Protocol

from nodeagent.runtime.base import PodRuntimeStatus, Runtime

Pod = dict[str, Any]


class PodHost(Protocol):
    """What the server reads of the pods bound here (nodeagent.pods.podhalf.Pods)."""

    @property
    def runtime(self) -> Runtime: ...

    def find_pod(self, namespace: str, name: str) -> tuple[str, Pod] | None:
        """(node, pod) of a pod bound to one of this process's nodes."""

    def all_pods(self) -> list[Pod]: ...

    def node_pods(self, node: str) -> list[Pod]:
        """The pods bound to one of this process's nodes."""

    def runtime_pod(self, uid: str) -> PodRuntimeStatus:
        """The pod's containers and sandboxes as the last relist saw them."""
