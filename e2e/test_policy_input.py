"""Bad NodeStatusPolicy input against the real API server, and conflicting priorities
against the real operator.

Every CEL rule (x-kubernetes-validations) is read from the CRD file itself, so a rule
added later is tested here or fails the suite for want of a violation: each is broken
once with `kubectl apply`, refused with its message naming the field, and nothing is
stored; a range rule's bounds are also accepted (server-side dry run). Each case is
checked against nodeagent.api.policy.parse_spec too: the API server and the parser
must accept and refuse the same specs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, watch
from nodeoperator.state import parse_policy
from urllib3.exceptions import ProtocolError

from e2e.harness.ports import free_port
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodeagent.api.policy import GROUP, HEARTBEAT_ANNOTATION, KIND, PLURAL, VERSION
from nodepulse_dev import Cluster
from nodepulse_dev.processes import stop_process

ROOT = Path(__file__).resolve().parent.parent
CRD_FILE = ROOT / "charts" / "nodepulse" / "crds" / f"{PLURAL}.{GROUP}.yaml"
OPERATOR = Path(sys.executable).parent / "nodepulse-operator"
RUN = uuid.uuid4().hex[:5]


# ---- the rules, from the CRD
def crd_rules() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(path of the schema node, its schema, the rule) for every CEL rule; array items
    are addressed as [0], as the API server reports the first item."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    [version] = crd["spec"]["versions"]
    out: list[tuple[str, dict[str, Any], dict[str, Any]]] = []

    def walk(node: dict[str, Any], path: str) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            out.append((path, node, rule))
        for name, prop in (node.get("properties") or {}).items():
            walk(prop, f"{path}.{name}" if path else name)
        if "items" in node:
            walk(node["items"], f"{path}[0]")
    walk(version["schema"]["openAPIV3Schema"], "")
    return out


RULES = crd_rules()
MESSAGES = [r["message"] for _, _, r in RULES]

# Violations of the rules that are not plain ranges, by rule text: (spec, accepted).
# Each rule's refused cases break that rule and no other.
GRACE = "self.failure.gracePeriodSeconds >= self.heartbeat.leaseDurationSeconds"
CASES: dict[str, list[tuple[dict[str, Any], bool]]] = {
    "!has(self.failure) || !has(self.heartbeat) || !has(self.failure.gracePeriodSeconds) || "
    f"!has(self.heartbeat.leaseDurationSeconds) || {GRACE}": [
        ({"heartbeat": {"leaseDurationSeconds": 60}, "failure": {"gracePeriodSeconds": 59}},
         False),
        ({"heartbeat": {"leaseDurationSeconds": 60}}, False),  # against the default grace, 50
        ({"heartbeat": {"leaseDurationSeconds": 60}, "failure": {"gracePeriodSeconds": 60}},
         True),
    ],
    "self.operator in ['In', 'NotIn'] ? (has(self.values) && size(self.values) > 0) : "
    "(!has(self.values) || size(self.values) == 0)": [
        ({"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "In"}]}}, False),
        ({"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "NotIn",
                                                 "values": []}]}}, False),
        ({"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "Exists",
                                                 "values": ["x"]}]}}, False),
        ({"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "DoesNotExist",
                                                 "values": ["x"]}]}}, False),
        ({"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "In",
                                                 "values": ["x"]},
                                                {"key": "j", "operator": "Exists"}]}}, True),
    ],
    "!has(self.renewIntervalSeconds) || !has(self.leaseDurationSeconds) || "
    "self.renewIntervalSeconds < self.leaseDurationSeconds": [
        ({"heartbeat": {"leaseDurationSeconds": 20, "renewIntervalSeconds": 20}}, False),
        ({"heartbeat": {"leaseDurationSeconds": 20, "renewIntervalSeconds": 19}}, True),
    ],
    "!has(self.statusReportFrequencySeconds) || !has(self.statusUpdateFrequencySeconds) || "
    "self.statusReportFrequencySeconds >= self.statusUpdateFrequencySeconds": [
        ({"heartbeat": {"statusUpdateFrequencySeconds": 30, "statusReportFrequencySeconds": 29}},
         False),
        ({"heartbeat": {"statusUpdateFrequencySeconds": 30, "statusReportFrequencySeconds": 30}},
         True),
    ],
}


def cross_rules_hold(spec: dict[str, Any]) -> bool:
    """The CRD's cross-field rules, after schema defaulting: to know whether a range
    case breaks its range alone (renewIntervalSeconds above 3600 cannot)."""
    h, f = spec.get("heartbeat") or {}, spec.get("failure") or {}
    lease = h.get("leaseDurationSeconds", 40)
    return (f.get("gracePeriodSeconds", 50) >= lease
            and h.get("renewIntervalSeconds", 0) < lease
            and h.get("statusReportFrequencySeconds", 300)
            >= h.get("statusUpdateFrequencySeconds", 10))


def range_cases(path: str, schema: dict[str, Any], rule: dict[str, Any]
                ) -> list[tuple[dict[str, Any], bool]] | None:
    """For `self >= low && self <= high` on a field: just outside each bound (refused)
    and each bound (accepted), with the other fields set so no other rule interferes."""
    parts = rule["rule"].replace("self >= ", "").replace(" && self <= ", " ").split()
    try:
        low, high = (float(x) for x in parts)
    except ValueError:
        return None
    *sections, field = path.split(".")[1:]  # under spec: [section,] field
    if len(sections) > 1 or "[" in path:
        return None
    section = sections[0] if sections else ""
    whole = schema["type"] == "integer"
    out = []
    for value, ok in ((low - 1, False), (low, True), (high, True), (high + 1, False)):
        v: float = int(value) if whole else value
        spec: dict[str, Any] = {section: {field: v}} if section else {field: v}
        if section == "heartbeat":
            spec["failure"] = {"gracePeriodSeconds": 86400}
            spec["heartbeat"].update({
                "renewIntervalSeconds": {"leaseDurationSeconds": 3600},
                "statusUpdateFrequencySeconds": {"statusReportFrequencySeconds": 86400},
                "statusReportFrequencySeconds": {"statusUpdateFrequencySeconds": 1},
            }.get(field, {}))
        elif field == "gracePeriodSeconds":
            spec["heartbeat"] = {"leaseDurationSeconds": 5}
        out.append((spec, ok))
    return out


def cases_of(path: str, schema: dict[str, Any], rule: dict[str, Any]
             ) -> list[tuple[dict[str, Any], bool]]:
    cases = CASES.get(rule["rule"]) or range_cases(path, schema, rule)
    assert cases, (f"no violation written for the CRD rule at {path}: {rule['rule']!r}; "
                   "add one to CASES in e2e/test_policy_input.py")
    assert any(not ok for _, ok in cases)
    return cases


def test_every_rule_of_the_crd_file_is_collected() -> None:
    """The walk above finds every rule the file has (a plain count of the text)."""
    assert len(RULES) == CRD_FILE.read_text().count("- rule:") >= 12


# ---- fixtures and helpers
@pytest.fixture(scope="module")
def kube(cluster: Cluster) -> Iterator[client.ApiClient]:
    run = functools.partial(subprocess.run, check=True, capture_output=True, timeout=120)
    run([str(cluster.binary("kubectl")), "--kubeconfig", str(cluster.kubeconfig), "apply",
         "-f", str(CRD_FILE)])
    run([str(cluster.binary("kubectl")), "--kubeconfig", str(cluster.kubeconfig), "wait",
         "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}"])
    api = cluster.api_client()
    yield api
    custom = client.CustomObjectsApi(api)
    for p in custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]:
        if p["metadata"]["name"].startswith(f"pi-{RUN}-"):
            custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, p["metadata"]["name"])
    core = client.CoreV1Api(api)
    for n in core.list_node().items:
        if n.metadata.name.startswith(f"pi-{RUN}-"):
            core.delete_node(n.metadata.name)


def kubectl(cluster: Cluster, *args: str, stdin: str | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.binary("kubectl")), "--kubeconfig",
                           str(cluster.kubeconfig), *args], input=stdin, text=True,
                          capture_output=True, timeout=60)


def manifest(name: str, spec: dict[str, Any]) -> str:
    """The policy for `kubectl apply -f -`, as JSON: PyYAML writes a string such as
    "79e03" (a RUN) unquoted, and kubectl's YAML reads that as a number."""
    return json.dumps({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                       "metadata": {"name": name}, "spec": spec})


