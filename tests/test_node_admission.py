"""Node admission as the kubelet's: what a pod asks of its node (nodeagent.pods.resources),
the general predicates and preemption's choice (table by table, no runtime), then one
node's admission through the sync loops (tests/conftest.py LoopRig): who is admitted,
in which order, what is released when a pod ends, what a restarted agent takes back,
and what a critical pod preempts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import NODES, PODS
from nodeagent.api.quantity import parse_quantity
from nodeagent.pods.admission import (
    AdmissionSettings,
    Held,
    Insufficient,
    NodeAdmission,
    PreemptionError,
    Rejection,
    Unmatched,
    general_predicates,
    hold,
    pods_to_preempt,
)
from nodeagent.pods.podupdate import ANN_CONFIG_SOURCE, Op
from nodeagent.pods.resources import is_critical, pod_requests, preemptable, qos_class
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import AgentRig, LoopRig, aio, mkpod, started

GI = 2**30


def box(name: str = "c", requests: Mapping[str, str] | None = None,
        limits: Mapping[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    """A container with these requests and limits."""
    res: dict[str, Any] = {}
    if requests is not None:
        res["requests"] = dict(requests)
    if limits is not None:
        res["limits"] = dict(limits)
    return {"name": name, "image": "localhost/busybox:1", "resources": res, **kw}


def asks(name: str = "p", uid: str | None = None, *, cpu: str | None = None,
         memory: str | None = None, created: str = "", **spec: Any) -> dict[str, Any]:
    """A pod of one container requesting `cpu` and `memory`; `created`: its
    creationTimestamp."""
    req = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    pod = mkpod(name, uid, containers=[box(requests=req)], **spec)
    if created:
        pod["metadata"]["creationTimestamp"] = created
    return pod


def node(allocatable: Mapping[str, str] | None = None, *,
         labels: Mapping[str, str] | None = None,
         taints: Sequence[Mapping[str, str]] = (), name: str = "n1") -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"taints": list(taints)},
            "status": {"allocatable": dict(allocatable or {
                "cpu": "4", "memory": "8Gi", "ephemeral-storage": "100Gi", "pods": "110"})}}


def static(pod: dict[str, Any]) -> dict[str, Any]:
    pod["metadata"].setdefault("annotations", {})[ANN_CONFIG_SOURCE] = "file"
    return pod


# --- what a pod asks ---------------------------------------------------------------------

@pytest.mark.parametrize("spec,want", [
    # regular containers add up; cpu in millicores, the rest rounded up to whole units
    ({"containers": [box("a", {"cpu": "250m", "memory": "1Gi"}),
                     box("b", {"cpu": "1", "memory": "0.5"})]},
     {"cpu": 1250, "memory": GI + 1}),
    # a limit stands in for a request that is not set (the API server's defaulting)
    ({"containers": [box("a", {"cpu": "100m"}, {"cpu": "2", "memory": "1Gi"})]},
     {"cpu": 100, "memory": GI}),
    # an init container runs alone: the most of it and the regular containers' sum
    ({"initContainers": [box("i", {"cpu": "3"})],
      "containers": [box("a", {"cpu": "1", "memory": "1Gi"})]},
     {"cpu": 3000, "memory": GI}),
    # a sidecar runs beside what comes after it; an init container after it runs beside it
    ({"initContainers": [box("s", {"cpu": "1"}, restartPolicy="Always"),
                         box("i", {"cpu": "2500m"})],
      "containers": [box("a", {"cpu": "1"})]},
     {"cpu": 3500}),
    ({"initContainers": [box("i", {"cpu": "2500m"}),
                         box("s", {"cpu": "1"}, restartPolicy="Always")],
      "containers": [box("a", {"cpu": "1"})]},
     {"cpu": 2500}),
    # spec.overhead on top; extended resources and hugepages by name
    ({"containers": [box("a", {"cpu": "1", "example.com/foo": "2", "hugepages-2Mi": "4Mi"})],
      "overhead": {"cpu": "250m", "memory": "120Mi"}},
     {"cpu": 1250, "memory": 120 * 2**20, "example.com/foo": 2, "hugepages-2Mi": 4 * 2**20}),
    # pod-level requests replace the containers' sum of cpu and memory; a pod-level limit
    # stands in only for what the containers do not request
    ({"resources": {"requests": {"cpu": "3"}, "limits": {"memory": "2Gi"}},
      "containers": [box("a", {"cpu": "1", "example.com/foo": "1"})]},
     {"cpu": 3000, "memory": 2 * GI, "example.com/foo": 1}),
    # a quantity that does not parse is not counted (its container is refused by name)
    ({"containers": [box("a", {"cpu": "lots", "memory": "1Gi"})]}, {"memory": GI}),
], ids=["sum", "limits-default", "init-max", "sidecar-then-init", "init-then-sidecar",
        "overhead-extended", "pod-level", "bad-quantity"])
def test_effective_requests(spec: dict[str, Any], want: dict[str, int]) -> None:
    pod = {"metadata": {"name": "p", "uid": "u"}, "spec": spec}
    assert pod_requests(pod) == want


@pytest.mark.parametrize("containers,status,want", [
    ([box()], {}, "BestEffort"),
    ([box(requests={"cpu": "1"})], {}, "Burstable"),
    ([box(limits={"cpu": "1", "memory": "1Gi"})], {}, "Guaranteed"),
    ([box(requests={"cpu": "500m"}, limits={"cpu": "1", "memory": "1Gi"})], {}, "Burstable"),
    ([box("a", limits={"cpu": "1", "memory": "1Gi"}), box("b", requests={"cpu": "1"})], {},
     "Burstable"),
    ([box()], {"qosClass": "Guaranteed"}, "Guaranteed"),  # the API server's word
], ids=["none", "request", "limits", "request-below-limit", "one-unlimited", "api"])
def test_qos_class(containers: list[dict[str, Any]], status: dict[str, Any],
                   want: str) -> None:
    pod = mkpod("p", containers=containers)
    pod["status"].update(status)
    assert qos_class(pod) == want


def test_critical_pods_and_who_preempts_whom() -> None:
    plain = mkpod("a")
    low, high = mkpod("l", priority=10), mkpod("h", priority=1000)
    node_critical = mkpod("n", priority=2_000_001_000)
    by_class = mkpod("s", priorityClassName="system-cluster-critical")  # not resolved
    manifest = static(mkpod("m"))
    assert [is_critical(p) for p in (plain, low, node_critical, by_class, manifest)] == \
        [False, False, True, True, True]
    assert preemptable(node_critical, high) and preemptable(manifest, plain)
    assert preemptable(high, low) and not preemptable(low, high)
    assert not preemptable(high, plain)  # no priority to compare with
    assert not preemptable(manifest, node_critical)  # both critical, no priority order
    assert preemptable(mkpod("x", priority=2_000_001_000), by_class)


# --- the general predicates -------------------------------------------------------------

def held(*pods: dict[str, Any]) -> list[Held]:
    return [hold(p) for p in pods]


def first(pod: dict[str, Any], n: dict[str, Any] | None = None,
          others: Sequence[Held] = ()) -> Rejection | None:
    failures = general_predicates(pod, n or node(), list(others))
    return failures[0].rejection() if failures else None


@pytest.mark.parametrize("pod,others,reason,message", [
    (asks(memory="900Gi"), [], "OutOfmemory",
     f"Node didn't have enough resource: memory, requested: {900 * GI}, used: 0, "
     f"capacity: {8 * GI}"),
    (asks(cpu="500"), [], "OutOfcpu",
     "Node didn't have enough resource: cpu, requested: 500000, used: 0, capacity: 4000"),
    (asks(cpu="2"), [asks("o", cpu="2500m")], "OutOfcpu",
     "Node didn't have enough resource: cpu, requested: 2000, used: 2500, capacity: 4000"),
    (mkpod("p", containers=[box(requests={"ephemeral-storage": "200Gi"})]), [],
     "OutOfephemeral-storage",
     f"Node didn't have enough resource: ephemeral-storage, requested: {200 * GI}, used: 0, "
     f"capacity: {100 * GI}"),
    (mkpod("p", containers=[box(requests={"example.com/foo": "3"})]),
     [mkpod("o", containers=[box(requests={"example.com/foo": "2"})])], "OutOfexample.com/foo",
     "Node didn't have enough resource: example.com/foo, requested: 3, used: 2, capacity: 4"),
    (mkpod("p", containers=[box(requests={"hugepages-2Mi": "2Mi"})]), [],
     "OutOfhugepages-2Mi",
     f"Node didn't have enough resource: hugepages-2Mi, requested: {2**21}, used: 0, "
     "capacity: 0"),
], ids=["memory", "cpu", "cpu-beside-others", "ephemeral-storage", "extended", "hugepages"])
def test_resources_the_node_lacks(pod: dict[str, Any], others: list[dict[str, Any]],
                                  reason: str, message: str) -> None:
    n = node({"cpu": "4", "memory": "8Gi", "ephemeral-storage": "100Gi", "pods": "110",
              "example.com/foo": "4"})
    assert first(pod, n, held(*others)) == Rejection(reason, message)


def test_what_fits() -> None:
    n = node({"cpu": "4", "memory": "8Gi", "pods": "3", "example.com/foo": "4"})
    assert first(asks(cpu="4", memory="8Gi"), n) is None  # exactly all of it
    assert first(asks(cpu="2"), n, held(asks("o", cpu="2"))) is None
    # an extended resource the node does not advertise is someone else's to count
    assert first(mkpod("p", containers=[box(requests={"other.io/gpu": "1"})]), n) is None
    # what is not the node's to count (storage) does not count
    assert first(mkpod("p", containers=[box(requests={"storage": "1Ti"})]), n) is None
    # pods without requests count against pods only
    assert first(mkpod("p"), n, held(mkpod("a"), mkpod("b"))) is None
    assert first(mkpod("p"), n, held(mkpod("a"), mkpod("b"), mkpod("c"))) == Rejection(
        "OutOfpods", "Node didn't have enough resource: pods, requested: 1, used: 3, "
                     "capacity: 3")


def test_all_failures_come_in_the_kubelets_order() -> None:
    n = node({"cpu": "1", "memory": "1Gi", "pods": "1"},
             taints=[{"key": "k", "value": "v", "effect": "NoExecute"}])
    pod = mkpod("p", nodeSelector={"disk": "ssd"}, node="other",
                containers=[box(requests={"cpu": "2", "memory": "2Gi", "example.com/x": "1"},
                                ports=[{"containerPort": 80, "hostPort": 8080}])])
    other = mkpod("o", containers=[box(ports=[{"containerPort": 80, "hostPort": 8080}])])
    n["status"]["allocatable"]["example.com/x"] = "0"
    failures = general_predicates(pod, n, held(other))
    assert [f.resource if isinstance(f, Insufficient) else f.predicate for f in failures] == \
        ["pods", "cpu", "memory", "example.com/x", "NodeAffinity", "NodeName", "NodePorts",
         "TaintToleration"]
    assert [f.rejection().message for f in failures if isinstance(f, Unmatched)] == [
        "Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity/selector",
        "Predicate NodeName failed: node(s) didn't match the requested node name",
        "Predicate NodePorts failed: node(s) didn't have free ports for the requested pod "
        "ports",
        "Predicate TaintToleration failed: node(s) had taints that the pod didn't tolerate"]


def port(host: int, ip: str = "", protocol: str = "") -> dict[str, Any]:
    p: dict[str, Any] = {"containerPort": 80, "hostPort": host}
    if ip:
        p["hostIP"] = ip
    if protocol:
        p["protocol"] = protocol
    return p


@pytest.mark.parametrize("mine,theirs,clash", [
    (port(8080), port(8080), True),
    (port(8080), port(8081), False),
    (port(8080, protocol="UDP"), port(8080), False),
    (port(8080, protocol="TCP"), port(8080), True),  # TCP is the default
    (port(8080, "10.0.0.1"), port(8080, "10.0.0.2"), False),
    (port(8080, "10.0.0.1"), port(8080, "10.0.0.1"), True),
    (port(8080, "10.0.0.1"), port(8080), True),  # all addresses include this one
    (port(8080), port(8080, "10.0.0.1"), True),
    ({"containerPort": 8080}, {"containerPort": 8080}, False),  # not host ports
], ids=["same", "other-port", "other-protocol", "tcp-default", "other-ip", "same-ip",
        "theirs-all", "mine-all", "container-ports"])
def test_host_ports(mine: dict[str, Any], theirs: dict[str, Any], clash: bool) -> None:
    pod = mkpod("p", containers=[box(ports=[mine])])
    other = mkpod("o", containers=[box(ports=[theirs])])
    assert (first(pod, others=held(other)) is not None) == clash


def test_host_ports_of_sidecars_count_those_of_init_containers_do_not() -> None:
    sidecar = mkpod("o", initContainers=[box("s", ports=[port(9000)], restartPolicy="Always")])
    init = mkpod("o", initContainers=[box("i", ports=[port(9000)])])
    pod = mkpod("p", containers=[box(ports=[port(9000)])])
    assert first(pod, others=held(sidecar)) is not None
    assert first(pod, others=held(init)) is None


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    e: dict[str, Any] = {"key": key, "operator": op}
    if values:
        e["values"] = list(values)
    return e


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}


LABELS = {"disk": "ssd", "zone": "a", "cores": "8"}


@pytest.mark.parametrize("spec,fits", [
    ({"nodeSelector": {"disk": "ssd"}}, True),
    ({"nodeSelector": {"disk": "ssd", "zone": "b"}}, False),
    ({"nodeSelector": {"gpu": ""}}, False),  # the label must be there
    ({"affinity": required({"matchExpressions": [expr("disk", "In", "hdd", "ssd")]})}, True),
    ({"affinity": required({"matchExpressions": [expr("disk", "NotIn", "ssd")]})}, False),
    ({"affinity": required({"matchExpressions": [expr("gpu", "NotIn", "x")]})}, True),
    ({"affinity": required({"matchExpressions": [expr("zone", "Exists")]})}, True),
    ({"affinity": required({"matchExpressions": [expr("zone", "DoesNotExist")]})}, False),
    ({"affinity": required({"matchExpressions": [expr("cores", "Gt", "4")]})}, True),
    ({"affinity": required({"matchExpressions": [expr("cores", "Lt", "4")]})}, False),
    ({"affinity": required({"matchExpressions": [expr("zone", "Gt", "4")]})}, False),
    # expressions of a term all hold; any term does
    ({"affinity": required({"matchExpressions": [expr("disk", "In", "ssd"),
                                                 expr("zone", "In", "b")]})}, False),
    ({"affinity": required({"matchExpressions": [expr("zone", "In", "b")]},
                           {"matchExpressions": [expr("zone", "In", "a")]})}, True),
    # a malformed expression spoils its term; empty terms match nothing
    ({"affinity": required({"matchExpressions": [expr("zone", "Exists", "a")]})}, False),
    ({"affinity": required({"matchExpressions": [expr("zone", "Like", "a")]})}, False),
    ({"affinity": required({})}, False),
    ({"affinity": required({}, {"matchExpressions": [expr("disk", "Exists")]})}, True),
    ({"affinity": required({"matchFields": [expr("metadata.name", "In", "n1")]})}, True),
    ({"affinity": required({"matchFields": [expr("metadata.name", "NotIn", "n1")]})}, False),
    # both the selector and the affinity must match
    ({"nodeSelector": {"disk": "hdd"},
      "affinity": required({"matchExpressions": [expr("disk", "Exists")]})}, False),
    # what the scheduler prefers is not required
    ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [expr("gpu", "Exists")]}}]}}}, True),
], ids=["selector", "selector-other-value", "selector-missing", "in", "not-in",
        "not-in-absent", "exists", "does-not-exist", "gt", "lt", "gt-not-a-number",
        "term-and", "terms-or", "exists-with-values", "unknown-operator", "empty-term",
        "empty-and-good-term", "field-in", "field-not-in", "selector-and-affinity",
        "preferred"])
def test_node_selector_and_affinity(spec: dict[str, Any], fits: bool) -> None:
    r = first(mkpod("p", **spec), node(labels=LABELS))
    assert r is None if fits else r == Rejection(
        "NodeAffinity", "Predicate NodeAffinity failed: node(s) didn't match Pod's node "
                        "affinity/selector")


TAINT = {"key": "k", "value": "v", "effect": "NoExecute"}


@pytest.mark.parametrize("taint,tolerations,fits", [
    (TAINT, [], False),
    ({**TAINT, "effect": "NoSchedule"}, [], True),  # the scheduler's, not the kubelet's
    ({**TAINT, "effect": "PreferNoSchedule"}, [], True),
    (TAINT, [{"key": "k", "value": "v", "effect": "NoExecute"}], True),
    (TAINT, [{"key": "k", "operator": "Equal", "value": "v"}], True),  # any effect
    (TAINT, [{"key": "k", "value": "w"}], False),
    (TAINT, [{"key": "k", "operator": "Exists"}], True),
    (TAINT, [{"operator": "Exists"}], True),  # every taint
    (TAINT, [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}], False),
    (TAINT, [{"key": "j", "operator": "Exists"}], False),
    (TAINT, [{"key": "k", "operator": "Gt", "value": "1"}], False),  # alpha: off
], ids=["untolerated", "no-schedule", "prefer-no-schedule", "exact", "equal-any-effect",
        "other-value", "exists", "exists-everything", "other-effect", "other-key", "gt"])
def test_no_execute_taints(taint: dict[str, str], tolerations: list[dict[str, str]],
                           fits: bool) -> None:
    r = first(mkpod("p", tolerations=tolerations), node(taints=[taint]))
    assert (r is None) == fits
    if not fits:
        assert r is not None and r.reason == "TaintToleration"


def test_a_static_pod_is_not_asked_about_taints() -> None:
    assert first(static(mkpod("p")), node(taints=[TAINT])) is None


# --- preemption's choice ----------------------------------------------------------------

def victim(name: str, cpu: str = "", memory: str = "", *, limits: bool = False,
           priority: int | None = None) -> dict[str, Any]:
    amounts = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v}
    c = box(limits=amounts) if limits else box(requests=amounts)
    spec: dict[str, Any] = {} if priority is None else {"priority": priority}
    return mkpod(name, containers=[c], **spec)


CRITICAL = mkpod("critical", priority=2_000_001_000)


def names(pods: Sequence[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


@pytest.mark.parametrize("candidates,needs,chosen", [
    # the one closest to what is needed
    ([victim("a", memory="1Gi"), victim("b", memory="3Gi"), victim("c", memory="2Gi")],
     [("memory", 2 * GI)], ["c"]),
    # equally close: the smaller (memory, then cpu)
    ([victim("a", cpu="2", memory="3Gi"), victim("b", cpu="1", memory="3Gi")],
     [("memory", GI)], ["b"]),
    # Burstable before Guaranteed, whatever their size
    ([victim("g", cpu="1", memory="1Gi", limits=True), victim("b", memory="4Gi")],
     [("memory", GI)], ["b"]),
    # a Guaranteed pod only when the others would not do
    ([victim("g", cpu="1", memory="4Gi", limits=True), victim("b", memory="1Gi")],
     [("memory", 3 * GI)], ["g"]),
    # several, one at a time, until nothing is needed
    ([victim("a", memory="1Gi"), victim("b", memory="1Gi"), victim("c", memory="1Gi")],
     [("memory", 2 * GI)], ["c", "b"]),
    # pods: any pod frees one (of equals, the kubelet's loop keeps the last)
    ([mkpod("a"), mkpod("b")], [("pods", 1)], ["b"]),
    # a critical pod is not preempted; a higher priority is not either
    ([static(victim("s", memory="4Gi")), victim("p", memory="1Gi"),
      victim("v", memory="4Gi", priority=2_000_001_001)], [("memory", GI)], ["p"]),
], ids=["closest", "smaller", "burstable-first", "guaranteed-when-needed", "several",
        "pods", "not-critical-ones"])
def test_pods_to_preempt(candidates: list[dict[str, Any]], needs: list[tuple[str, int]],
                         chosen: list[str]) -> None:
    assert names(pods_to_preempt(CRITICAL, candidates, needs)) == chosen


def test_preemption_that_cannot_free_enough() -> None:
    with pytest.raises(PreemptionError, match=r"^no set of running pods found to reclaim "
                                              r"resources: \[\(res: cpu, q: 1000\), \]$"):
        pods_to_preempt(CRITICAL, [victim("a", cpu="1"), static(victim("s", cpu="4"))],
                        [("cpu", 2000)])


def test_a_node_that_cannot_be_read_refuses_and_a_withdrawn_pod_is_not_admitted() -> None:
    settings = AdmissionSettings(kernel=(6, 1), apparmor=False)
    blind = NodeAdmission("n1", settings, lambda: None, lambda uid: False)
    blind.settle(mkpod("p"))
    assert blind.rejection("uid-p") == Rejection("InvalidNodeInfo",
                                                 "Kubelet cannot get node info.")
    adm = NodeAdmission("n1", settings, lambda: node({"pods": "1"}), lambda uid: False)
    adm.add(mkpod("a"))
    adm.withdraw("uid-a")  # deleted before its first sync
    adm.settle(mkpod("b"))
    assert set(adm.admitted) == {"uid-b"} and adm.rejection("uid-b") is None
    # what the pod alone decides comes first, and it holds no place
    adm.settle(mkpod("c", os={"name": "windows"}))
    r = adm.rejection("uid-c")
    assert r is not None and r.reason == "PodOSNotSupported"
    adm.release("uid-b")
    adm.settle(mkpod("d"))
    assert set(adm.admitted) == {"uid-d"}
    adm.settle(mkpod("b"))  # stopped for good: never admitted again
    assert set(adm.admitted) == {"uid-d"}


# --- one node's admission, through the sync loops ---------------------------------------

T1, T2, T3 = "2026-11-29T10:00:00Z", "2026-11-29T10:00:01Z", "2026-11-29T10:00:02Z"


def made(name: str, uid: str, created: str, **kw: Any) -> dict[str, Any]:
    """mkpod's pod, created at `created`."""
    pod = mkpod(name, uid, **kw)
    pod["metadata"]["creationTimestamp"] = created
    return pod


