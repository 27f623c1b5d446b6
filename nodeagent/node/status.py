"""NodeStatus: computed from host readings, compared on what matters, patched sparingly.

Pure functions here (compute, meaningful difference, report decision, patch); the
per-node StatusReporter that drives them lives in reporter.py.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nodeagent.api.clock import api_time
from nodeagent.api.quantity import format_bytes, format_cpu
from nodeagent.node.host import HostReadError, HostReadings

CONDITION_TYPES = ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")

Status = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StatusSettings:
    max_pods: int = 110
    # resource name -> what its hard eviction threshold holds back from allocatable
    # (memory: memory.available's; ephemeral-storage: nodefs.available's), as
    # (bytes, percent of capacity)
    eviction_held: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # resource name -> amount held back from allocatable (cores for cpu, bytes otherwise):
    # --system-reserved and --kube-reserved together
    system_reserved: Mapping[str, float] = dataclasses.field(default_factory=dict)
    max_images: int = 50
    agent_version: str = ""
    runtime_version: str = ""
    kubelet_port: int = 0  # where the kubelet API listens; 0: not served


# condition -> (reason while True, reason while False, message while False): the
# kubelet's reasons. Whether a pressure condition holds is the eviction manager's word.
_PRESSURE = {
    "MemoryPressure": ("KubeletHasInsufficientMemory", "KubeletHasSufficientMemory",
                       "the node has sufficient memory available"),
    "DiskPressure": ("KubeletHasDiskPressure", "KubeletHasNoDiskPressure",
                     "the node has no disk pressure"),
    "PIDPressure": ("KubeletHasInsufficientPID", "KubeletHasSufficientPID",
                    "the node has sufficient PID available"),
}


class _Kept:
    """The parts of a status made from the same inputs as the last time, kept: virtual
    nodes share one host reading and one image list, so the statuses of a thousand
    nodes (computed and reported) hold one copy of capacity, allocatable, addresses,
    nodeInfo and images instead of two each, and a tick does not build them again.
    These objects are shared: nothing changes a status in place. A part equal to the
    one kept (a new reading, the same values) is the kept object too, which makes
    comparing them an identity check. One entry per kind; any thread may use it (a
    race only makes a part again)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, Any]] = {}  # kind -> (inputs, part)

    def get(self, kind: str, inputs: Any, same: Callable[[Any, Any], bool],
            make: Callable[[], Any]) -> Any:
        last = self._last.get(kind)
        if last is not None and same(last[0], inputs):
            return last[1]
        part = make()
        if last is not None:
            old = last[1]
            if isinstance(part, dict):  # parts by name: each one kept while equal
                part = {k: old[k] if k in old and old[k] == v else v for k, v in part.items()}
            elif part == old:
                part = old
        self._last[kind] = (inputs, part)
        return part


_kept = _Kept()


def _same_images(a: tuple[Sequence[Mapping[str, Any]], int],
                 b: tuple[Sequence[Mapping[str, Any]], int]) -> bool:
    return a[1] == b[1] and len(a[0]) == len(b[0]) and all(
        x is y for x, y in zip(a[0], b[0], strict=True))