def stored(api: client.ApiClient, name: str) -> dict[str, Any] | None:
    try:
        return dict(client.CustomObjectsApi(api).get_cluster_custom_object(
            GROUP, VERSION, PLURAL, name))
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def parser_error(spec: dict[str, Any]) -> str | None:
    """What the operator makes of the spec (parse_spec and the selector check)."""
    return parse_policy({"metadata": {"name": "x"}, "spec": spec}).error


# ---- every CEL rule
@pytest.mark.parametrize(("path", "schema", "rule"), RULES,
                         ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(RULES)])
def test_every_cel_rule_refuses_with_its_message(
        cluster: Cluster, kube: client.ApiClient, path: str, schema: dict[str, Any],
        rule: dict[str, Any]) -> None:
    field = path + rule.get("fieldPath", "")
    message = rule["message"]
    assert message.startswith(field.replace("[0]", "[]")), (field, message)
    for i, (spec, ok) in enumerate(cases_of(path, schema, rule)):
        name = f"pi-{RUN}-rule-{i}"
        if ok:
            out = kubectl(cluster, "apply", "--dry-run=server", "-f", "-",
                          stdin=manifest(name, spec))
            assert message not in out.stderr, (spec, out.stderr)
            # anything else the server refuses, the operator's parser refuses too
            assert (out.returncode == 0) == (parser_error(spec) is None), (spec, out.stderr)
            continue
        out = kubectl(cluster, "apply", "-f", "-", stdin=manifest(name, spec))
        assert out.returncode != 0, (spec, out.stdout)
        # `<field>: Invalid value: ...: <message>`, and no other rule's complaint
        assert f"{field}: Invalid value" in out.stderr, (spec, out.stderr)
        assert message in out.stderr, (spec, out.stderr)
        assert stored(kube, name) is None
        if cross_rules_hold(spec) or rule["rule"] in CASES:
            others = [m for m in MESSAGES if m != message and m in out.stderr]
            assert not others, (spec, out.stderr)
        error = parser_error(spec)
        assert error is not None and error.startswith(field), (spec, error)