async def rejected(a: LoopRig, uid: str, reason: str, message: str) -> None:
    """The pod is Failed with the kubelet's reason, a Warning Event says so, and nothing
    of it was started."""
    st = a.status(uid)
    assert (st["phase"], st["reason"], st["message"]) == \
        ("Failed", reason, f"Pod was rejected: {message}")
    await a.events.drain()
    name = a.kube.calls_of("create events")
    assert any(c.body["reason"] == reason and c.body["type"] == "Warning"
               and c.body["message"] == message and c.body["involvedObject"]["uid"] == uid
               for c in name if c.body)
    assert a.rt.find(uid, "c") == [] and not [s for s in a.rt.sandboxes.values()
                                              if s.pod_uid == uid]


@aio
async def test_pods_are_admitted_in_the_order_they_were_created() -> None:
    clock = FakeClock()
    a = await started(clock)
    # one update, the later pod first: the earlier one gets the node's cpu
    late, early = asks("late", "u-late", cpu="3", created=T2), asks("early", "u-early",
                                                                   cpu="3", created=T1)
    a.send(Op.ADD, late, early)
    await a.run_for(3)
    assert a.status("u-early")["phase"] == "Running"
    await rejected(a, "u-late", "OutOfcpu", "Node didn't have enough resource: cpu, "
                   "requested: 3000, used: 3000, capacity: 4000")
    assert set(a.loop.syncer.admission.admitted) == {"u-early"}
    await a.loops.stop()


