"""The operator's monitor on a fake API server, for the unit tests: Nodes, Leases and
policies held as the API server would hold them (FakeApi), a monitor over them on
FakeClock (`run`), and what an agent does to its Node (register, post conditions,
post Ready)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Coroutine
from typing import Any

from nodeoperator.modes import EXCLUSIVE, Lifecycle
from nodeoperator.monitor import Monitor
from nodeoperator.state import UNREACHABLE_TAINT, Store

from nodeagent.api.client import ApiError
from nodeagent.api.clock import FakeClock

NOT_READY = "node.kubernetes.io/not-ready"
ADMISSION = {"key": NOT_READY, "effect": "NoSchedule"}  # what TaintNodesByCondition adds

# the controller manager's node-lifecycle controller off: the operator does it all
ALONE = Lifecycle(EXCLUSIVE)


class FakeApi:
    """Nodes, Leases and policies as the API server would hold them. Writes bump the
    resourceVersion; the watch is simulated by `deliver`, which the tests call (or not,
    to show a write that has not come back yet)."""

    def __init__(self, store: Store, clock: FakeClock) -> None:
        self.store, self.clock = store, clock
        self.nodes: dict[str, dict[str, Any]] = {}
        self.policies: dict[str, dict[str, Any]] = {}
        self.rv = 100
        self.writes: list[tuple[str, str, dict[str, Any]]] = []
        self.auto_deliver = True
        self.leases: dict[str, str] = {}  # node -> the renewTime of its Lease

    def _bump(self, obj: dict[str, Any]) -> str:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return str(self.rv)

    def add_node(self, name: str, labels: dict[str, str] | None = None,
                 ready: str | None = "True") -> None:
        body: dict[str, Any] = {"metadata": {"name": name, "labels": labels or {}},
                                "spec": {}, "status": {}}
        if ready:
            body["status"]["conditions"] = [
                {"type": "Ready", "status": ready, "reason": "AgentReady",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z"},
                {"type": "MemoryPressure", "status": "False"}]
        self._bump(body)
        self.nodes[name] = body
        self.store.node_event("ADDED", copy.deepcopy(body))

    def renew(self, name: str) -> None:
        self.leases[name] = self.clock.now().isoformat()
        self.store.lease_event("MODIFIED", {
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {"renewTime": self.leases[name]}})

    def add_policy(self, name: str, spec: dict[str, Any], generation: int = 1) -> None:
        body = {"metadata": {"name": name, "generation": generation}, "spec": spec,
                "status": self.policies.get(name, {}).get("status", {})}
        self._bump(body)
        self.policies[name] = body
        self.store.policy_event("ADDED", copy.deepcopy(body))

    def delete_policy(self, name: str) -> None:
        body = self.policies.pop(name)
        self.store.policy_event("DELETED", body)

    def deliver(self) -> None:
        for body in self.nodes.values():
            self.store.node_event("MODIFIED", copy.deepcopy(body))
        for body in self.policies.values():
            self.store.policy_event("MODIFIED", copy.deepcopy(body))

    # ---- Writer
    async def patch_node(self, name: str, patch: dict[str, Any]) -> str:
        node = self.nodes[name]
        meta = patch.get("metadata", {})
        if "resourceVersion" in meta and meta["resourceVersion"] != node["metadata"][
                "resourceVersion"]:
            raise ApiError(status=409, reason="Conflict")
        self.writes.append(("node", name, patch))
        annotations = node["metadata"].setdefault("annotations", {})
        for key, value in meta.get("annotations", {}).items():
            if value is None:  # strategic merge: null removes the key
                annotations.pop(key, None)
            else:
                annotations[key] = value
        if "spec" in patch:
            node["spec"]["taints"] = patch["spec"]["taints"]
        rv = self._bump(node)
        if self.auto_deliver:
            self.store.node_event("MODIFIED", copy.deepcopy(node))
        return rv

    async def patch_node_status(self, name: str, patch: dict[str, Any]) -> str:
        node = self.nodes[name]
        rv = patch.get("metadata", {}).get("resourceVersion")
        if rv is not None and rv != node["metadata"]["resourceVersion"]:
            raise ApiError(status=409, reason="Conflict")
        self.writes.append(("node_status", name, patch))
        conds = {c["type"]: c for c in node["status"].get("conditions", [])}
        for c in patch["status"]["conditions"]:
            conds[c["type"]] = c
        node["status"]["conditions"] = list(conds.values())
        rv = self._bump(node)
        if self.auto_deliver:
            self.store.node_event("MODIFIED", copy.deepcopy(node))
        return rv

    async def patch_policy_status(self, name: str, patch: dict[str, Any]) -> str:
        self.writes.append(("policy_status", name, patch))
        body = self.policies[name]
        body["status"] = patch["status"]
        rv = self._bump(body)
        if self.auto_deliver:
            self.store.policy_event("MODIFIED", copy.deepcopy(body))
        return rv

    # ---- views
    def taints(self, name: str) -> set[str]:
        return {t["effect"] for t in self.nodes[name]["spec"].get("taints", [])
                if t["key"] == UNREACHABLE_TAINT}

    def ready(self, name: str) -> dict[str, Any]:
        return next(c for c in self.nodes[name]["status"]["conditions"] if c["type"] == "Ready")

    def condition(self, policy: str, ctype: str) -> dict[str, Any]:
        conds = self.policies[policy]["status"]["conditions"]
        return next(c for c in conds if c["type"] == ctype)


Env = tuple[FakeClock, Store, FakeApi, Monitor]


def run(test: Callable[[Env], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        store.lease_sync(set())  # the Lease watch's first list, empty: Leases come later
        api = FakeApi(store, clock)
        await test((clock, store, api, Monitor(store, clock, api, lifecycle=ALONE, period=2)))
    asyncio.run(main())


def spec(grace: int = 15, lease: int = 10, sel: dict[str, Any] | None = None,
         priority: int = 0, **failure: Any) -> dict[str, Any]:
    return {"nodeSelector": sel or {}, "priority": priority,
            "heartbeat": {"leaseDurationSeconds": lease},
            "failure": {"gracePeriodSeconds": grace, **failure}}


async def step(clock: FakeClock, mon: Monitor, seconds: float) -> None:
    await clock.advance(seconds)
    await mon.tick()


# ---- what an agent does to its Node
def post_ready(api: FakeApi, name: str, deliver: bool = True) -> None:
    """The agent posts Ready=True with a fresh heartbeat."""
    node = api.nodes[name]
    conds = [c for c in node["status"]["conditions"] if c["type"] != "Ready"]
    node["status"]["conditions"] = [*conds, {
        "type": "Ready", "status": "True", "reason": "AgentReady",
        "lastHeartbeatTime": api.clock.now().strftime("%Y-%m-%dT%H:%M:%SZ")}]
    api._bump(node)
    if deliver:
        api.store.node_event("MODIFIED", copy.deepcopy(node))


def register(api: FakeApi, name: str, extra: list[dict[str, str]] | None = None) -> None:
    """The agent creates its Node; admission adds not-ready:NoSchedule; no status yet."""
    body: dict[str, Any] = {"metadata": {"name": name, "labels": {}},
                            "spec": {"taints": [*(extra or []), dict(ADMISSION)]},
                            "status": {}}
    api._bump(body)
    api.nodes[name] = body
    api.store.node_event("ADDED", copy.deepcopy(body))


def post(api: FakeApi, name: str, **statuses: str) -> None:
    """The agent posts conditions (merged by type, like a status patch)."""
    node = api.nodes[name]
    by_type = {c["type"]: c for c in node["status"].get("conditions", [])}
    for ctype, status in statuses.items():
        by_type[ctype] = {"type": ctype, "status": status, "reason": "Agent",
                          "lastHeartbeatTime": api.clock.now().isoformat()}
    node["status"]["conditions"] = list(by_type.values())
    api._bump(node)
    api.store.node_event("MODIFIED", copy.deepcopy(node))