# ---- what the schema itself refuses (types, enums, required, unknown fields)
SCHEMA_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"priority": "high"}, "spec.priority", "must be of type integer"),
    ({"heartbeat": {"leaseDurationSeconds": 40.5}}, "spec.heartbeat.leaseDurationSeconds",
     "must be of type integer"),
    ({"failure": {"gracePeriodSeconds": "60s"}}, "spec.failure.gracePeriodSeconds",
     "must be of type integer"),
    ({"failure": {"taintUnreachable": "yes"}}, "spec.failure.taintUnreachable",
     "must be of type boolean"),
    ({"failure": {"maxUnreachableFraction": "half"}}, "spec.failure.maxUnreachableFraction",
     "must be of type number"),
    ({"heartbeat": 40}, "spec.heartbeat", "must be of type object"),
    ({"nodeSelector": {"matchLabels": {"pool": 1}}}, "spec.nodeSelector.matchLabels.pool",
     "must be of type string"),
    ({"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "Near",
                                             "values": ["x"]}]}},
     "spec.nodeSelector.matchExpressions[0].operator", "Unsupported value"),
    ({"nodeSelector": {"matchExpressions": [{"operator": "Exists"}]}},
     "spec.nodeSelector.matchExpressions[0].key", "Required value"),
    ({"heartbeat": {"leaseSeconds": 40}}, "spec.heartbeat.leaseSeconds", "unknown field"),
    ({"grace": 40}, "spec.grace", "unknown field"),
]


@pytest.mark.parametrize(("spec", "field", "why"), SCHEMA_CASES,
                         ids=[field for _, field, _ in SCHEMA_CASES])
def test_schema_refuses_bad_types_with_the_field(
        cluster: Cluster, kube: client.ApiClient, spec: dict[str, Any], field: str,
        why: str) -> None:
    name = f"pi-{RUN}-schema"
    out = kubectl(cluster, "apply", "-f", "-", stdin=manifest(name, spec))
    assert out.returncode != 0, out.stdout
    assert field in out.stderr and why in out.stderr, out.stderr
    assert stored(kube, name) is None
    error = parser_error(spec)
    assert error is not None, spec  # the operator's parser refuses it as well
    assert field.rsplit(".", 1)[0].replace("[0]", "") in error.replace("[0]", ""), error