@aio
async def test_the_node_refuses_what_does_not_match_it_and_running_pods_are_untouched(
        ) -> None:
    clock = FakeClock()
    a = await started(clock)
    a.node_labels["disk"] = "hdd"
    a.node_taints.append({"key": "maintenance", "value": "now", "effect": "NoExecute"})
    tolerant = [{"key": "maintenance", "operator": "Exists"}]
    web = made("web", "u-web", T1, tolerations=tolerant,
                containers=[box(ports=[port(8080)])])
    a.send(Op.ADD, web)
    await a.run_for(3)
    running = [c.id for c in a.rt.running("u-web")]
    a.send(Op.ADD, made("clash", "u-clash", T2, tolerations=tolerant,
                         containers=[box(ports=[port(8080)])]),
           made("ssd", "u-ssd", T2, tolerations=tolerant,
                 nodeSelector={"disk": "ssd"}),
           made("intolerant", "u-int", T2),
           asks("huge", "u-huge", memory="900Gi", created=T2, tolerations=tolerant))
    await a.run_for(3)
    await rejected(a, "u-clash", "NodePorts", "Predicate NodePorts failed: node(s) didn't "
                   "have free ports for the requested pod ports")
    await rejected(a, "u-ssd", "NodeAffinity", "Predicate NodeAffinity failed: node(s) "
                   "didn't match Pod's node affinity/selector")
    await rejected(a, "u-int", "TaintToleration", "Predicate TaintToleration failed: "
                   "node(s) had taints that the pod didn't tolerate")
    await rejected(a, "u-huge", "OutOfmemory", f"Node didn't have enough resource: memory, "
                   f"requested: {900 * GI}, used: 0, capacity: {8 * GI}")
    assert [c.id for c in a.rt.running("u-web")] == running
    assert a.status("u-web")["phase"] == "Running"
    await a.loops.stop()


