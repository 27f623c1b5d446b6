"""Usage for /stats/summary (the kubelet's Summary API, stats/v1alpha1) and
/metrics/resource (what metrics-server scrapes for `kubectl top` and the HPA).

Containers: the runtime's own measurements (CRI ListContainerStats); a runtime that
measures nothing gives pods without usage, and /metrics/resource says so with
resource_scrape_error 1. The node: /proc/stat (CPU time, all CPUs, idle and iowait
left out) and /proc/meminfo (working set: used memory less the inactive page cache,
the same measure the kubelet takes from the root cgroup). Rates (usageNanoCores) come
from the previous sample of the same container or node.

A runtime whose containers are simulated (the fake runtime: virtual nodes) has nodes
whose usage is simulated too (SimulatedNode): a node uses what its pods use plus a base
(its own daemons), and its CPU counter keeps what pods that have gone used, so it never
runs backwards. The host's readings stay the node conditions' source: simulated usage
is never pressure.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from nodeagent.api.clock import Clock, api_time
from nodeagent.runtime.base import ContainerRuntimeError, ContainerStats, Runtime
from nodeagent.runtime.usage import NONE, Usage
from nodeagent.server.podhost import PodHost

log = logging.getLogger(__name__)
# a pod and its running containers, each with what the runtime measured (or None)
PodUsage = tuple[dict[str, Any], list[tuple[Any, ContainerStats | None]]]


def read_node(proc: str = "/proc") -> dict[str, float]:
    """cpu_seconds (cumulative, busy), memory total, usage, working set and available
    bytes, boot time (unix seconds)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    with open(os.path.join(proc, "stat")) as f:
        for line in f:
            if line.startswith("cpu "):
                v = [int(x) for x in line.split()[1:]]
                idle = v[3] + (v[4] if len(v) > 4 else 0)
                # guest time is already counted in user and nice
                total = sum(v[:8]) if len(v) >= 8 else sum(v)
                out["cpu_seconds"] = (total - idle) / tick
            elif line.startswith("btime "):
                out["boot_time"] = float(line.split()[1])
    mem: dict[str, int] = {}
    with open(os.path.join(proc, "meminfo")) as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields:
                mem[key] = int(fields[0]) * 1024
    usage = mem.get("MemTotal", 0) - mem.get("MemFree", 0)
    out["memory_total"] = mem.get("MemTotal", 0)
    out["memory_usage"] = usage
    out["memory_working_set"] = max(0, usage - mem.get("Inactive(file)", 0))
    out["memory_available"] = mem.get("MemAvailable", 0)
    return out


@dataclasses.dataclass(frozen=True)
class SimulatedNode:
    """A node's own usage beyond its pods' (cores, bytes; time from the agent's start),
    and the memory it has (what availableBytes is counted from)."""
    cpu: Usage = NONE
    memory: Usage = NONE
    memory_capacity: float = 0.0