def test_priority_range(cluster: Cluster, kube: client.ApiClient) -> None:
    """priority is an int32 in the CRD: what the server takes, the parser takes."""
    for value in (-2**31, 2**31 - 1, 2**31, -2**31 - 1):
        out = kubectl(cluster, "apply", "--dry-run=server", "-f", "-",
                      stdin=manifest(f"pi-{RUN}-prio", {"priority": value}))
        assert (out.returncode == 0) == (parser_error({"priority": value}) is None), \
            (value, out.stderr)
        if out.returncode:
            assert "spec.priority" in out.stderr, out.stderr


def test_a_refused_update_keeps_the_stored_policy(cluster: Cluster,
                                                  kube: client.ApiClient) -> None:
    name = f"pi-{RUN}-kept"
    # a selector that matches no node: an empty one would govern every node of the
    # session's cluster, the other modules' too
    good = {"priority": 3, "nodeSelector": {"matchLabels": {"pi-e2e/none": RUN}},
            "heartbeat": {"leaseDurationSeconds": 20}, "failure": {"gracePeriodSeconds": 30}}
    assert kubectl(cluster, "apply", "-f", "-", stdin=manifest(name, good)).returncode == 0
    try:
        before = stored(kube, name)
        assert before is not None
        bad = {**good, "heartbeat": {"leaseDurationSeconds": 20, "renewIntervalSeconds": 25}}
        out = kubectl(cluster, "apply", "-f", "-", stdin=manifest(name, bad))
        assert out.returncode != 0
        assert "spec.heartbeat.renewIntervalSeconds must be less than" in out.stderr
        after = stored(kube, name)
        assert after is not None
        assert after["spec"] == before["spec"]
        assert after["metadata"]["generation"] == before["metadata"]["generation"]
    finally:
        client.CustomObjectsApi(kube).delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)


# ---- conflicting priorities, with the real operator
class Operator:
    def __init__(self, cluster: Cluster, identity: str) -> None:
        self.port = free_port()
        self.identity = identity
        log = cluster.log_dir / f"operator-{identity}.log"
        argv = [str(OPERATOR), "--kubeconfig", str(cluster.kubeconfig), "--identity", identity,
                "--leader-election-name", f"nodepulse-pi-{identity}",
                "--metrics-port", str(self.port), "--monitor-period", "1",
                *cluster.node_lifecycle_args()]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def leading(self) -> bool:
        try:
            return samples(self.metrics(), "nodepulse_operator_leader") == 1
        except OSError:
            return False

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def operators(cluster: Cluster) -> Iterator[Callable[[str], Operator]]:
    started: list[Operator] = []

    def start(identity: str) -> Operator:
        op = Operator(cluster, f"pi-{RUN}-{identity}")
        started.append(op)
        eventually(op.leading, f"operator {identity} leading", 60)
        return op
    yield start
    for op in started:
        op.stop()


def policy(api: client.ApiClient, name: str, priority: int, selector: dict[str, Any],
           lease: int = 20, grace: int = 3600) -> str:
    full = f"pi-{RUN}-{name}"
    client.CustomObjectsApi(api).create_cluster_custom_object(GROUP, VERSION, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": full},
        # a long grace by default: these Nodes have no agent
        "spec": {"priority": priority, "nodeSelector": selector,
                 "heartbeat": {"leaseDurationSeconds": lease},
                 "failure": {"gracePeriodSeconds": grace}}})
    return full


def conflict(api: client.ApiClient, name: str, status: str | None = None) -> dict[str, Any]:
    """The policy's Conflict condition ({} while it has none, or not this status)."""
    p = stored(api, name) or {}
    c: dict[str, Any] = next((c for c in (p.get("status") or {}).get("conditions") or []
                              if c["type"] == "Conflict"), {})
    return c if status is None or c.get("status") == status else {}


def governed_by(api: client.ApiClient, node: str) -> str | None:
    return policy_of(client.CoreV1Api(api).read_node(node))


@dataclasses.dataclass
class Ties:
    """x: tie-a and tie-b (priority 5) both match, tie-a (first by name) governs. y:
    matched by both too, but `top` (9) governs, so no conflict there. z: only tie-b.
    tie-b is created first: the order must not matter."""
    nodes: dict[str, str]  # zone -> node
    tie_a: str
    tie_b: str
    top: str
    want: dict[str, str]  # node -> the policy that must govern it
    selector: str  # label selector for the nodes