@aio
async def test_a_pod_that_ends_or_is_deleted_frees_what_it_held() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.allocatable["pods"] = "2"
    job = made("job", "u-job", T1, policy="Never")
    web = made("web", "u-web", T1, terminationGracePeriodSeconds=5)
    a.send(Op.ADD, job, web)
    await a.run_for(3)
    a.send(Op.ADD, made("third", "u-3", T2))
    await a.run_for(2)
    await rejected(a, "u-3", "OutOfpods", "Node didn't have enough resource: pods, "
                   "requested: 1, used: 2, capacity: 2")
    # the job finishes: its place is free once its containers have stopped
    a.rt.exit_container(a.rt.running("u-job")[0].id, 0)
    await a.run_for(3)
    assert a.status("u-job")["phase"] == "Succeeded"
    a.send(Op.ADD, made("fourth", "u-4", T3))
    await a.run_for(3)
    assert a.status("u-4")["phase"] == "Running"
    # a pod being deleted holds its place until its containers have stopped
    deleting = {**web, "metadata": {**web["metadata"],
                                    "deletionTimestamp": "2026-11-29T11:00:00Z",
                                    "deletionGracePeriodSeconds": 5}}
    a.rt.ignore_sigterm.add("c")
    a.send(Op.DELETE, deleting)
    await a.run_for(1)
    a.send(Op.ADD, made("fifth", "u-5", T3))
    await a.run_for(1)
    assert a.status("u-5")["reason"] == "OutOfpods"
    await a.run_for(6)  # web stopped at the end of its grace period
    a.send(Op.ADD, made("sixth", "u-6", T3))
    await a.run_for(3)
    assert a.status("u-6")["phase"] == "Running"
    assert set(a.loop.syncer.admission.admitted) == {"u-4", "u-6"}
    await a.loops.stop()