class StatsProvider:
    def __init__(self, host: PodHost, runtime: Runtime, clock: Clock,
                 node_reader: Callable[[], dict[str, float]] | None = None,
                 simulated: SimulatedNode | None = None) -> None:
        self.host = host
        self.runtime = runtime
        self.clock = clock
        self.node_reader = node_reader or read_node
        self.simulated = simulated
        self.started = clock.now()
        self._last: dict[str, tuple[float, float]] = {}  # id -> (time, cpu seconds)
        # simulated nodes: node -> {container id: its last CPU seconds}, and what the
        # containers that have gone used in all
        self._node_containers: dict[str, dict[str, float]] = {}
        self._retired_cpu: dict[str, float] = {}
        self._measurement: tuple[float, dict[str, ContainerStats], bool] | None = None

    def _simulated_node(self, node: str, pods: list[PodUsage]) -> dict[str, float]:
        """The node's readings as read_node gives them: its pods' usage plus the base."""
        assert self.simulated is not None
        t = (self.clock.now() - self.started).total_seconds()
        current = {c.id: st for _, cs in pods for c, st in cs if st is not None}
        seen = self._node_containers.setdefault(node, {})
        for cid in [cid for cid in seen if cid not in current]:
            self._retired_cpu[node] = self._retired_cpu.get(node, 0.0) + seen.pop(cid)
        for cid, st in current.items():
            seen[cid] = st.cpu_usage_core_seconds or 0.0
        cpu = self.simulated.cpu.integral(t) + self._retired_cpu.get(node, 0.0) \
            + sum(seen.values())
        memory = self.simulated.memory.at(t) + sum(st.memory_working_set_bytes or 0
                                                   for st in current.values())
        return {"cpu_seconds": cpu, "memory_usage": memory, "memory_working_set": memory,
                "memory_available": max(0.0, self.simulated.memory_capacity - memory),
                "boot_time": self.started.timestamp()}

    def _node(self, node: str, pods: list[PodUsage]) -> dict[str, float]:
        return self.node_reader() if self.simulated is None else \
            self._simulated_node(node, pods)

    def _rate(self, key: str, t: float, cpu: float | None) -> int | None:
        """Nano-cores since the previous sample of `key`."""
        if cpu is None:
            return None
        prev = self._last.get(key)
        self._last[key] = (t, cpu)
        if prev is None or t <= prev[0] or cpu < prev[1]:
            return None
        return int((cpu - prev[1]) / (t - prev[0]) * 1e9)

    async def _measured(self) -> tuple[dict[str, ContainerStats], bool]:
        """The runtime's measurements by container id, and whether it could measure;
        one measurement serves the requests of the same second (metrics-server asks
        every virtual node of a process, each at its own port, at about the same time)."""
        now = self.clock.monotonic()
        if self._measurement is not None and now - self._measurement[0] < 1.0:
            return self._measurement[1], self._measurement[2]
        try:
            measured = {s.container_id: s for s in await self.runtime.container_stats()}
            ok = True
        except ContainerRuntimeError as e:
            log.debug("container stats: %s", e)
            measured, ok = {}, False
        self._measurement = (now, measured, ok)
        return measured, ok

    async def _containers(self, node: str | None = None) -> tuple[list[PodUsage], bool]:
        """[(pod, [(container, its stats or None)])] for every pod bound here (to
        `node`, when named), and whether the runtime could measure."""
        measured, ok = await self._measured()
        out = []
        for pod in self.host.all_pods() if node is None else self.host.node_pods(node):
            uid = (pod.get("metadata") or {}).get("uid", "")
            rs = self.host.runtime_pod(uid)
            latest: dict[str, Any] = {}
            for c in rs.containers:
                if c.state == "RUNNING" and (c.name not in latest
                                             or c.attempt > latest[c.name].attempt):
                    latest[c.name] = c
            out.append((pod, [(c, measured.get(c.id)) for c in latest.values()]))
        return out, ok

    async def summary(self, node_names: Sequence[str], only_cpu_and_memory: bool = False,
                      node_name: str | None = None) -> dict[str, Any]:
        """The Summary of `node_name` and its pods (a virtual node's own port), else of
        every pod here: the node is named when `node_names` has only one."""
        now = self.clock.now()
        t = now.timestamp()
        stamp = api_time(now)
        one = node_name or (node_names[0] if len(node_names) == 1 else None)
        pods, _ = await self._containers(node_name)
        node = self._node(one or "", pods)
        out_pods = []
        seen: set[str] = set()
        for pod, containers in pods:
            meta = pod.get("metadata") or {}
            cs = []
            pod_cpu = pod_mem = 0.0
            pod_rate = 0
            measured = False
            for c, st in containers:
                entry: dict[str, Any] = {"name": c.name}
                if c.started_at:
                    entry["startTime"] = api_time(c.started_at)
                if st is not None:
                    measured = True
                    seen.add(c.id)
                    ts = api_time(st.timestamp)
                    rate = self._rate(c.id, st.timestamp.timestamp(), st.cpu_usage_core_seconds)
                    cpu: dict[str, Any] = {"time": ts}
                    if st.cpu_usage_core_seconds is not None:
                        cpu["usageCoreNanoSeconds"] = int(st.cpu_usage_core_seconds * 1e9)
                        pod_cpu += st.cpu_usage_core_seconds
                    if rate is not None:
                        cpu["usageNanoCores"] = rate
                        pod_rate += rate
                    mem: dict[str, Any] = {"time": ts}
                    for key, value in (("workingSetBytes", st.memory_working_set_bytes),
                                       ("usageBytes", st.memory_usage_bytes),
                                       ("rssBytes", st.memory_rss_bytes)):
                        if value is not None:
                            mem[key] = value
                    pod_mem += st.memory_working_set_bytes or 0
                    entry["cpu"], entry["memory"] = cpu, mem
                    if st.writable_layer_bytes is not None and not only_cpu_and_memory:
                        entry["rootfs"] = {"time": ts, "usedBytes": st.writable_layer_bytes}
                cs.append(entry)
            p: dict[str, Any] = {"podRef": {"name": meta.get("name"),
                                            "namespace": meta.get("namespace", "default"),
                                            "uid": meta.get("uid")},
                                 "containers": cs}
            start = (pod.get("status") or {}).get("startTime")
            if start:
                p["startTime"] = start
            if measured:
                p["cpu"] = {"time": stamp, "usageCoreNanoSeconds": int(pod_cpu * 1e9),
                            "usageNanoCores": pod_rate}
                p["memory"] = {"time": stamp, "workingSetBytes": int(pod_mem)}
            out_pods.append(p)
        for key in [k for k in self._last if k not in seen and not k.startswith("node/")]:
            del self._last[key]
        node_rate = self._rate(f"node/{one or ''}", t, node.get("cpu_seconds"))
        node_cpu: dict[str, Any] = {"time": stamp,
                                    "usageCoreNanoSeconds": int(node["cpu_seconds"] * 1e9)}
        if node_rate is not None:
            node_cpu["usageNanoCores"] = node_rate
        summary_node: dict[str, Any] = {
            "nodeName": one or "",
            "cpu": node_cpu,
            "memory": {"time": stamp, "availableBytes": int(node["memory_available"]),
                       "usageBytes": int(node["memory_usage"]),
                       "workingSetBytes": int(node["memory_working_set"])}}
        if "boot_time" in node:
            booted = dt.datetime.fromtimestamp(node["boot_time"], dt.UTC)
            summary_node["startTime"] = api_time(booted)
        return {"node": summary_node, "pods": out_pods}

    async def resource_metrics(self, node_name: str | None = None) -> str:
        """The kubelet's /metrics/resource, in Prometheus text with sample times (ms):
        of `node_name` and its pods, or of every pod here."""
        now_ms = int(self.clock.now().timestamp() * 1000)
        pods, ok = await self._containers(node_name)
        node = self._node(node_name or "", pods)
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float, int]]
                   ) -> None:
            lines.append(f"# HELP {name} [STABLE] {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {value!r} {ms}" for labels, value, ms in samples)

        cpu: list[tuple[str, float, int]] = []
        mem: list[tuple[str, float, int]] = []
        start: list[tuple[str, float, int]] = []
        pod_cpu: list[tuple[str, float, int]] = []
        pod_mem: list[tuple[str, float, int]] = []
        for pod, containers in pods:
            meta = pod.get("metadata") or {}
            ns, name = _escape(meta.get("namespace", "default")), _escape(meta.get("name", ""))
            total_cpu = total_mem = 0.0
            last_ms = 0
            for c, st in containers:
                labels = f'{{container="{_escape(c.name)}",namespace="{ns}",pod="{name}"}}'
                if c.started_at:
                    start.append((labels, c.started_at.timestamp(), now_ms))
                if st is None:
                    continue
                ms = int(st.timestamp.timestamp() * 1000)
                last_ms = max(last_ms, ms)
                if st.cpu_usage_core_seconds is not None:
                    cpu.append((labels, st.cpu_usage_core_seconds, ms))
                    total_cpu += st.cpu_usage_core_seconds
                if st.memory_working_set_bytes is not None:
                    mem.append((labels, float(st.memory_working_set_bytes), ms))
                    total_mem += st.memory_working_set_bytes
            if last_ms:
                pod_labels = f'{{namespace="{ns}",pod="{name}"}}'
                pod_cpu.append((pod_labels, total_cpu, last_ms))
                pod_mem.append((pod_labels, total_mem, last_ms))
        family("container_cpu_usage_seconds_total", "counter",
               "Cumulative cpu time consumed by the container in core-seconds", cpu)
        family("container_memory_working_set_bytes", "gauge",
               "Current working set of the container in bytes", mem)
        family("container_start_time_seconds", "gauge",
               "Start time of the container since unix epoch in seconds", start)
        family("node_cpu_usage_seconds_total", "counter",
               "Cumulative cpu time consumed by the node in core-seconds",
               [("", node["cpu_seconds"], now_ms)])
        family("node_memory_working_set_bytes", "gauge",
               "Current working set of the node in bytes",
               [("", float(node["memory_working_set"]), now_ms)])
        family("pod_cpu_usage_seconds_total", "counter",
               "Cumulative cpu time consumed by the pod in core-seconds", pod_cpu)
        family("pod_memory_working_set_bytes", "gauge",
               "Current working set of the pod in bytes", pod_mem)
        lines.append("# HELP resource_scrape_error [STABLE] 1 if there was an error while "
                     "getting container metrics, 0 otherwise")
        lines.append("# TYPE resource_scrape_error gauge")
        lines.append(f"resource_scrape_error {0 if ok else 1}")
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