def ties(api: client.ApiClient, tag: str) -> Ties:
    pool = f"{RUN}-{tag}"
    core = client.CoreV1Api(api)
    nodes = {zone: f"pi-{RUN}-{tag}-{zone}" for zone in "xyz"}
    for zone, node in nodes.items():
        core.create_node({"metadata": {"name": node, "labels": {"pi-e2e/pool": pool,
                                                                "pi-e2e/zone": zone}}})
    tie_b = policy(api, f"{tag}-tie-b", 5, {"matchLabels": {"pi-e2e/pool": pool}})
    tie_a = policy(api, f"{tag}-tie-a", 5, {
        "matchLabels": {"pi-e2e/pool": pool},
        "matchExpressions": [{"key": "pi-e2e/zone", "operator": "In", "values": ["x", "y"]}]})
    top = policy(api, f"{tag}-top", 9, {"matchLabels": {"pi-e2e/pool": pool,
                                                        "pi-e2e/zone": "y"}})
    want = {nodes["x"]: tie_a, nodes["y"]: top, nodes["z"]: tie_b}
    return Ties(nodes, tie_a, tie_b, top, want, f"pi-e2e/pool={pool}")


def test_equal_priorities_conflict_only_where_they_are_on_top(
        kube: client.ApiClient, operators: Callable[[str], Operator]) -> None:
    operators("conflict")
    t = ties(kube, "c")
    eventually(lambda: {n: governed_by(kube, n) for n in t.want} == t.want, "each node's policy")
    for name in (t.tie_a, t.tie_b):
        c = eventually(functools.partial(conflict, kube, name, "True"), f"Conflict on {name}")
        assert c["reason"] == "EqualPriority"
        assert t.tie_a in c["message"] and t.tie_b in c["message"], c
        assert t.nodes["x"] in c["message"], c
        assert t.nodes["y"] not in c["message"] and t.nodes["z"] not in c["message"], c
        assert f"{t.tie_a} applies" in c["message"], c
    assert eventually(lambda: conflict(kube, t.top), f"status of {t.top}")["status"] == "False"
    counts = {p: (stored(kube, p) or {}).get("status", {}).get("nodes")
              for p in (t.tie_a, t.tie_b, t.top)}
    assert counts == {t.tie_a: 1, t.tie_b: 1, t.top: 1}

    # tie-b above tie-a: no conflict left, x goes to tie-b
    client.CustomObjectsApi(kube).patch_cluster_custom_object(
        GROUP, VERSION, PLURAL, t.tie_b, {"spec": {"priority": 6}})
    eventually(lambda: governed_by(kube, t.nodes["x"]) == t.tie_b, "x follows tie-b")
    for name in (t.tie_a, t.tie_b):
        eventually(functools.partial(conflict, kube, name, "False"), f"conflict cleared on {name}")
    assert {n: governed_by(kube, n) for n in t.want} == {
        t.nodes["x"]: t.tie_b, t.nodes["y"]: t.top, t.nodes["z"]: t.tie_b}


class NodeWitness(threading.Thread):
    """Every value of view(node) for the selected nodes, from a watch: a value the
    operator writes and takes back within a second is seen here too."""

    def __init__(self, api: client.ApiClient, selector: str, view: Callable[[Any], Any]) -> None:
        super().__init__(daemon=True, name="node-witness")
        self.core = client.CoreV1Api(api)
        self.selector, self.view = selector, view
        listed = self.core.list_node(label_selector=selector)
        self.rv = listed.metadata.resource_version
        self.seen: dict[str, list[Any]] = {n.metadata.name: [view(n)] for n in listed.items}
        self.watch = watch.Watch()
        self.stopping = threading.Event()
        self.resumed: list[str] = []  # why the watch had to be resumed

    def run(self) -> None:
        # a watch the server ends early is resumed from the last resourceVersion seen,
        # so no event is missed
        while not self.stopping.is_set():
            try:
                for ev in self.watch.stream(self.core.list_node, label_selector=self.selector,
                                            resource_version=self.rv, timeout_seconds=60):
                    meta = ev["object"].metadata
                    self.rv = meta.resource_version
                    values = self.seen.setdefault(meta.name, [])
                    value = self.view(ev["object"])
                    if not values or values[-1] != value:
                        values.append(value)
                    if self.stopping.is_set():
                        break
            except (ProtocolError, client.ApiException) as e:
                self.resumed.append(repr(e))

    def stop(self, wake: str) -> None:
        self.stopping.set()
        self.watch.stop()
        # the stream looks at its stop flag on the next event: make one
        self.core.patch_node(wake, {"metadata": {"annotations": {"pi-e2e/wake": RUN}}})
        self.join(timeout=30)
        assert not self.is_alive(), "the witness did not stop"