@aio
async def test_a_restarted_agent_takes_back_the_pods_it_finds_running_first() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    a1 = await started(clock, rt)
    old = asks("old", "u-old", cpu="3", created=T2)
    a1.send(Op.ADD, old)
    await a1.run_for(3)
    await a1.loops.stop()  # like SIGKILL: the pod runs on
    creates = rt.calls["create_container"]

    a2 = LoopRig(rt, clock)
    # created earlier, bound while no agent ran: it does not take the running pod's place
    newer = asks("bound-late", "u-new", cpu="3", created=T1)
    a2.send(Op.ADD, newer, {**old, "status": a1.status("u-old")})
    a2.loops.start()
    await a2.run_for(3)
    assert rt.calls["create_container"] == creates and len(rt.running("u-old")) == 1
    await rejected(a2, "u-new", "OutOfcpu", "Node didn't have enough resource: cpu, "
                   "requested: 3000, used: 3000, capacity: 4000")
    # one that would not be admitted now (the node shrank) keeps running all the same
    await a2.loops.stop()
    a3 = LoopRig(rt, clock)
    a3.allocatable["cpu"] = "2"
    a3.send(Op.ADD, {**old, "status": a1.status("u-old")})
    a3.loops.start()
    await a3.run_for(3)
    assert rt.calls["create_container"] == creates and len(rt.running("u-old")) == 1
    assert set(a3.loop.syncer.admission.admitted) == {"u-old"}
    await a3.loops.stop()


