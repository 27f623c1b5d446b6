"""One node's heartbeat: registration, NodeStatus reporting, its Lease, its policy.

A NodeController owns no loop and no thread: the shared schedulers call `tick` (status)
and `renew` (lease) at the node's own due times, and the shared node watch hands it
its Node. A process speaking for one node is just the case N=1. Everything the nodes of
a process share comes in one NodeControllerConfig, which the agent builds once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.client import ApiError, brief
from nodeagent.api.clock import Clock
from nodeagent.api.kube import NODES, Kube, Obj
from nodeagent.api.policy import (
    AGENT_LABEL,
    HEARTBEAT_ANNOTATION,
    Heartbeat,
    PolicyError,
    decode_heartbeat_annotation,
)
from nodeagent.node.heartbeatmetrics import NodeMetrics
from nodeagent.node.host import HostReadError, HostReadings
from nodeagent.node.lease import LeaseRenewer, spread_before
from nodeagent.node.scheduler import DueScheduler
from nodeagent.node.status import (
    Status,
    StatusSettings,
    allocatable,
    build_patch,
    compute_status,
    meaningful_changes,
    report_reason,
)

log = logging.getLogger(__name__)

ImageLister = Callable[[], Sequence[Mapping[str, Any]]]
Readiness = Callable[[], str | None]
Pressure = Callable[[str], Mapping[str, str]]  # node -> its pressure conditions that hold
Blocking = Callable[..., Awaitable[Any]]  # runs a blocking call on a thread pool


@dataclasses.dataclass
class NodeSpec:
    """What a node is, as opposed to how often it reports."""

    name: str
    agent_id: str
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] = ()
    provider_id: str = ""  # spec.providerID (set once: the API server refuses a change)


@dataclasses.dataclass(frozen=True)
class NodeControllerConfig:
    """What every node of a process shares."""

    kube: Kube            # registration and status
    lease_kube: Kube      # Lease writes, on threads of their own: never behind status work
    clock: Clock
    metrics: NodeMetrics
    heartbeat: Heartbeat  # from flags and config; a node's policy annotation overrides it
    status: StatusSettings
    probe: Callable[[], HostReadings]
    status_call: Blocking  # host readings and the status computation, off the event loop
    renewals: DueScheduler[str]
    ticker: DueScheduler[str]
    answered: ApiAnswered  # fired by a Lease renewal that goes through after failures
    uids: dict[str, str]  # node name -> its Node's UID once registered (mirror pods,
    # Events point at the Node by UID: read here, not fetched again)
    images: ImageLister | None = None
    readiness: Readiness | None = None
    pressure: Pressure | None = None  # the eviction manager's conditions (None: none)
    legacy: bool = False  # --heartbeat-mode=legacy: full status every period, no Lease
    started_together: bool = False  # virtual nodes: first renewals and ticks spread


@dataclasses.dataclass(frozen=True, slots=True)
class SeenNode:
    """Of the Node as the API last showed it, what pod admission reads, kept only where
    it differs from what this agent registers (None: the same). Others may add labels,
    taints and extended resources; thousands of nodes that nobody changed share one
    empty record."""

    labels: dict[str, str] | None = None
    taints: list[Obj] | None = None
    allocatable: dict[str, Any] | None = None


AS_REGISTERED = SeenNode()


class NodeController:
    # thousands in a process: no __dict__ each
    __slots__ = ("_next_tick", "_spread_tick", "base", "clock", "computed", "config",
                 "exists", "heartbeat", "images", "kube", "last_full_report", "last_status_write",
                 "lease", "legacy", "metrics", "name", "policy_name", "pressure", "probe",
                 "readiness", "registered", "renewals", "reported", "reported_version",
                 "rng", "seen", "settings", "spec", "started", "status_call", "ticker",
                 "uid")
    REQUEST_TIMEOUT = 10.0

    def __init__(self, spec: NodeSpec, config: NodeControllerConfig, lease: LeaseRenewer,
                 rng: random.Random | None = None) -> None:
        """`lease`: the node's Lease renewer (nodeagent.agent.build_node_controller)."""
        c = config
        self.spec = spec
        self.name = spec.name
        self.config = c
        self.kube = c.kube
        self.clock = c.clock
        self.metrics = c.metrics
        self.base = c.heartbeat  # from flags/config; the annotation overrides it
        self.heartbeat = c.heartbeat
        self.policy_name: str | None = None
        self.settings = c.status  # the agent replaces it when the config file changes
        self.probe = c.probe
        self.rng = rng or random.Random()
        # virtual nodes registered together: the tick after the first report comes at a
        # random point of the period (earlier, never later), so their ticks spread over
        # it: a change all of them see at once (an image the shared runtime now holds)
        # is then 100 status writes over 10 s, not 100 within a few milliseconds
        self._spread_tick = c.started_together
        self.images = c.images
        self.readiness = c.readiness
        self.pressure = c.pressure
        self.legacy = c.legacy
        self.status_call = c.status_call
        self.renewals = c.renewals
        self.ticker = c.ticker
        self.lease = lease
        self.registered = False
        # the Node is known to exist (the node watch showed it): its Lease is renewed
        # from then on, whether or not this process has registered it yet
        self.exists = False
        self.uid: str | None = None
        self.reported: Status | None = None  # what the server has, as we last wrote it
        self.reported_version: str | None = None  # resourceVersion our last write returned
        self.computed: Status | None = None
        self.seen: SeenNode | None = None  # None: the watch has not shown the Node yet
        self.last_full_report: float | None = None
        self.last_status_write: float | None = None
        self._next_tick: float | None = None
        self.started = c.clock.monotonic()

    # -- lifecycle, driven by the agent --
    def start(self) -> None:
        self.ticker.schedule(self.name, self.clock.monotonic())

    def stop(self) -> None:
        self.ticker.cancel(self.name)
        self.renewals.cancel(self.name)

    def deleted(self) -> None:
        """The Node was deleted (by someone else): register it again."""
        log.warning("node %s: deleted; it will be registered again", self.name)
        self.registered = self.exists = False
        self.uid = None
        self.config.uids.pop(self.name, None)
        self.renewals.cancel(self.name)

    def health(self) -> str | None:
        if self.legacy:
            last = self.last_status_write if self.last_status_write is not None else self.started
            limit = 4 * self.heartbeat.statusUpdateFrequencySeconds
            if self.clock.monotonic() - last > limit:
                return f"node {self.name}: no status written for over {limit}s"
            return None
        return self.lease.health()

    # -- registration --
    def node_object(self) -> Obj:
        body: Obj = {"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": self.name, "labels": dict(self.labels())}}
        spec: Obj = {}
        if self.spec.taints:
            spec["taints"] = self.registered_taints()
        if self.spec.provider_id:
            spec["providerID"] = self.spec.provider_id
        if spec:
            body["spec"] = spec
        return body

    def registered_taints(self) -> list[Obj]:
        return [dict(t) for t in self.spec.taints]

    def labels(self) -> dict[str, str]:
        try:
            r = self.probe()
            os_name, arch = r.operatingSystem, r.architecture
        except HostReadError:
            os_name, arch = "linux", "amd64"
        return {"kubernetes.io/hostname": self.name, "kubernetes.io/os": os_name,
                "kubernetes.io/arch": arch, AGENT_LABEL: self.spec.agent_id,
                **self.spec.labels}

    def admission_node(self) -> Obj | None:
        """The Node as pod admission reads it: its labels and taints as the API has them
        (before the watch has shown it: those it registers with); its allocatable
        as this agent computes it, over the API's (which holds the extended resources
        others advertise). None when the host cannot be read and nothing was computed
        yet."""
        seen = self.seen or AS_REGISTERED
        ours = self._allocatable()
        if ours is None:
            try:
                ours = allocatable(self.probe(), self.settings)
            except HostReadError:
                return None
        taints = self.registered_taints() if seen.taints is None else seen.taints
        return {"metadata": {"name": self.name, "labels": seen.labels or self.labels()},
                "spec": {"taints": taints},
                "status": {"allocatable": {**(seen.allocatable or {}), **ours}}}

    def _allocatable(self) -> Mapping[str, Any] | None:
        return (self.computed or self.reported or {}).get("allocatable")

    async def _register(self) -> Obj:
        """Create the Node, or adopt the one there (our labels win)."""
        t = self.REQUEST_TIMEOUT
        try:
            node = await self.kube.get(NODES, self.name, timeout=t)
        except ApiError as e:
            if e.status != 404:
                raise
            try:
                body = await self.status_call(self.node_object)  # reads the host
                node = await self.kube.create(NODES, body, timeout=t)
                log.info("node %s: registered", self.name)
                return node
            except ApiError as e2:
                if e2.status != 409:
                    raise
                node = await self.kube.get(NODES, self.name, timeout=t)
        want = await self.status_call(self.labels)
        have = (node.get("metadata") or {}).get("labels") or {}
        patch: Obj = {}
        if any(have.get(k) != v for k, v in want.items()):
            patch["metadata"] = {"labels": want}
        if self.spec.provider_id and not (node.get("spec") or {}).get("providerID"):
            patch["spec"] = {"providerID": self.spec.provider_id}
        if patch:
            node = await self.kube.patch(NODES, self.name, patch, timeout=t)
        log.info("node %s: adopted existing Node", self.name)
        return node

    # -- status: the ticker's job --
    async def tick(self) -> float | None:
        now = self.clock.monotonic()
        every = self.heartbeat.statusUpdateFrequencySeconds
        if not self.registered:
            try:
                node = await self._register()
            except Exception as e:
                log.warning("node %s: registration failed, retrying: %s", self.name, brief(e))
                return self.clock.monotonic() + min(every, 5.0)
            was_renewing = self.exists
            self.registered = self.exists = True
            self.reported = self.reported_version = None
            self.last_full_report = None
            self.uid = None
            self.on_node(node)  # its UID among the rest
            if not self.legacy and not was_renewing:
                self.renewals.schedule(self.name, self.clock.monotonic())
        await self._report()
        # fixed rate: the next tick is one period after this one was due
        base = self._next_tick if self._next_tick is not None and self._next_tick <= now else now
        self._next_tick = base + self.heartbeat.statusUpdateFrequencySeconds
        if self._next_tick <= self.clock.monotonic():
            self._next_tick = self.clock.monotonic() + self.heartbeat.statusUpdateFrequencySeconds
        if self._spread_tick:
            self._spread_tick = False
            self._next_tick = spread_before(self.clock.monotonic(), self._next_tick, self.rng)
        return self._next_tick

    def _compute(self) -> Status:
        """Blocking: host readings, images, readiness, pressure -> a full NodeStatus."""
        readings: HostReadings | HostReadError
        try:
            readings = self.probe()
        except HostReadError as e:
            readings = e
        images: Sequence[Mapping[str, Any]] = []
        not_ready = None
        if self.images is not None:
            try:
                images = self.images()
            except Exception as e:
                not_ready = f"listing images failed: {e}"
                images = (self.computed or {}).get("images", [])
        if self.readiness is not None:
            not_ready = self.readiness() or not_ready
        settings = dataclasses.replace(self.settings,
                                       max_images=self.heartbeat.maxImagesInStatus)
        pressure = self.pressure(self.name) if self.pressure is not None else None
        return compute_status(readings, settings, images, self.clock.now(),
                              previous=self.computed, not_ready=not_ready, pressure=pressure)

    async def _report(self) -> None:
        new = await self.status_call(self._compute)
        self.computed = new
        now = self.clock.monotonic()
        if self.legacy:
            reason: str | None = "legacy"
            body = build_patch(None, new, ["all"], True)
        else:
            changes = meaningful_changes(self.reported, new)
            reason = report_reason(now, self.last_full_report, bool(changes),
                                   self.heartbeat.statusReportFrequencySeconds,
                                   self.heartbeat.statusUpdateFrequencySeconds)
            if reason is None:
                # `new` differs from what the server has only in heartbeat times and
                # messages: keep one status per node, not two (thousands of nodes)
                self.computed = self.reported
                return
            body = build_patch(self.reported, new, changes, full=reason != "change")
            if reason == "change":
                log.info("node %s: status changed: %s", self.name, ", ".join(changes))
        try:
            written = await self.kube.patch(NODES, self.name, body, subresource="status",
                                            timeout=self.REQUEST_TIMEOUT)
        except ApiError as e:
            self.metrics.status_errors.inc()
            if e.status == 404:
                log.warning("node %s: Node is gone; registering again", self.name)
                self.registered = self.exists = False
                self.renewals.cancel(self.name)
                return
            log.warning("node %s: status patch failed: %s", self.name, brief(e))
            return
        except Exception as e:
            self.metrics.status_errors.inc()
            log.warning("node %s: status patch failed: %s", self.name, brief(e))
            return
        self.metrics.status_reports.labels(reason).inc()
        self.metrics.status_patch_bytes.observe(len(json.dumps(body).encode()))
        self.reported = new
        self.reported_version = (written.get("metadata") or {}).get("resourceVersion")
        self.last_status_write = now
        if reason != "change":
            self.last_full_report = now

    # -- lease: the renewal scheduler's job --
    async def renew(self) -> float | None:
        if self.legacy or not self.exists:
            return None
        return await self.lease.renew()

    # -- policy: the node watch hands us our Node --
    def on_node(self, node: Obj) -> None:
        meta = node.get("metadata") or {}
        labels = meta.get("labels") or {}
        taints = (node.get("spec") or {}).get("taints") or []
        node_allocatable = (node.get("status") or {}).get("allocatable") or {}
        seen = SeenNode(None if labels == self.labels() else dict(labels),
                        None if taints == self.registered_taints() else list(taints),
                        None if node_allocatable == self._allocatable() else dict(node_allocatable))
        self.seen = AS_REGISTERED if seen == AS_REGISTERED else seen
        if not self.exists and not self.legacy and meta.get("uid"):
            # an agent started again: its Nodes are there, and their Leases must not
            # wait for registration, which queues behind other nodes' status writes
            self.exists = True
            self.lease.owner_uid = str(meta["uid"])
            self.renewals.schedule(self.name, self.clock.monotonic())
        self._follow_uid(meta.get("uid"))
        self.apply_annotation((meta.get("annotations") or {}).get(HEARTBEAT_ANNOTATION))
        self._follow_api_conditions(node)

    def _follow_uid(self, uid: str | None) -> None:
        """The Node's UID, for what points at the Node (the Lease, mirror pods, Events):
        learnt at registration, and followed here should the Node be re-created by
        someone else between two of the watch's events."""
        if not uid or uid == self.uid or not self.registered:
            return
        self.uid = self.lease.owner_uid = uid
        self.config.uids[self.name] = uid

    def _follow_api_conditions(self, node: Obj) -> None:
        """Others write our conditions too: the operator sets Ready=Unknown when our
        Lease looked stale. Take the API's conditions as what was last reported, so the
        next tick writes ours back where they differ, as a kubelet compares with the
        Node it reads. Events older than our last write are not news."""
        if self.reported is None or _older(node, self.reported_version):
            return
        theirs = (node.get("status") or {}).get("conditions") or []
        if meaningful_changes({"conditions": theirs},
                              {"conditions": self.reported.get("conditions", [])}):
            log.info("node %s: conditions were changed in the API; reporting ours again",
                     self.name)
            self.reported = {**self.reported, "conditions": theirs}

    def apply_annotation(self, value: str | None) -> None:
        if value is None:
            if self.policy_name is not None:
                log.info("node %s: heartbeat annotation removed; back to local settings",
                         self.name)
                self.metrics.policy_updates.labels("cleared").inc()
                self.policy_name = None
                self.set_heartbeat(self.base)
            return
        try:
            name, hb = decode_heartbeat_annotation(value)
        except PolicyError as e:
            self.metrics.policy_updates.labels("refused").inc()
            log.warning("node %s: refused heartbeat settings, keeping the last good ones: %s",
                        self.name, e)
            return
        if hb == self.heartbeat and name == self.policy_name:
            return
        self.metrics.policy_updates.labels("applied").inc()
        log.info("node %s: heartbeat settings from policy %r: %s", self.name, name, hb)
        self.policy_name = name
        self.set_heartbeat(hb)

    def set_heartbeat(self, hb: Heartbeat) -> None:
        old = self.heartbeat
        self.heartbeat = hb
        self.lease.heartbeat = hb
        if old == hb:
            return
        # Take effect now, not after the current (old) interval runs out.
        if self.exists and not self.legacy and not self.renewals.running(self.name):
            self.renewals.schedule(self.name, self.lease.replan())
        planned = self.ticker.due(self.name)
        if self._next_tick is not None and planned is not None:
            sooner = self._next_tick - old.statusUpdateFrequencySeconds \
                + hb.statusUpdateFrequencySeconds
            if sooner < planned:
                self._next_tick = sooner
                self.ticker.schedule(self.name, sooner)


def _older(node: Obj, version: str | None) -> bool:
    """True when `node` predates the resourceVersion our last write returned. Versions
    are opaque in general but integers from etcd, the only store the API server has."""
    try:
        return version is not None and int(node["metadata"]["resourceVersion"]) < int(version)
    except (KeyError, TypeError, ValueError):
        return False
