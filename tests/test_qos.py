"""A pod's QoS class, its summed requests and limits, and its containers' OOM score
adjustments, each against the kubelet's rule worked out by hand."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.pods.qos import (
    QOSClass,
    hugepage_size,
    oom_score_adj,
    pod_limits,
    pod_requests,
    qos_class,
)
from tests.conftest import GI, mkpod

MI = 2**20


def c(name: str, requests: dict[str, str] | None = None,
      limits: dict[str, str] | None = None, **more: Any) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if requests:
        res["requests"] = requests
    if limits:
        res["limits"] = limits
    return {"name": name, "image": "i", "resources": res, **more}


def both(cpu: str, memory: str) -> dict[str, str]:
    return {"cpu": cpu, "memory": memory}


@pytest.mark.parametrize("containers, init, expected", [
    ([c("a")], [], QOSClass.BEST_EFFORT),
    ([c("a", requests={"cpu": "100m"})], [], QOSClass.BURSTABLE),
    # a limit alone: the request defaults to it
    ([c("a", limits=both("1", "1Gi"))], [], QOSClass.GUARANTEED),
    ([c("a", both("500m", "1Gi"), both("1", "1Gi"))], [], QOSClass.BURSTABLE),
    # every container must limit both
    ([c("a", limits=both("1", "1Gi")), c("b", limits={"cpu": "1"})], [], QOSClass.BURSTABLE),
    ([c("a", limits=both("1", "1Gi"))], [c("i")], QOSClass.BURSTABLE),
    ([c("a", limits=both("1", "1Gi"))], [c("i", limits=both("2", "2Gi"))],
     QOSClass.GUARANTEED),
    # zero and other resources do not count
    ([c("a", requests={"cpu": "0", "ephemeral-storage": "1Gi"})], [], QOSClass.BEST_EFFORT),
])
def test_qos_class(containers: list[dict[str, Any]], init: list[dict[str, Any]],
                   expected: QOSClass) -> None:
    pod = mkpod(containers=containers, initContainers=init, phase=None)
    assert qos_class(pod) == expected


def test_qos_class_of_the_status_wins() -> None:
    pod = mkpod(containers=[c("a")])
    pod["status"]["qosClass"] = "Burstable"
    assert qos_class(pod) == QOSClass.BURSTABLE


def test_requests_take_the_larger_of_the_containers_and_each_init_container() -> None:
    pod = mkpod(containers=[c("a", limits=both("100m", "64Mi"))],
                initContainers=[c("i", limits=both("1", "1Gi"))])
    assert pod_requests(pod) == {"cpu": 1000, "memory": GI}
    assert pod_limits(pod) == {"cpu": 1000, "memory": GI}


def test_sidecars_add_up_and_run_beside_later_init_containers() -> None:
    pod = mkpod(containers=[c("a", limits=both("300m", "128Mi"))],
                initContainers=[c("side", limits=both("200m", "32Mi"), restartPolicy="Always"),
                                c("job", limits=both("500m", "64Mi"))])
    # regular + sidecar: 500m, 160Mi; the job beside the sidecar: 700m, 96Mi
    assert pod_requests(pod) == {"cpu": 700, "memory": 160 * MI}


def test_overhead_is_added_to_requests_and_to_the_limits_that_are_set() -> None:
    pod = mkpod(containers=[c("a", {"cpu": "100m", "memory": "64Mi"}, {"cpu": "200m"})],
                overhead={"cpu": "50m", "memory": "16Mi"})
    assert pod_requests(pod) == {"cpu": 150, "memory": 80 * MI}
    assert pod_limits(pod) == {"cpu": 250}


NODE_MEMORY = 8 * GI


@pytest.mark.parametrize("request_memory, expected", [
    ("2Gi", 750),      # 1000 - 1000 * 2Gi / 8Gi
    (None, 999),       # 1000 would rank it with BestEffort
    ("1", 999),
    ("8Gi", 3),        # 0 would rank it with Guaranteed
    ("8190Mi", 3),     # 1000 - 999
    ("7999Mi", 24),
    ("100Mi", 988),    # 1000 - 100000 / 8192, rounded down
])
def test_burstable_oom_score_adj(request_memory: str | None, expected: int) -> None:
    requests = {"cpu": "100m", **({"memory": request_memory} if request_memory else {})}
    pod = mkpod(containers=[c("a", requests)])
    assert oom_score_adj(pod, pod["spec"]["containers"][0], NODE_MEMORY) == expected


def test_guaranteed_and_best_effort_oom_score_adj() -> None:
    g = mkpod(containers=[c("a", limits=both("1", "1Gi"))])
    b = mkpod(containers=[c("a")])
    assert oom_score_adj(g, g["spec"]["containers"][0], NODE_MEMORY) == -997
    assert oom_score_adj(b, b["spec"]["containers"][0], NODE_MEMORY) == 1000


@pytest.mark.parametrize("annotations, priority, critical", [
    ({"kubernetes.io/config.source": "file"}, None, True),   # static
    ({"kubernetes.io/config.mirror": "x"}, None, True),      # mirror
    ({}, 2_000_001_000, True),                               # system priority
    ({"kubernetes.io/config.source": "api"}, 1000, False),
])
def test_node_critical_pods_get_the_guaranteed_adjustment(
        annotations: dict[str, str], priority: int | None, critical: bool) -> None:
    pod = mkpod(containers=[c("a")], priorityClassName="system-node-critical")
    pod["metadata"]["annotations"] = annotations
    if priority is not None:
        pod["spec"]["priority"] = priority
    assert oom_score_adj(pod, pod["spec"]["containers"][0], NODE_MEMORY) == \
        (-997 if critical else 1000)


def test_a_sidecar_ranks_no_higher_than_the_smallest_regular_container() -> None:
    side = c("side", {"cpu": "100m"}, restartPolicy="Always")
    pod = mkpod(containers=[c("a", {"memory": "2Gi"}), c("b", {"memory": "4Gi"})],
                initContainers=[side])
    assert oom_score_adj(pod, side, NODE_MEMORY) == 750  # a's, not its own 999


def test_hugepage_sizes() -> None:
    assert hugepage_size("hugepages-2Mi") == 2 * MI
    assert hugepage_size("hugepages-1Gi") == GI
    assert hugepage_size("memory") is None