@aio
async def test_a_pod_deleted_while_no_agent_ran_holds_its_place_until_it_stopped() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    a1 = await started(clock, rt)
    old = asks("old", "u-old", cpu="3", created=T1, terminationGracePeriodSeconds=5)
    a1.send(Op.ADD, old)
    await a1.run_for(3)
    await a1.loops.stop()
    rt.ignore_sigterm.add("c")  # it takes its whole grace period to stop

    a2 = LoopRig(rt, clock)
    deleted = {**old, "status": a1.status("u-old"),
               "metadata": {**old["metadata"], "deletionTimestamp": "2026-11-29T11:00:00Z",
                            "deletionGracePeriodSeconds": 5}}
    a2.send(Op.ADD, deleted, asks("new", "u-new", cpu="3", created=T2))
    a2.loops.start()
    await a2.run_for(3)
    assert rt.running("u-old")  # still in its grace period
    await rejected(a2, "u-new", "OutOfcpu", "Node didn't have enough resource: cpu, "
                   "requested: 3000, used: 3000, capacity: 4000")
    await a2.run_for(4)
    assert not rt.running("u-old")
    a2.send(Op.ADD, asks("later", "u-later", cpu="3", created=T3))
    await a2.run_for(3)
    assert a2.status("u-later")["phase"] == "Running"
    await a2.loops.stop()


