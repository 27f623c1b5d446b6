"""What the soak watches while it runs, and the invariants it checks with it.

Every few seconds a round reads the API (the workload's pods, the Nodes, the Leases)
and the containerd node's runtime (CRI) and checks what can be judged at once: no
container restarted, none duplicated, the API's statuses equal the runtime's, no pod
of a quiet node stuck. Each second both operators say whether they lead. Every
`sample_every` seconds each program's RSS, threads, open files and asyncio tasks are
sampled. The Lease renewals and taints seen are judged at the end against the faults
(rules.py), and the final state is awaited after the last fault.

A violation names the object, the time and the faults that came last before it.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import math
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.soak import rules
from bench.soak.rig import POLICIES, POOL_LABEL, Rig
from bench.soak.workload import KIND_LABEL, NAMESPACE
from e2e.harness.promtext import samples

UNREACHABLE = "node.kubernetes.io/unreachable"
TIMEOUT = 10  # seconds per API request of a round
# after a fault, an agent needs this long to be heard again: a restart (a busy machine
# takes seconds to start Python), its retry back-off, a relist
RECOVERY = 30.0

INVARIANTS = {
    "lost": "no pod lost (each runs or finished as its spec says, a bound after the "
            "last fault on its node)",
    "duplicated": "none duplicated (one ready sandbox per pod, one running container "
                  "per name, none left for a deleted pod)",
    "restarted": "no container restarted that did not fail",
    "status": "every status converged to the runtime's truth",
    "volumes": "ConfigMap and Secret volumes converged to the API's",
    "lease": "no Lease stale beyond its policy except during a fault that keeps its "
             "agent from the API",
    "taint": "no taint or eviction on a node whose agent was alive and connected",
    "leader": "the operator's leader unique",
}


@dataclass
class Violation:
    invariant: str
    obj: str
    at: float  # wall clock
    detail: str
    faults_before: list[str]


@dataclass
class ProcSample:
    t: float
    rss_mb: float
    threads: float
    fds: float
    tasks: float | None


@dataclass
class Observer:
    rig: Rig
    timeline: rules.Timeline
    bound: float = 90.0  # seconds after the last fault on a node its pods must be right
    check_every: float = 5.0
    sample_every: float = 60.0
    checks: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    skipped: int = 0  # rounds the API or the runtime did not answer
    renewals: dict[str, list[float]] = field(default_factory=dict)
    taints: dict[tuple[str, str, str], float] = field(default_factory=dict)
    proc_samples: dict[tuple[str, int], list[ProcSample]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # why a round could not run

    def __post_init__(self) -> None:
        self.stopping = threading.Event()
        self._seen: set[tuple[str, str]] = set()  # (invariant, object) reported once
        self._suspect: dict[tuple[str, str], int] = {}  # consecutive rounds a check failed
        self._container_ids: dict[tuple[str, str], str] = {}
        self._pod_node: dict[str, str] = {}
        self._threads = [threading.Thread(target=self._loop, args=(self.round, self.check_every),
                                          daemon=True, name="soak-checks"),
                         threading.Thread(target=self._loop, args=(self.leaders, 1.0),
                                          daemon=True, name="soak-leader"),
                         threading.Thread(target=self._loop, args=(self.sample, self.sample_every),
                                          daemon=True, name="soak-sampler")]
        self.api = self.rig.cluster.api_client()
        self.core = client.CoreV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)

    # ---- running
    def start(self) -> None:
        self.sample()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self._threads:
            t.join(timeout=60)
        self.sample()

    def _loop(self, fn: Callable[[], None], every: float) -> None:
        while not self.stopping.wait(every):
            try:
                fn()
            except Exception as e:  # a check that cannot run this time is not a pass
                self.skipped += 1
                self.errors.append(f"{fn.__name__}: {type(e).__name__}: {str(e)[:160]}")

    def violate(self, invariant: str, obj: str, detail: str, at: float | None = None,
                pool: str | None = None) -> None:
        """Record a violation once per object; `pool`: the node pool the object is in
        (the faults listed with it are the last ones that touch that pool)."""
        if (invariant, obj) in self._seen:
            return
        self._seen.add((invariant, obj))
        at = time.time() if at is None else at
        self.violations.append(Violation(invariant, obj, at, detail,
                                         self.timeline.last_before(at, pool=pool)))

    def _twice(self, key: tuple[str, str], failing: bool) -> bool:
        """True when a check failed in this round and the one before (a status read
        while the agent is writing it is not yet wrong)."""
        if not failing:
            self._suspect.pop(key, None)
            return False
        self._suspect[key] = self._suspect.get(key, 0) + 1
        return self._suspect[key] >= 2

    # ---- one round
    def pool_of_pod(self, pod: Any) -> str:
        return "cri" if (pod.metadata.labels or {}).get(KIND_LABEL, "").endswith("-cri") \
            else "virtual"

    def round(self) -> None:
        t = time.time()
        pods = self.core.list_namespaced_pod(NAMESPACE, _request_timeout=TIMEOUT).items
        nodes = self.core.list_node(label_selector=self._selector(), _request_timeout=TIMEOUT).items
        leases = self.coord.list_namespaced_lease("kube-node-lease",
                                                  _request_timeout=TIMEOUT).items
        ours = set(self.rig.nodes())
        for lease in leases:
            if lease.metadata.name in ours and lease.spec.renew_time is not None:
                self.renewals.setdefault(lease.metadata.name, []).append(
                    lease.spec.renew_time.timestamp())
        self.checks["lease"] += 1
        for n in nodes:
            for taint in n.spec.taints or []:
                if taint.key == UNREACHABLE:
                    added = taint.time_added.isoformat() if taint.time_added else ""
                    self.taints.setdefault((n.metadata.name, taint.effect, added), t)
        self.checks["taint"] += 1
        for p in pods:
            if p.spec.node_name:
                self._pod_node[p.metadata.name] = p.spec.node_name
        self._restarts(pods, t)
        self._lost(pods, t)
        try:
            view = self.rig.runtime_view()
        except Exception:  # containerd is down (a fault): its checks wait for the next round
            return
        self._duplicates(view, pods, final=False)
        if self.timeline.quiet("cri", t, self.bound):
            self._status(pods, view, t)

    def _selector(self) -> str:
        return f"{POOL_LABEL} in ({','.join(self.rig.pools.values())})"

    def _restarts(self, pods: list[Any], t: float) -> None:
        self.checks["restarted"] += 1
        for p in pods:
            uid = p.metadata.uid
            for cs in p.status.container_statuses or []:
                key = (uid, cs.name)
                prev = self._container_ids.get(key)
                if cs.container_id and not prev and ran(cs):
                    # one only created may yet be replaced: a start cut short
                    self._container_ids[key] = cs.container_id
                replaced = bool(prev and cs.container_id and cs.container_id != prev)
                if not (cs.restart_count or replaced):
                    continue
                if self._rebooted(p):
                    continue  # the fake runtime's containers die with its agent (a reboot)
                last = cs.last_state.terminated if cs.last_state else None
                if cut_short(last, self.timeline):
                    continue  # containerd failed its start: a failure, restarted
                why = (f"last state: exit {last.exit_code} {last.reason} {last.message or ''}"
                       if last else "no last state")
                self.violate("restarted", f"pod {p.metadata.name} container {cs.name}",
                             f"restartCount {cs.restart_count}, container "
                             f"{prev} -> {cs.container_id}; {why}", t, self.pool_of_pod(p))

    def _rebooted(self, p: Any) -> bool:
        """A virtual node's pod that lived through its agent's SIGKILL: the fake runtime
        lost its containers with the agent, as a node's reboot does."""
        created = p.metadata.creation_timestamp.timestamp()
        return self.pool_of_pod(p) == "virtual" and any(
            f.kind == "virtual-agent-kill" and f.start >= created - 1
            for f in self.timeline.faults)

    def _expected_failure(self, p: Any) -> bool:
        """A Job's pod of a rebooted virtual node ends Failed, its container lost
        (ContainerStatusUnknown): a run-once pod does not run twice; its Job makes
        another (the Job must still complete). Or a start containerd's restart cut
        short (start_cut_short)."""
        if p.status.phase != "Failed":
            return False
        if self._rebooted(p):
            return all(cs.state and cs.state.terminated
                       and cs.state.terminated.reason == "ContainerStatusUnknown"
                       for cs in p.status.container_statuses or [])
        return self.pool_of_pod(p) == "cri" and start_cut_short(p, self.timeline)

    def _lost(self, pods: list[Any], t: float) -> None:
        self.checks["lost"] += 1
        for p in pods:
            pool = self.pool_of_pod(p)
            created = p.metadata.creation_timestamp.timestamp()
            if (p.metadata.deletion_timestamp or t - created < self.bound
                    or not self.timeline.quiet(pool, t, self.bound)):
                continue
            problem = None if self._expected_failure(p) else pod_problem(p)
            if self._twice(("lost", p.metadata.uid), problem is not None):
                self.violate("lost", f"pod {p.metadata.name} ({pool})",
                             f"{problem}, {t - created:.0f}s after its creation and "
                             f"{self.bound:.0f}s after the last fault on its node", t, pool)

    def _duplicates(self, view: Any, pods: list[Any], final: bool) -> list[str]:
        """Two ready sandboxes for one pod, two running containers of one name; at the
        end also what is left of a pod the API no longer has."""
        self.checks["duplicated"] += 1
        found = []
        for uid, sbs in view.sandboxes.items():
            ready = [s for s, ok in sbs if ok]
            if len(ready) > 1:
                found.append((uid, f"{len(ready)} ready sandboxes: {ready}"))
        running = Counter((c.pod_uid, c.name) for c in view.containers if c.state == "RUNNING")
        found += [(uid, f"{n} running containers named {name}")
                  for (uid, name), n in running.items() if n > 1]
        if final:
            known = {p.metadata.uid for p in pods}
            found += [(uid, "a ready sandbox of a pod the API does not have")
                      for uid, sbs in view.sandboxes.items()
                      if uid not in known and any(ok for _, ok in sbs)]
        if not final:
            for uid, what in found:
                self.violate("duplicated", f"pod uid {uid}", what, pool="cri")
        return [f"pod uid {uid}: {what}" for uid, what in found]

    def _status(self, pods: list[Any], view: Any, t: float, final: bool = False) -> list[str]:
        """The API's container statuses of the containerd node's pods against CRI."""
        self.checks["status"] += 1
        out = []
        for p in pods:
            if self.pool_of_pod(p) != "cri" or p.metadata.deletion_timestamp:
                continue
            if not final and t - p.metadata.creation_timestamp.timestamp() < self.bound:
                continue
            wrong = status_mismatch(p, view)
            if final:
                if wrong:
                    out.append(f"pod {p.metadata.name}: {wrong}")
            elif self._twice(("status", p.metadata.uid), bool(wrong)):
                self.violate("status", f"pod {p.metadata.name}", wrong or "", t, "cri")
        return out

    # ---- leaders and samples
    def leaders(self) -> None:
        got = self.rig.leaders()
        self.checks["leader"] += 1
        leading = sorted(i for i, v in got.items() if v == 1)
        if len(leading) > 1:
            self.violate("leader", " and ".join(leading), "both report "
                         "nodepulse_operator_leader 1", time.time())

    def sample(self) -> None:
        t = time.time()
        for role, (pid, port) in self.rig.processes().items():
            # gone, or exited and not yet reaped (a zombie's status has no VmRSS): no sample
            with contextlib.suppress(OSError, ValueError, KeyError):
                status = Path(f"/proc/{pid}/status").read_text()
                fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
                rss = int(fields["VmRSS"].split()[0]) / 1024
                threads = int(fields["Threads"])
                fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
                self.proc_samples.setdefault((role, pid), []).append(
                    ProcSample(t, rss, threads, fds, _tasks(port)))

    # ---- at the end
    def final(self, settle: float) -> float:
        """Wait (at most `settle` seconds) for the final state: every pod as its spec
        says, every Job complete, Deployments available, nodes Ready and untainted,
        Leases fresh, statuses and volumes equal to the runtime's and the API's, one
        leader. What still fails then is a violation. Returns the seconds it took."""
        start = time.time()
        problems: dict[str, list[str]] = {}
        while True:
            try:
                problems = self.final_problems()
            except Exception as e:  # the API still recovering
                problems = {"lost": [f"the final state could not be read: {e!r}"]}
            if not any(problems.values()) or time.time() - start > settle:
                break
            time.sleep(3)
        took = time.time() - start
        for inv, found in problems.items():
            self.checks[inv] += 1
            for what in found:
                self.violate(inv, what.split(":", 1)[0], f"{what.split(':', 1)[-1].strip()} "
                             f"(not converged {took:.0f}s after the last fault)")
        self._judge_leases()
        self._judge_taints()
        return took

    def final_problems(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {k: [] for k in INVARIANTS}
        apps, batch = client.AppsV1Api(self.api), client.BatchV1Api(self.api)
        for d in apps.list_namespaced_deployment(NAMESPACE, _request_timeout=TIMEOUT).items:
            want, st = d.spec.replicas, d.status
            if (st.available_replicas or 0) != want or (st.ready_replicas or 0) != want \
                    or (st.replicas or 0) != want:
                out["lost"].append(f"deployment {d.metadata.name}: {want} wanted, "
                                   f"{st.replicas} present, {st.ready_replicas} ready, "
                                   f"{st.available_replicas} available")
        for j in batch.list_namespaced_job(NAMESPACE, _request_timeout=TIMEOUT).items:
            if not any(c.type == "Complete" and c.status == "True"
                       for c in j.status.conditions or []):
                out["lost"].append(f"job {j.metadata.name}: not complete "
                                   f"({j.status.succeeded or 0} succeeded, "
                                   f"{j.status.failed or 0} failed, "
                                   f"{j.status.active or 0} active)")
        pods = self.core.list_namespaced_pod(NAMESPACE, _request_timeout=TIMEOUT).items
        for p in pods:
            problem = None if p.metadata.deletion_timestamp or self._expected_failure(p) \
                else pod_problem(p, final=True)
            if problem:
                out["lost"].append(f"pod {p.metadata.name}: {problem}")
        self._restarts(pods, time.time())
        now = time.time()
        for n in self.core.list_node(label_selector=self._selector(),
                                     _request_timeout=TIMEOUT).items:
            ready = next((c for c in n.status.conditions or [] if c.type == "Ready"), None)
            if ready is None or ready.status != "True":
                out["taint"].append(f"node {n.metadata.name}: Ready "
                                    f"{ready.status if ready else 'missing'}")
            if any(t.key == UNREACHABLE for t in n.spec.taints or []):
                out["taint"].append(f"node {n.metadata.name}: still tainted unreachable")
        ours = set(self.rig.nodes())
        for lease in self.coord.list_namespaced_lease("kube-node-lease",
                                                      _request_timeout=TIMEOUT).items:
            name = lease.metadata.name
            if name in ours:
                ours.discard(name)
                age = now - lease.spec.renew_time.timestamp()
                if age > POLICIES[self.rig.pool_of(name)]["lease"]:
                    out["lease"].append(f"lease {name}: renewed {age:.0f}s ago")
        out["lease"] += [f"lease {n}: missing" for n in sorted(ours)]
        view = self.rig.runtime_view()
        out["duplicated"] = self._duplicates(view, pods, final=True)
        out["status"] = self._status(pods, view, now, final=True)
        out["volumes"] = self._volumes(pods)
        leading = [i for i, v in self.rig.leaders().items() if v == 1]
        if len(leading) != 1:
            out["leader"].append(f"operators: {len(leading)} report leading")
        return out

    def _volumes(self, pods: list[Any]) -> list[str]:
        cm = self.core.read_namespaced_config_map("soak-config", NAMESPACE,
                                                  _request_timeout=TIMEOUT).data["version"]
        secret = self.core.read_namespaced_secret("soak-secret", NAMESPACE,
                                                  _request_timeout=TIMEOUT).data["version"]
        want = {"configmap": cm, "secret": base64.b64decode(secret).decode()}
        out = []
        for p in pods:
            if (p.metadata.labels or {}).get(KIND_LABEL) != "web-cri" or \
                    p.status.phase != "Running" or p.metadata.deletion_timestamp:
                continue
            base = self.rig.cri_root / "pods" / p.metadata.uid / "volumes"
            for kind, name in (("configmap", "config"), ("secret", "secret")):
                path = base / f"kubernetes.io~{kind}" / name / "version"
                try:
                    have = path.read_text()
                except OSError as e:
                    have = f"unreadable ({e.strerror})"
                if have != want[kind]:
                    out.append(f"pod {p.metadata.name}: {kind} volume has version {have!r}, "
                               f"the API {want[kind]!r}")
        return out

    def _judge_leases(self) -> None:
        """A stretch without renewal longer than the policy's Lease duration, of which
        the faults that keep the agent from the API leave the duration or more."""
        now = time.time()
        for node in self.rig.nodes():
            pool = self.rig.pool_of(node)
            duration = POLICIES[pool]["lease"]
            faults = self.timeline.intervals((*rules.AGENT_SIDE[pool], *rules.API_SIDE),
                                             RECOVERY)
            for a, b in rules.stale_periods(self.renewals.get(node, []), duration, now):
                if not rules.excused((a, b), faults, duration):
                    self.violate("lease", f"lease {node}",
                                 f"not renewed for {b - a:.0f}s (policy: {duration}s); "
                                 f"{rules.uncovered((a, b), faults):.0f}s of it with no "
                                 "fault keeping its agent from the API", a + duration, pool)

    def _judge_taints(self) -> None:
        """A taint is due when the node's own agent was down or cut off for the
        silence the operator saw (the grace period), short of one renewal interval
        and the recovery."""
        events = self.core.list_namespaced_event(
            NAMESPACE, field_selector="reason=TaintManagerEviction",
            _request_timeout=TIMEOUT).items
        wrong_nodes: set[str] = set()
        for (node, effect, added), seen in sorted(self.taints.items(), key=lambda kv: kv[1]):
            pool = self.rig.pool_of(node)
            p = POLICIES[pool]
            at = _parse(added) or seen
            faults = self.timeline.intervals(rules.AGENT_SIDE[pool], RECOVERY)
            renew = p["lease"] / 4
            window = (at - p["grace"], at)
            if not rules.excused(window, faults, renew + RECOVERY):
                wrong_nodes.add(node)
                self.violate("taint", f"node {node} {UNREACHABLE}:{effect}",
                             f"added at {_hms(at)}; in the {p['grace']}s before it its agent "
                             f"was up and connected for "
                             f"{rules.uncovered(window, faults):.0f}s", at, pool)
        for ev in events:
            node = self._pod_node.get(ev.involved_object.name, "")
            self.checks["taint"] += 1
            if node in wrong_nodes or not node:
                self.violate("taint", f"pod {ev.involved_object.name} evicted",
                             f"{ev.message} (node {node or 'unknown'})",
                             (ev.last_timestamp or ev.event_time).timestamp())


def pod_problem(p: Any, final: bool = False) -> str | None:
    """What is wrong with a pod that had time enough, or None: a web pod runs with
    every container ready; a Job's pod succeeded (or, before the end, still runs)."""
    kind = (p.metadata.labels or {}).get(KIND_LABEL, "")
    phase = p.status.phase
    if kind.startswith("web"):
        if phase != "Running":
            return f"phase {phase} ({_reason(p)})"
        unready = [c.name for c in p.status.container_statuses or [] if not c.ready]
        return f"containers not ready: {unready}" if unready else None
    if phase == "Succeeded" or (phase == "Running" and not final):
        return None
    return f"phase {phase} ({_reason(p)})"


def _reason(p: Any) -> str:
    parts = [f"{c.type}={c.status} {c.reason or ''}".strip()
             for c in p.status.conditions or [] if c.status != "True"]
    if p.status.reason:
        parts.append(f"pod {p.status.reason}: {p.status.message or ''}".strip(" :"))
    for cs in p.status.container_statuses or []:
        w = cs.state.waiting if cs.state else None
        ended = cs.state.terminated if cs.state else None
        if w:
            parts.append(f"{cs.name} waiting {w.reason}: {w.message or ''}".strip(" :"))
        elif ended:
            parts.append(f"{cs.name} exited {ended.exit_code} {ended.reason or ''}: "
                         f"{ended.message or ''}".strip(" :"))
    return "; ".join(parts) or "no condition"


def ran(cs: Any) -> bool:
    """The container status says it started: running or terminated, now or before."""
    last = cs.last_state.terminated if cs.last_state else None
    return bool(cs.state and (cs.state.running or cs.state.terminated) or last)


# containerd's reason for a container whose start failed (exit code 128)
START_ERROR = "StartError"


def cut_short(ended: Any, timeline: rules.Timeline) -> bool:
    """A container that ended because containerd's restart cut its start short:
    containerd marks it exited (128, StartError) as it goes down."""
    return bool(ended is not None and ended.reason == START_ERROR
                and ended.finished_at is not None
                and timeline.during("containerd-restart", ended.finished_at.timestamp()))


def start_cut_short(p: Any, timeline: rules.Timeline) -> bool:
    """The pod failed only because containerd's restart cut a container's start short
    (cut_short): the kubelet's pod fails the same way (a run-once container is not
    started twice), and its Job makes another. Each container ended 0, or so."""
    statuses = p.status.container_statuses or []
    ends = [cs.state.terminated for cs in statuses if cs.state and cs.state.terminated]
    if not ends or len(ends) < len(statuses):
        return False
    cut = [e for e in ends if cut_short(e, timeline)]
    return bool(cut) and all(e.exit_code == 0 or e in cut for e in ends)


def status_mismatch(p: Any, view: Any) -> str | None:
    """How the API's container statuses of a pod differ from CRI's records, or None."""
    uid = p.metadata.uid
    running = {c.name: c.id for c in view.of(uid) if c.state == "RUNNING"}
    problems = []
    for cs in p.status.container_statuses or []:
        cid = (cs.container_id or "").split("://", 1)[-1]
        api_running = bool(cs.state and cs.state.running)
        if api_running and running.get(cs.name) != cid:
            problems.append(f"{cs.name}: API says running {cid[:12]}, runtime runs "
                            f"{(running.get(cs.name) or 'nothing')[:12]}")
        elif not api_running and cs.name in running:
            problems.append(f"{cs.name}: runtime runs {running[cs.name][:12]}, API says "
                            f"{[k for k, v in (cs.state.to_dict() or {}).items() if v]}")
    if p.status.phase in ("Succeeded", "Failed") and running:
        problems.append(f"phase {p.status.phase} but the runtime runs {sorted(running)}")
    return "; ".join(problems) or None


def _tasks(port: int | None) -> float | None:
    if port is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    return samples(text, "nodepulse_asyncio_tasks") if "nodepulse_asyncio_tasks" in text \
        else None


def _parse(ts: str) -> float | None:
    if not ts:
        return None
    try:
        return dt.datetime.fromisoformat(ts).timestamp()
    except ValueError:
        return None


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def slopes(samples_: list[ProcSample]) -> dict[str, float | None]:
    """Per hour, over one process's samples."""
    out: dict[str, float | None] = {}
    for name in ("rss_mb", "threads", "fds", "tasks"):
        pts = [rules.Sample(s.t, v) for s in samples_
               if (v := getattr(s, name)) is not None and not math.isnan(v)]
        out[name] = rules.slope_per_hour(pts)
    return out