def policy_of(node: Any) -> str | None:
    ann = (node.metadata.annotations or {}).get(HEARTBEAT_ANNOTATION)
    return json.loads(ann)["policy"] if ann else None


def unreachable(node: Any) -> tuple[str, ...]:
    """The effects of the node's unreachable taints."""
    return tuple(sorted(t.effect for t in node.spec.taints or []
                        if t.key == "node.kubernetes.io/unreachable"))


def test_a_new_operator_keeps_every_nodes_policy(
        kube: client.ApiClient, operators: Callable[[str], Operator]) -> None:
    """A restart or a failover: the new leader, starting from nothing, must come to
    the same answer and have nothing to write, not the defaults first and the
    policy again after."""
    first = operators("first")
    t = ties(kube, "r")
    eventually(lambda: {n: governed_by(kube, n) for n in t.want} == t.want, "each node's policy")
    policies = (t.tie_a, t.tie_b, t.top)
    eventually(lambda: all(
        (stored(kube, p) or {}).get("status", {}).get("nodes") == 1 for p in policies),
        "the policies' statuses")
    statuses = {p: (stored(kube, p) or {})["status"] for p in policies}
    witness = NodeWitness(kube, t.selector, policy_of)
    witness.start()
    first.stop()
    second = operators("second")
    ticks = samples(second.metrics(), "nodepulse_operator_monitor_tick_seconds_count")
    eventually(lambda: samples(
        second.metrics(), "nodepulse_operator_monitor_tick_seconds_count") >= ticks + 3,
        "three monitor periods of the second operator")
    witness.stop(t.nodes["x"])
    assert witness.seen == {n: [p] for n, p in t.want.items()}, \
        f"a node's policy changed while the operator restarted (watch resumed: {witness.resumed})"
    assert {p: (stored(kube, p) or {})["status"] for p in policies} == statuses
    assert samples(second.metrics(), "nodepulse_operator_writes_total") == 0, \
        [line for line in second.metrics().splitlines() if "writes_total{" in line]


def test_a_new_operator_keeps_a_silent_nodes_taints(
        kube: client.ApiClient, operators: Callable[[str], Operator]) -> None:
    """A node marked unreachable stays so until its Lease is renewed: a new leader,
    which gives every node a full grace period before a verdict of its own, must not
    take the taints off a node that is still silent meanwhile."""
    first = operators("first-taint")
    pool = f"{RUN}-silent"
    node = f"pi-{RUN}-silent"
    client.CoreV1Api(kube).create_node({"metadata": {"name": node,
                                                     "labels": {"pi-e2e/pool": pool}}})
    policy(kube, "silent", 50, {"matchLabels": {"pi-e2e/pool": pool}}, lease=5, grace=5)
    try:
        eventually(lambda: unreachable(
            client.CoreV1Api(kube).read_node(node)) == ("NoExecute", "NoSchedule"),
            "the silent node tainted", 60)
    except AssertionError as e:  # say what the operator made of the node
        n = client.CoreV1Api(kube).read_node(node)
        writes = [line for line in first.metrics().splitlines()
                  if line.startswith(("nodepulse_operator_writes_total{",
                                      "nodepulse_operator_stale"))]
        raise AssertionError(f"{e}: policy {policy_of(n)!r}, taints {n.spec.taints}, "
                             f"conditions {n.status.conditions}, operator {writes}") from None
    witness = NodeWitness(kube, f"pi-e2e/pool={pool}", unreachable)
    witness.start()
    first.stop()
    second = operators("second-taint")
    ticks = samples(second.metrics(), "nodepulse_operator_monitor_tick_seconds_count")
    eventually(lambda: samples(
        second.metrics(), "nodepulse_operator_monitor_tick_seconds_count") >= ticks + 3,
        "three monitor periods of the second operator")
    witness.stop(node)
    assert witness.seen == {node: [("NoExecute", "NoSchedule")]}, \
        f"the silent node's taints changed while the operator restarted ({witness.resumed})"