@aio
async def test_a_critical_pod_preempts_and_starts_once_they_have_stopped() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.rt.ignore_sigterm.add("slow")
    small = made("small", "u-small", T1, containers=[box(requests={"memory": "1Gi"})])
    big = made("big", "u-big", T1, terminationGracePeriodSeconds=5,
                containers=[box("slow", requests={"memory": "5Gi"})])
    a.send(Op.ADD, small, big)
    await a.run_for(3)
    critical = made("critical", "u-crit", T2, priority=2_000_001_000,
                     priorityClassName="system-node-critical",
                     containers=[box(requests={"memory": "4Gi"})])
    a.send(Op.ADD, critical)
    await a.run_for(2)
    st = a.status("u-big")
    assert (st["phase"], st["reason"], st["message"]) == \
        ("Failed", "Preempting", "Preempted in order to admit critical pod")
    disruption = next(c for c in st["conditions"] if c["type"] == "DisruptionTarget")
    assert (disruption["status"], disruption["reason"], disruption["message"]) == \
        ("True", "TerminationByKubelet",
         "Pod was preempted by Kubelet to accommodate a critical pod.")
    await a.events.drain()
    assert a.events_of("Preempting") == ["Preempted in order to admit critical pod"]
    # the critical pod waits while the preempted one has its grace period
    assert a.rt.running("u-big") and not a.rt.find("u-crit", "c")
    await a.run_for(6)
    assert not a.rt.running("u-big") and len(a.rt.running("u-crit")) == 1
    assert a.status("u-crit")["phase"] == "Running"
    assert a.status("u-small")["phase"] == "Running"  # the closest fit was enough
    assert a.status("u-big")["phase"] == "Failed"
    assert set(a.loop.syncer.admission.admitted) == {"u-small", "u-crit"}
    await a.loops.stop()