def _images(images: Sequence[Mapping[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Largest first, at most `limit`, as the kubelet orders them (kept: see _Kept)."""
    return _kept.get("images", (list(images), limit), _same_images,
                     lambda: _make_images(images, limit))


def _make_images(images: Sequence[Mapping[str, Any]], limit: int) -> list[dict[str, Any]]:
    clean: list[dict[str, Any]] = []
    for img in images:
        names = [str(n) for n in (img.get("names") or [])]
        if names:
            clean.append({"names": names, "sizeBytes": int(img.get("sizeBytes") or 0)})
    clean.sort(key=lambda i: (-i["sizeBytes"], i["names"][0]))
    return clean[:limit]


def compute_status(readings: HostReadings | HostReadError, settings: StatusSettings,
                   images: Sequence[Mapping[str, Any]], now: dt.datetime,
                   previous: Status | None = None, not_ready: str | None = None,
                   pressure: Mapping[str, str] | None = None) -> Status:
    """The full NodeStatus. `previous` supplies lastTransitionTime for conditions whose
    status has not changed, and the last good values when the host cannot be read.
    `not_ready` is a reason from elsewhere (e.g. the runtime) to report Ready=False;
    `pressure` the pressure conditions that hold (the eviction manager's), each with
    why."""
    stamp = api_time(now)
    prev_conditions = {c["type"]: c for c in (previous or {}).get("conditions", [])}
    status: Status = {}
    statuses: dict[str, tuple[str, str, str]] = {}  # type -> (status, reason, message)
    if isinstance(readings, HostReadError):
        for key in ("capacity", "allocatable", "addresses", "nodeInfo"):
            if previous and key in previous:
                status[key] = previous[key]
        for ctype in CONDITION_TYPES[:-1]:
            statuses[ctype] = ("Unknown", "HostReadingsFailed", str(readings))
        statuses["Ready"] = ("False", "HostReadingsFailed", str(readings))
    else:
        r = readings
        for key, part in _host_parts(r, settings).items():
            status[key] = part
        pressure = pressure or {}
        for ctype, (yes, no, fine) in _PRESSURE.items():
            if ctype in pressure:
                statuses[ctype] = ("True", yes, pressure[ctype])
            else:
                statuses[ctype] = ("False", no, fine)
        if not_ready:
            statuses["Ready"] = ("False", "AgentNotReady", not_ready)
        else:
            statuses["Ready"] = ("True", "AgentReady", "nodepulse agent is posting ready status")
    status["images"] = _images(images, settings.max_images)
    if settings.kubelet_port:
        status["daemonEndpoints"] = {"kubeletEndpoint": {"Port": settings.kubelet_port}}
    conditions = []
    for ctype in CONDITION_TYPES:
        st, reason, message = statuses[ctype]
        prev = prev_conditions.get(ctype)
        since = prev["lastTransitionTime"] if prev and prev.get("status") == st else stamp
        conditions.append({"type": ctype, "status": st, "reason": reason, "message": message,
                           "lastHeartbeatTime": stamp, "lastTransitionTime": since})
    status["conditions"] = conditions
    return status


def _host_parts(r: HostReadings, settings: StatusSettings) -> dict[str, Any]:
    """capacity, allocatable, addresses and nodeInfo of a reading (kept: see _Kept)."""
    inputs = (r, settings.max_pods, tuple(settings.system_reserved.items()),
              tuple(settings.eviction_held.items()),
              settings.runtime_version, settings.agent_version)
    kept: dict[str, Any] = _kept.get(
        "host", inputs, lambda a, b: a[0] is b[0] and a[1:] == b[1:],
        lambda: _make_host_parts(r, settings))
    return kept


def _capacity(r: HostReadings, settings: StatusSettings) -> dict[str, float]:
    return {"cpu": r.cpu, "memory": float(r.memoryTotal),
            "ephemeral-storage": float(r.fsTotal), "pods": float(settings.max_pods)}


def allocatable(r: HostReadings, settings: StatusSettings) -> dict[str, str]:
    """What pods may be given of the node, as the kubelet's: its capacity less what is
    reserved and the hard eviction thresholds of memory and the node's filesystem."""
    capacity = _capacity(r, settings)

    def held(k: str) -> float:
        amount, percent = settings.eviction_held.get(k, (0.0, 0.0))
        return float(int(amount + capacity[k] * percent / 100))
    return _format_resources({
        k: max(0.0, v - settings.system_reserved.get(k, 0.0) - held(k))
        for k, v in capacity.items()})


def _make_host_parts(r: HostReadings, settings: StatusSettings) -> dict[str, Any]:
    return {
        "capacity": _format_resources(_capacity(r, settings)),
        "allocatable": allocatable(r, settings),
        "addresses": [{"type": t, "address": a} for t, a in r.addresses],
        "nodeInfo": {
            "machineID": r.machineID, "systemUUID": r.systemUUID, "bootID": r.bootID,
            "kernelVersion": r.kernelVersion, "osImage": r.osImage,
            "containerRuntimeVersion": settings.runtime_version,
            "kubeletVersion": settings.agent_version, "kubeProxyVersion": "",
            "operatingSystem": r.operatingSystem, "architecture": r.architecture,
        },
    }


def _format_resources(values: Mapping[str, float]) -> dict[str, str]:
    return {k: format_cpu(v) if k == "cpu" else
            str(int(v)) if k == "pods" else format_bytes(int(v)) for k, v in values.items()}


# the parts compared whole: how a missing one reads, and what of it counts
_PARTS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "capacity": (dict, dict), "allocatable": (dict, dict), "nodeInfo": (dict, dict),
    "daemonEndpoints": (dict, dict),
    "addresses": (list, lambda v: [(a.get("type"), a.get("address")) for a in v]),
    "images": (list, lambda v: [(tuple(i.get("names", [])), i.get("sizeBytes")) for i in v]),
}


def _conditions(status: Status) -> dict[str, tuple[Any, Any]]:
    """What counts of the conditions: heartbeat times and messages do not."""
    return {f"conditions/{c['type']}": (c.get("status"), c.get("reason"))
            for c in status.get("conditions", [])}


def meaningful_changes(old: Status | None, new: Status) -> list[str]:
    """Names of what changed meaningfully, e.g. ['conditions/DiskPressure', 'images']."""
    if old is None:
        return ["all"]
    a, b = _conditions(old), _conditions(new)
    changed = [k for k in a.keys() | b.keys() if a.get(k) != b.get(k)]
    for key, (empty, counted) in _PARTS.items():
        x, y = old.get(key), new.get(key)
        if x is not y and counted(x or empty()) != counted(y or empty()):
            changed.append(key)
    return sorted(changed)


def report_reason(now: float, last_full_report: float | None, changed: bool,
                  report_every: float, update_every: float) -> str | None:
    """Why to PATCH now, or None. The report period is checked at update ticks; it is
    due at the tick nearest to it, so tick jitter cannot push it a whole tick late."""
    if last_full_report is None:
        return "register"
    if now - last_full_report + update_every / 2 >= report_every:
        return "period"
    if changed:
        return "change"
    return None


def build_patch(old: Status | None, new: Status, changes: Sequence[str], full: bool) -> Status:
    """A strategic-merge patch of the status subresource. A full report sends every
    condition (fresh heartbeat times) and anything changed; a change sends only what
    changed."""
    if old is None:
        return {"status": new}
    body: Status = {}
    changed = set(changes)
    ctypes = {c.split("/", 1)[1] for c in changed if c.startswith("conditions/")}
    conds = [c for c in new["conditions"] if full or c["type"] in ctypes]
    if conds:
        body["conditions"] = conds
    for key in ("capacity", "allocatable"):
        if key in changed:
            gone = {k: None for k in old.get(key, {}) if k not in new.get(key, {})}
            body[key] = {**gone, **new.get(key, {})}
    if "nodeInfo" in changed:
        before = old.get("nodeInfo", {})
        body["nodeInfo"] = {k: v for k, v in new.get("nodeInfo", {}).items() if before.get(k) != v}
    if "addresses" in changed:
        # the list merges by type; replace it whole so a removed address goes away
        body["addresses"] = [{"$patch": "replace"}, *new.get("addresses", [])]
    if "images" in changed:
        body["images"] = new.get("images", [])  # atomic list
    if "daemonEndpoints" in changed:
        body["daemonEndpoints"] = new.get("daemonEndpoints") or {}
    return {"status": body}
