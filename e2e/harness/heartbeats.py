"""Heartbeats as the API server sees them: a recorder of every Lease and Node write
(watches), and the efficient-heartbeat scenario, which e2e/test_heartbeat.py runs on
four agents with node credentials and e2e/test_chart_identities.py on one agent in
virtual-node mode under the Helm chart's ServiceAccount."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from e2e.harness.agents import AgentProcess
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodeagent.api.policy import HEARTBEAT_ANNOTATION, Heartbeat, encode_heartbeat_annotation
from nodepulse_dev import Cluster

WINDOW = 60.0


@dataclass
class Recorder:
    """Every Lease and Node write as seen by watches: (monotonic time, object)."""

    leases: list[tuple[float, str, str, dict[str, Any]]] = field(default_factory=list)
    nodes: list[tuple[float, str, str, dict[str, Any]]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    stopped: bool = False
    _watches: list[watch.Watch] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self, api: client.ApiClient) -> None:
        coord, core = client.CoordinationV1Api(api), client.CoreV1Api(api)
        self._follow(coord.list_lease_for_all_namespaces, self.leases)
        self._follow(core.list_node, self.nodes)

    def _follow(self, lister: Callable[..., Any], sink: list[Any]) -> None:
        w = watch.Watch()
        self._watches.append(w)
        rv = lister().metadata.resource_version

        def run() -> None:
            try:
                for ev in w.stream(lister, resource_version=rv, timeout_seconds=600):
                    obj = ev["object"]
                    sink.append((time.monotonic(), ev["type"],
                                 f"{obj.metadata.namespace or ''}/{obj.metadata.name}",
                                 api_dict(obj)))
            except Exception as e:  # the control plane going away after the test is fine
                if not self.stopped:
                    self.errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self.stopped = True
        for w in self._watches:
            w.stop()

    def lease_updates(self, name: str, start: float, end: float) -> list[float]:
        return [t for t, kind, key, _ in self.leases
                if key == f"kube-node-lease/{name}" and kind == "MODIFIED" and start <= t < end]

    def renewals(self) -> list[tuple[float, float, str]]:
        """(delivered, renewTime as the holder wrote it, "namespace/name") of each Lease
        update seen; both in seconds, delivered on time.monotonic, renewTime epoch."""
        return [(t, dt.datetime.fromisoformat(obj["spec"]["renewTime"]).timestamp(), key)
                for t, kind, key, obj in self.leases
                if kind == "MODIFIED" and (obj.get("spec") or {}).get("renewTime")]

    def status_writes(self, name: str, start: float, end: float) -> list[tuple[float, Any]]:
        """Node events whose status differs from the one before (a status PATCH)."""
        out = []
        before = None
        for t, _, key, obj in self.nodes:
            if key != f"/{name}":
                continue
            status = obj.get("status")
            if before is not None and status != before and start <= t < end:
                out.append((t, status))
            before = status
        return out


def api_dict(obj: Any) -> dict[str, Any]:
    data: dict[str, Any] = client.ApiClient().sanitize_for_serialization(obj)
    return data


def condition(node: dict[str, Any], ctype: str) -> str | None:
    for c in (node.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return str(c["status"])
    return None


@dataclass
class Parts:
    """Which node plays which part in `efficient_heartbeats`."""

    default: str  # defaults: 6±1 Lease updates and no NodeStatus patch in 60 s
    policy: str  # the admin writes the heartbeat annotation: renew every 2 s, followed
    report20: str | None = None  # started with nodeStatusReportFrequency 20s
    cond: str | None = None  # its config file (cond_config) moves the disk threshold
    cond_config: Path | None = None


def efficient_heartbeats(cluster: Cluster, procs: list[AgentProcess], parts: Parts) -> None:
    """The efficient-heartbeat checks on running agents (started, not yet registered),
    witnessed by watches and the API server; stops the agents with SIGTERM at the end."""
    api = cluster.api_client()
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)
    owner = {n: p for p in procs for n in p.nodes}
    names = tuple(owner)
    rec = Recorder()
    rec.start(api)

    def all_up() -> bool:
        return all(p.get("/readyz")[0] == 200 for p in procs) and all(
            lease_exists(coord, n) for n in names)
    eventually(lambda: all(
        p.proc.poll() is None for p in procs) and reachable(all_up),
        f"{len(names)} nodes registered with leases", 60)
    for n in names:
        node = api_dict(core.read_node(n))
        assert condition(node, "Ready") == "True", n
        assert node["status"]["capacity"]["pods"] == "110"
        assert node["metadata"]["labels"]["nodepulse.dev/agent"] == owner[n].name
        lease = coord.read_namespaced_lease(n, "kube-node-lease")
        assert lease.spec.holder_identity == n and lease.spec.lease_duration_seconds == 40
        assert lease.metadata.owner_references[0].uid == node["metadata"]["uid"]
    if parts.cond:
        assert condition(api_dict(core.read_node(parts.cond)), "DiskPressure") == "False"

    # The API server's counters are read at some instant of each /metrics fetch:
    # a renewal during a fetch may fall on either side of the window.
    fetch0 = time.monotonic()
    m0 = cluster.apiserver_metrics()
    t0 = time.monotonic()
    time.sleep(20)

    t_cond = time.monotonic()
    if parts.cond_config is not None:
        # the threshold moves so that any filesystem is under pressure (0% and 100% are
        # ignored, as the kubelet ignores them)
        parts.cond_config.write_text("evictionHard:\n  nodefs.available: 1Pi\n")
    # the operator's annotation says renew every 2 s
    core.patch_node(parts.policy, {"metadata": {"annotations": {
        HEARTBEAT_ANNOTATION: encode_heartbeat_annotation(
            "fast", Heartbeat(leaseDurationSeconds=40, renewIntervalSeconds=2))}}})
    t_policy = time.monotonic()

    time.sleep(max(0.0, t0 + WINDOW - time.monotonic()))
    fetch1 = time.monotonic()
    m1 = cluster.apiserver_metrics()
    t1 = time.monotonic()
    assert rec.errors == []  # the witnesses saw everything

    # defaults: 6±1 lease updates, no status patches after registration
    assert 5 <= len(rec.lease_updates(parts.default, t0, t1)) <= 7
    assert rec.status_writes(parts.default, t0, t1) == []
    expected_status = 0
    if parts.report20:  # report period 20 s: 3±1 status patches
        assert 2 <= len(rec.status_writes(parts.report20, t0, t1)) <= 4
        assert 5 <= len(rec.lease_updates(parts.report20, t0, t1)) <= 7
        expected_status += 4
    if parts.cond:  # a crossed disk threshold is reported within one update period (10 s)
        cond_writes = rec.status_writes(parts.cond, t0, t1)
        assert len(cond_writes) == 1
        t_seen, status = cond_writes[0]
        # 10 s, and up to 5 s for the PATCH and the watch on a loaded machine: not the
        # 5 min report period
        assert t_seen - t_cond <= 10 + 5, t_seen - t_cond
        assert {c["type"]: c["status"] for c in status["conditions"]}["DiskPressure"] == "True"
        expected_status += 1
    # the annotation is followed within one old renew interval, then every ~2 s
    after = rec.lease_updates(parts.policy, t_policy, t1)
    assert after and after[0] - t_policy <= 10
    steady = [t for t in after if t >= t_policy + 4]
    # the gaps between the renewTimes the agent wrote (the watch adds its own delays);
    # under half the old 10 s interval
    renewed = [rt for t, rt, key in rec.renewals()
               if key == f"kube-node-lease/{parts.policy}" and t_policy + 4 <= t < t1]
    gaps = [y - x for x, y in zip(renewed, renewed[1:], strict=False)]
    assert len(steady) >= 12 and max(gaps) < 5, gaps
    assert len(rec.lease_updates(parts.policy, t0, t_policy)) <= 3

    # The API server counts the same writes (others' leases, e.g. its own identity
    # lease, are taken out; a write on the window's edge may fall either side).
    ours_keys = {f"kube-node-lease/{n}" for n in names}
    others = sum(1 for t, kind, key, _ in rec.leases if kind == "MODIFIED" and t0 <= t < t1
                 and key not in ours_keys)
    ours = sum(len(rec.lease_updates(n, t0, t1)) for n in names)
    puts = _delta(m0, m1, "apiserver_request_total", resource="leases", verb="PUT")
    during_fetches = sum(len(rec.lease_updates(n, fetch0, t0))
                         + len(rec.lease_updates(n, fetch1, t1)) for n in names)
    assert abs(puts - others - ours) <= 1 + during_fetches, (puts, others, ours,
                                                            during_fetches)
    patches = _delta(m0, m1, "apiserver_request_total", resource="nodes",
                     subresource="status", verb="PATCH")
    status_ours = sum(len(rec.status_writes(n, t0, t1)) for n in names)
    assert abs(patches - status_ours) <= 2, (patches, status_ours)
    assert patches <= expected_status + 1  # nothing else writes NodeStatus

    # the agents' own metrics and health agree (process-wide: no per-node labels)
    a, d = owner[parts.default], owner[parts.policy]
    code, text = a.get("/metrics")
    assert code == 200
    assert samples(text, "nodepulse_lease_renewals_total", result="success") >= 5
    assert samples(text, "nodepulse_node_status_reports_total", reason="register") == len(
        a.nodes)
    assert samples(text, "nodepulse_node_status_reports_total", reason="change") == 0
    assert a.get("/healthz")[0] == 200
    _, text = d.get("/metrics")
    assert samples(text, "nodepulse_heartbeat_policy_updates_total", result="applied") == 1

    # a deleted Lease comes back at the next renewal
    coord.delete_namespaced_lease(parts.default, "kube-node-lease")
    t_del = time.monotonic()
    eventually(lambda: any(
        kind == "ADDED" and key == f"kube-node-lease/{parts.default}" and t > t_del
        for t, kind, key, _ in rec.leases), f"{parts.default}'s Lease recreated", 15)
    lease = coord.read_namespaced_lease(parts.default, "kube-node-lease")
    assert lease.spec.holder_identity == parts.default

    # SIGTERM: every agent stops cleanly, nothing refused along the way
    for p in procs:
        assert p.stop() == 0, p.log.read_text()[-2000:]
        log = p.log.read_text()
        assert "stopped" in log
        assert "Forbidden" not in log and " 403 " not in log, log[-2000:]
    rec.stop()
    renew = coord.read_namespaced_lease(parts.policy, "kube-node-lease").spec.renew_time
    assert dt.datetime.now(dt.UTC) - renew < dt.timedelta(seconds=10)


def lease_exists(coord: client.CoordinationV1Api, name: str) -> bool:
    try:
        coord.read_namespaced_lease(name, "kube-node-lease")
        return True
    except client.ApiException:
        return False


def reachable(check: Callable[[], bool]) -> bool:
    """check(), or False while it cannot reach the agent's server (not listening yet)."""
    try:
        return check()
    except OSError:
        return False


def _delta(m0: str, m1: str, name: str, **labels: str) -> float:
    return samples(m1, name, **labels) - samples(m0, name, **labels)