@aio
async def test_a_critical_pod_preemption_cannot_help_is_rejected() -> None:
    clock = FakeClock()
    a = await started(clock)
    # critical too: no critical pod preempts it
    a.send(Op.ADD, made("web", "u-web", T1, priority=2_000_001_000,
                        containers=[box(requests={"cpu": "1"})]))
    await a.run_for(3)
    a.send(Op.ADD, asks("critical", "u-critical", cpu="4", created=T2, priority=2_000_001_000),
           made("affine", "u-affine", T2, nodeSelector={"disk": "ssd"},
                priority=2_000_001_000))
    await a.run_for(3)
    await rejected(a, "u-critical", "UnexpectedAdmissionError",
                   "Unexpected error while attempting to recover from admission failure: "
                   "preemption: error finding a set of pods to preempt: no set of running "
                   "pods found to reclaim resources: [(res: cpu, q: 1000), ]")
    # preemption makes room, it does not make a node match
    await rejected(a, "u-affine", "NodeAffinity", "Predicate NodeAffinity failed: node(s) "
                   "didn't match Pod's node affinity/selector")
    assert a.status("u-web")["phase"] == "Running"
    await a.loops.stop()


@aio
async def test_each_node_of_a_process_admits_on_its_own() -> None:
    clock = FakeClock()
    a = LoopRig(FakeRuntime(clock), clock, nodes=("n1", "n2"))
    a.allocatable["pods"] = "1"
    a.loops.start()
    one, two = made("a", "ua", T1), made("b", "ub", T1, node="n2")
    a.send(Op.ADD, one, two)
    await a.run_for(3)
    assert a.status("ua")["phase"] == a.status("ub")["phase"] == "Running"
    a.send(Op.ADD, made("c", "uc", T2, node="n2"))
    await a.run_for(2)
    assert a.status("uc")["reason"] == "OutOfpods"
    await a.loops.stop()


@aio
async def test_the_agent_admits_against_its_node_as_the_api_has_it(tmp_path: Path) -> None:
    rig = AgentRig(tmp_path, "--max-pods", "3", "--system-reserved", "memory=1Gi")
    await rig.start()
    node = rig.node()
    allocatable = node["status"]["allocatable"]
    assert allocatable["pods"] == "3"  # the NodeStatus's figures are admission's
    # someone else labels the Node and advertises an extended resource on it
    node["metadata"]["labels"]["disk"] = "ssd"
    for part in ("capacity", "allocatable"):
        node["status"][part]["example.com/foo"] = "1"
    rig.kube.put(NODES, node)
    await settle()
    foo = [box(requests={"example.com/foo": "1"})]
    rig.kube.put(PODS, made("ssd", "u-ssd", T1, nodeSelector={"disk": "ssd"}, containers=foo))
    rig.kube.put(PODS, made("foo", "u-foo", T2, containers=foo))
    rig.kube.put(PODS, asks("huge", "u-huge", memory="900Gi", created=T3))
    for _ in range(3):
        await rig.clock.advance(1)
    assert rig.status("u-ssd")["phase"] == "Running"
    assert rig.status("u-foo")["reason"] == "OutOfexample.com/foo"
    memory = parse_quantity(allocatable["memory"])
    # the fake /proc's, less what is reserved and the hard eviction threshold (100Mi)
    assert memory == 8_000_000 * 1024 - GI - 100 * 2**20
    assert rig.status("u-huge")["message"] == (
        f"Pod was rejected: Node didn't have enough resource: memory, requested: "
        f"{900 * GI}, used: 0, capacity: {memory:.0f}")
    await rig.finish()
