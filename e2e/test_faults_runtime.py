"""Runtime faults on the real control plane (issue 9, faults 4, 5 and 7).

4. containerd restart: containerd is stopped by PID while the agent runs pods and
   started again on the same state and socket. The agent reports the runtime down
   (PLEG's nodepulse_pleg_runtime_up metric, the Node's Ready=False "container runtime
   is down"; /healthz, a liveness check, stays ok) and recovers; the containers that
   survived are adopted (same ids, same processes, restartCount unchanged) and none is
   duplicated. A container that died during the outage is restarted once (exit 137
   as its lastState), a pod created during the outage starts when containerd is back.
5. Agent SIGKILL at seeded random points of a burst of 50 pod creates plus deletes
   (restarted each time), then a final kill and restart: afterwards the runtime holds
   exactly what the API asks for, and the API's statuses name those very containers.
   Once with the process runtime, once with containerd (hostNetwork pods). Its graceful
   counterpart: SIGTERM while containerd starts 20 containers restarts none of them.
6. (7 in the issue) Slow runtime: the agent runs in this process (its asyncio entry
   point, the same Agent and Pods the CLI builds) on a process runtime whose
   pod_status call hangs for one pod; PLEG stays healthy, other pods are created,
   restarted and deleted meanwhile.

Agents run with node credentials (system:node:<name>); pods are bound with
spec.nodeName to a Node that registers with a NoSchedule taint nobody else tolerates.
Everything started here (agents, containerd, shims, containers) is stopped by PID and
swept by the NP_E2E=<node> marker every container carries (e2e/harness/nodeenv.py).

The burst's sequence (which pod is created or deleted when, and after which operation
the agent is killed) comes from random.Random(NODEPULSE_FAULT_SEED or 9); the seed is
printed, so a failure reproduces with the same sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry

from e2e.harness.nodeenv import (
    TAINT_KEY,
    Env,
    RtView,
    all_running,
    http_get,
    node_env,
    running,
    start_agent,
    workloads,
)
from e2e.harness.ports import free_port
from e2e.harness.processes import alive
from e2e.harness.waits import eventually, node_registered
from nodeagent.api.kube import RestKube
from nodeagent.runtime import PodRuntimeStatus
from nodeagent.runtime.process import ProcessRuntime
from nodepulse_dev import Cluster

SEED = int(os.environ.get("NODEPULSE_FAULT_SEED", "9"))
T = TypeVar("T")


# --- fault 4: containerd restart ----------------------------------------------------

def test_containerd_restart_runtime_down_then_survivors_adopted(
        cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    with node_env(cluster, "containerd", "ctdrst", tmp_path_factory.mktemp("ctdrst")) as env:
        agent = start_agent(cluster, env)
        names = ["r0", "r1", "r2"]
        env.create("r0", containers=2)
        env.create("r1")
        env.create("r2")
        try:
            pods = eventually(lambda: all_running(env, names), "3 pods Running", 90)
        except AssertionError:
            print(env.describe())
            raise
        before = {p.metadata.name: sorted((c.name, c.container_id, c.restart_count)
                                          for c in p.status.container_statuses)
                  for p in pods}
        uids = {p.metadata.name: p.metadata.uid for p in pods}
        sandboxes_before = {n: env.view().sandboxes[u] for n, u in uids.items()}
        procs_before = workloads(env.name)
        assert {n: len(v) for n, v in procs_before.items()} == {"r0": 2, "r1": 1, "r2": 1}
        assert agent.sample("nodepulse_pleg_runtime_up") == 1.0
        failures0 = agent.sample("nodepulse_pleg_relist_failures_total") or 0.0

        stopped_at = time.monotonic()
        ctd_pid = env.ctd.pid
        env.ctd.kill_daemon()  # SIGTERM to containerd's PID; shims keep the containers
        assert not alive(ctd_pid)
        try:
            eventually(lambda: agent.sample("nodepulse_pleg_runtime_up") == 0.0,
                       "PLEG to report the runtime down (nodepulse_pleg_runtime_up 0)", 30)
            seen_down = time.monotonic() - stopped_at
            def not_ready() -> dict[str, str] | None:
                c = env.ready_condition()
                return c if c["status"] == "False" else None

            cond = eventually(not_ready, "the Node Ready=False", 30)
            node_down = time.monotonic() - stopped_at
            assert "container runtime is down" in cond["message"], cond
            print(f"\n[fault 4] containerd stopped: PLEG reported it down after "
                  f"{seen_down:.1f}s, Node Ready=False after {node_down:.1f}s: "
                  f"{cond['message']!r}")
            # liveness is another matter: the agent itself is fine, a restart of it
            # would not bring containerd back
            code, body = agent.healthz()
            assert code == 200, body
            # the containers run on without containerd, and the API still says so
            assert workloads(env.name) == procs_before
            for p in env.pods():
                assert running(p), p.status
            # a container that dies while containerd is down is restarted once it is
            # back (its shim keeps the exit); a pod that arrives meanwhile waits for it
            os.kill(procs_before["r2"][0], signal.SIGKILL)
            eventually(lambda: not alive(procs_before["r2"][0]), "r2's workload to die", 10)
            env.create("r3")
        finally:
            env.ctd.start_daemon()  # same root, state and socket
        started_at = time.monotonic()
        eventually(lambda: agent.sample("nodepulse_pleg_runtime_up") == 1.0,
                   "PLEG to see the runtime again", 30)
        seen_up = time.monotonic() - started_at
        eventually(lambda: env.ready_condition()["status"] == "True", "the Node Ready again",
                   30)
        node_up = time.monotonic() - started_at
        print(f"[fault 4] containerd started again: PLEG saw it after {seen_up:.1f}s, "
              f"Node Ready=True after {node_up:.1f}s; relist failures counted: "
              f"{(agent.sample('nodepulse_pleg_relist_failures_total') or 0) - failures0:.0f}")
        # give the agent a few relists and a resync pass on what it found
        r0 = agent.sample("nodepulse_pleg_relist_duration_seconds_count") or 0.0
        eventually(lambda: (agent.sample("nodepulse_pleg_relist_duration_seconds_count")
                            or 0) >= r0 + 5, "5 more relists", 30)

        r3 = eventually(lambda: all_running(env, ["r3"]),
                        "r3, created during the outage, Running", 60)[0]
        uids["r3"] = r3.metadata.uid
        old_r2 = before["r2"][0][1]

        def r2_restarted() -> client.V1ContainerStatus | None:
            p = env.pod("r2")
            cs = p.status.container_statuses[0] if p else None
            return cs if cs and cs.restart_count == 1 and running(p) else None

        r2 = eventually(r2_restarted, "r2's container, dead during the outage, restarted", 60)
        assert r2.container_id != old_r2
        assert r2.last_state.terminated.exit_code == 137  # SIGKILL, learnt after the restart
        assert r2.last_state.terminated.container_id == old_r2
        after = {p.metadata.name: sorted((c.name, c.container_id, c.restart_count)
                                         for c in p.status.container_statuses)
                 for p in env.pods()}
        survivors = ("r0", "r1")
        assert {n: after[n] for n in survivors} == {n: before[n] for n in survivors}, \
            "the survivors: the same containers in the API, not restarted"
        before["r3"] = after["r3"]
        before["r2"] = after["r2"]
        assert all(running(p) for p in env.pods())
        procs = workloads(env.name)
        assert {n: procs[n] for n in survivors} == {n: procs_before[n] for n in survivors}, \
            "the survivors: the same processes"
        assert sorted(procs) == ["r0", "r1", "r2", "r3"]
        assert len(procs["r2"]) == len(procs["r3"]) == 1
        view = env.view()
        for n, uid in uids.items():
            mine = view.of(uid)
            run = [c for c in mine if c.state == "RUNNING"]
            restarts = 1 if n == "r2" else 0
            assert sorted((c.name, f"containerd://{c.id}", restarts) for c in run) \
                == before[n], \
                f"pod {n}: one running container per name, the API's; got {mine}"
            rest = [c for c in mine if c.state != "RUNNING"]
            # r2 keeps its dead attempt (the API's lastState); nothing else is left over
            assert [(c.id, c.state) for c in rest] == ([(old_r2.partition("://")[2], "EXITED")]
                                                       if n == "r2" else []), (n, rest)
            if n in sandboxes_before:
                assert view.sandboxes[uid] == sandboxes_before[n], f"pod {n}: sandboxes"
            else:
                assert [ready for _, ready in view.sandboxes[uid]] == [True], \
                    f"pod {n}: one sandbox"
        assert view.uids() == set(uids.values())

        # the agent drives the restarted containerd: a new pod runs, a deleted one goes
        env.create("r4")
        eventually(lambda: all_running(env, ["r4"]), "a new pod Running after the restart", 60)
        env.core.delete_namespaced_pod("r1", env.ns)
        eventually(lambda: env.pod("r1") is None and "r1" not in workloads(env.name),
                   "r1 deleted and its container stopped", 60)
        # the API object goes first; its runtime objects are removed right after
        eventually(lambda: uids["r1"] not in env.view().uids(), "r1 removed from containerd",
                   30)


# --- fault 5: agent SIGKILL during a burst ------------------------------------------

@dataclass
class Burst:
    ops: list[tuple[str, str]]   # ("create" | "delete", pod name)
    kills: list[int]             # kill the agent just before these op indexes
    pauses: list[float]          # after each op


def plan_burst(rng: random.Random, creates: int = 50) -> Burst:
    """`creates` pod creates in order, each followed with probability 0.4 by a delete of
    a random pod created earlier and not yet deleted; 2 or 3 kills at random ops."""
    ops: list[tuple[str, str]] = []
    live: list[str] = []
    for i in range(creates):
        name = f"b{i:02d}"
        ops.append(("create", name))
        live.append(name)
        if rng.random() < 0.4:
            victim = live.pop(rng.randrange(len(live)))
            ops.append(("delete", victim))
    kills = sorted(rng.sample(range(3, len(ops) - 1), rng.choice([2, 3])))
    pauses = [rng.uniform(0.0, 0.15) for _ in ops]
    return Burst(ops, kills, pauses)


def stuck_in_runtime(env: Env, view: RtView, uid: str) -> bool:
    """True for a deleted pod whose only leftovers are containers containerd 1.6 will not
    remove: an agent kill cancelled their start after the shim had made the task, so
    CRI reports them EXITED ('failed to create containerd task: ... context canceled')
    while containerd refuses RemoveContainer ('cannot delete running task') for as long
    as the task exists; CRI has no call that ends it, and a kubelet would be stuck the
    same way (CI at f127eb8). Their sandbox stays too, stopped: containerd's
    RemovePodSandbox removes the sandbox's containers first. Only when no process runs
    for the pod (the workloads check), no sandbox of it is ready, and the agent asked
    for each removal."""
    mine = view.of(uid)
    if env.kind != "containerd" or not mine:
        return False
    log = (env.root / "agent.log").read_text(errors="replace")
    return (all(not ready and f"remove_sandbox {sid}" in log
                for sid, ready in view.sandboxes.get(uid, []))
            and all(c.state == "EXITED" and "context canceled" in c.info
                    and f"cannot delete running task {c.id}" in log for c in mine))


def converged(env: Env, live: set[str], gone: set[str], kills: int) -> str | None:
    """None when the runtime holds exactly what the API asks for and the API's statuses
    name those containers; else what still differs. Each of the `kills` agent kills may
    have interrupted one start of a pod's container (see below), so a pod may show up to
    that many restarts."""
    pods = {p.metadata.name: p for p in env.pods()}
    if set(pods) != live:
        return (f"API pods differ: extra {sorted(set(pods) - live)}, "
                f"missing {sorted(live - set(pods))}")
    not_running = sorted(n for n, p in pods.items() if not running(p))
    if not_running:
        return f"not Running in the API: {not_running}"
    procs = workloads(env.name)
    if procs.keys() != live or any(len(v) != 1 for v in procs.values()):
        return (f"processes: {sorted((k, len(v)) for k, v in procs.items() if len(v) != 1)}"
                f" duplicated; stray {sorted(procs.keys() - live)}; "
                f"missing {sorted(live - procs.keys())}")
    view = env.view()
    uids = {p.metadata.uid: n for n, p in pods.items()}
    orphans = {u for u in view.uids() - uids.keys() if not stuck_in_runtime(env, view, u)}
    if orphans or not uids.keys() <= view.uids():
        return (f"runtime objects of unknown pods (orphans): {sorted(orphans)}; "
                f"pods the runtime lacks: {sorted(uids.keys() - view.uids())}")
    for uid, n in uids.items():
        mine = view.of(uid)
        run = [c for c in mine if c.state == "RUNNING"]
        if len(run) != 1:
            return f"pod {n}: runtime holds {mine}, want one running container"
        sbs = view.sandboxes.get(uid, [])
        if [r for _, r in sbs] != [True]:
            return f"pod {n}: sandboxes {sbs}, want one ready"
        cs = pods[n].status.container_statuses[0]
        if cs.container_id.partition("://")[2] != run[0].id:
            return f"pod {n}: API says {cs.container_id}, runtime runs {run[0].id}"
        # besides it, only the exited attempt the API shows as lastState (kept for its
        # exit record, as the kubelet keeps it), and only after a restart; no more
        # restarts than kills that could have interrupted a start
        dead = [c for c in mine if c is not run[0]]
        last = cs.last_state.terminated if cs.last_state else None
        if dead and not (len(dead) == 1 and dead[0].state == "EXITED" and last
                         and last.container_id.partition("://")[2] == dead[0].id
                         and 1 <= cs.restart_count <= kills):
            return (f"pod {n}: runtime also holds {dead}; the API's lastState is {last} "
                    f"(restartCount {cs.restart_count})")
    return None


@pytest.mark.parametrize("kind", ["process", "containerd"])
def test_agent_sigkill_during_burst_converges(
        cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, kind: str) -> None:
    rng = random.Random(SEED)
    burst = plan_burst(rng)
    deletes = sum(1 for op, _ in burst.ops if op == "delete")
    print(f"\n[fault 5/{kind}] seed {SEED}: {len(burst.ops)} ops ({len(burst.ops) - deletes} "
          f"creates, {deletes} deletes), agent SIGKILLed before ops {burst.kills} and once "
          "after the burst")
    tag = "brst-" + ("ctd" if kind == "containerd" else "proc")
    with node_env(cluster, kind, tag, tmp_path_factory.mktemp(tag)) as env:
        # debug: every update and sync step is in agent.log for a failure's message.
        # While the process runtime's event stream flows the PLEG relists only every
        # --evented-pleg-relist-period (60 s by default); at 5 s the stability check
        # below sees its relists within 30 s. Convergence itself still rests on events.
        agent = start_agent(cluster, env, "--log-level=debug",
                            "--evented-pleg-relist-period=5s")
        live: set[str] = set()
        gone: set[str] = set()
        started = time.monotonic()
        for i, (op, name) in enumerate(burst.ops):
            if i in burst.kills:
                agent.sigkill()
                print(f"[fault 5/{kind}] agent SIGKILLed at {time.time():.3f} before op {i}")
                agent.start()
            if op == "create":
                env.create(name)
                live.add(name)
            else:
                env.core.delete_namespaced_pod(name, env.ns)
                live.discard(name)
                gone.add(name)
            time.sleep(burst.pauses[i])
        time.sleep(rng.uniform(0.2, 1.0))
        agent.sigkill()  # the final restart, while the agent still works on the burst
        kills = len(burst.kills) + 1
        print(f"[fault 5/{kind}] agent SIGKILLed at {time.time():.3f} after the burst")
        agent.start()
        try:
            eventually(lambda: converged(env, live, gone, kills) is None,
                       "the runtime to match the API", 180, every=0.5)
        except AssertionError:
            print(f"still differs: {converged(env, live, gone, kills)}\n{env.describe()}")
            raise
        took = time.monotonic() - started
        # stable: a few relists later nothing moved, and nothing was restarted
        r0 = agent.sample("nodepulse_pleg_relist_duration_seconds_count") or 0.0
        eventually(lambda: (agent.sample("nodepulse_pleg_relist_duration_seconds_count")
                            or 0) >= r0 + 3, "3 more relists", 30)
        assert converged(env, live, gone, kills) is None, converged(env, live, gone, kills)
        # No running container was ever stopped or duplicated. The one kind of restart
        # a kill may cause: CRI StartContainer in flight when the agent died is
        # cancelled by containerd (exit 128 StartError: "context canceled", or the shim
        # start it was running "signal: killed"); the next agent starts the next attempt
        # and reports the restart (as a kubelet would). A pod whose starts two kills hit
        # shows two restarts. The process runtime adopts a start the agent died in, so
        # there none may appear.
        restarts = {p.metadata.name: p.status.container_statuses[0]
                    for p in env.pods() if p.status.container_statuses[0].restart_count}
        for n, cs in restarts.items():
            last = cs.last_state.terminated
            assert kind == "containerd" and cs.restart_count <= kills and last is not None \
                and (last.exit_code, last.reason) == (128, "StartError"), \
                f"pod {n}: restarted, not by an interrupted start: {cs}"
            print(f"[fault 5/{kind}] pod {n}: start interrupted by the kill: "
                  f"{last.message!r}")
        orphans = agent.sample("nodepulse_housekeeping_orphans_total") or 0.0
        print(f"[fault 5/{kind}] converged {took:.1f}s after the burst began: "
              f"{len(live)} pods running one container each, {len(gone)} deleted pods "
              f"gone from API and runtime; agent started {agent.starts} times; orphans "
              f"removed by housekeeping since the last start: {orphans:.0f}; starts "
              f"interrupted by a kill and redone: {sorted(restarts)}")


def test_agent_sigterm_while_starting_interrupts_nothing(
        cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The graceful counterpart of fault 5 (an agent upgrade or restart): SIGTERM while
    containerd starts a batch of containers. The agent lets the runtime calls in flight
    finish before it exits, so no start is cancelled half-way (which containerd turns
    into a StartError and the next agent into a restart)."""
    with node_env(cluster, "containerd", "term", tmp_path_factory.mktemp("term")) as env:
        agent = start_agent(cluster, env, "--log-level=debug")
        names = [f"t{i:02d}" for i in range(20)]
        for n in names:
            env.create(n)

        # the trigger is containerd's view (containers being made) and then the agent's
        # own count of runtime calls under way: the API's Running statuses lag the
        # runtime, so by the time some show, every start may be over and the stop would
        # test nothing
        def starting() -> bool:
            return (bool(env.view().containers)
                    and (agent.sample("nodepulse_runtime_calls_in_flight") or 0) >= 3)

        eventually(starting, "containers made and 3 runtime calls under way", 60,
                   every=0.01)
        assert agent.proc is not None
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(60) == 0
        log = (env.root / "agent.log").read_text()
        waited = [line for line in log.splitlines() if "runtime call(s) in flight" in line]
        print(f"\n[sigterm] running when stopped: "
              f"{sum(1 for p in env.pods() if running(p))}/{len(names)}; {waited}")
        assert waited, "no runtime call was in flight at the SIGTERM: nothing was tried"
        assert "still running after" not in log, "the stop gave up waiting for the runtime"
        agent.start()
        try:
            eventually(lambda: converged(env, set(names), set(), kills=0) is None,
                       "the runtime to match the API", 120, every=0.5)
        except AssertionError:
            print(f"still differs: {converged(env, set(names), set(), kills=0)}\n{env.describe()}")
            raise
        restarted = {p.metadata.name: p.status.container_statuses[0].last_state.terminated
                     for p in env.pods() if p.status.container_statuses[0].restart_count}
        assert restarted == {}, f"starts interrupted by a graceful stop: {restarted}"
        assert not [c for c in env.view().containers if c.state != "RUNNING"]


# --- fault 7: one pod's status call hangs -------------------------------------------

class HangingRuntime(ProcessRuntime):
    """The process runtime, except that pod_status of the pods in `hang` does not
    return until `release` is set (a runtime wedged on one pod's inspection). Built
    and used on the agent's event loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hang: set[str] = set()
        self.release = asyncio.Event()
        self.hung_calls = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def pod_status(self, pod_uid: str) -> PodRuntimeStatus:
        if pod_uid in self.hang and not self.release.is_set():
            self.hung_calls += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await self.release.wait()
            finally:
                self.in_flight -= 1
        return await super().pod_status(pod_uid)


class InProcessAgent:
    """The agent's own asyncio entry point (Agent, as nodepulse-agent's CLI builds it)
    on a thread of this process, with the HangingRuntime handed in."""

    def __init__(self, name: str, root: Path, kubeconfig: Path) -> None:
        from nodeagent import config
        parser = argparse.ArgumentParser()
        config.add_flags(parser)
        self.port = free_port()
        self.flags = vars(parser.parse_args([
            f"--node-name={name}", f"--kubeconfig={kubeconfig}", f"--root-dir={root}",
            f"--healthz-bind-address=127.0.0.1:{self.port}",
            "--node-status-update-frequency=2s", "--runtime=process", "--port=0",
            # the hang test pins the relist's period while an inspection hangs, so the
            # relist keeps its 1 s period even while the event stream flows
            "--evented-pleg-relist-period=1s",
            f"--register-with-taints={TAINT_KEY}={name}:NoSchedule"]))
        self.cfg = config.load(self.flags, {})
        self.name = name
        self.root = root
        self.registry = CollectorRegistry()
        self.kube: RestKube | None = None
        self.runtime: HangingRuntime | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"agent-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()
        assert self._ready.wait(60), "the in-process agent did not start"
        if self.error is not None:
            raise self.error

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # reported by start()/stop()
            self.error = e
            self._ready.set()

    async def _serve(self) -> None:
        from nodeagent.agent import Agent, Externals, host_ip, host_probe
        from nodeagent.api.client import load_credentials
        from nodeagent.api.clock import RealClock
        from nodeagent.api.kube import RestKube

        cfg = self.cfg
        self.kube = kube = RestKube(load_credentials(cfg.kubeconfig), component="agent")
        try:
            hip = host_ip(cfg, host_probe(cfg))
            self.runtime = HangingRuntime(Path(cfg.root_dir) / "process", host_ip=hip)
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            agent = Agent(cfg, Externals(kube, RealClock(), runtime=self.runtime,
                                     host_ip=hip, registry=self.registry, flags=self.flags,
                                     env={}))
            self._ready.set()
            await agent.run(self._stop)
        finally:
            await kube.aclose()

    def call(self, fn: Callable[[], None]) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)

    def sample(self, metric: str, **labels: str) -> float:
        v = self.registry.get_sample_value(metric, {"node": self.name, **labels})
        return float(v or 0.0)

    def healthz(self) -> tuple[int, str]:
        return http_get(f"http://127.0.0.1:{self.port}/healthz")

    def stop(self) -> None:
        if self.thread.is_alive() and self._stop is not None:
            stop = self._stop
            self.call(stop.set)
        self.thread.join(60)
        assert not self.thread.is_alive(), "the in-process agent did not stop"


def workload_pid(root: Path, container_id: str) -> int:
    """The workload's PID under the process runtime's wrapper, from its record."""
    cid = container_id.partition("://")[2]
    rec = json.loads((root / "process" / "containers" / f"{cid}.json").read_text())
    wrapper = int(rec["pid"])
    children = Path(f"/proc/{wrapper}/task/{wrapper}/children").read_text().split()
    assert len(children) == 1, (wrapper, children)
    return int(children[0])


def test_hung_pod_status_does_not_stall_pleg_or_other_pods(
        cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    with node_env(cluster, "process", "hang", tmp_path_factory.mktemp("hang")) as env:
        agent = InProcessAgent(env.name, env.root, cluster.node_kubeconfig(env.name))
        env.stoppers.append(agent.stop)
        agent.start()
        node_registered(env.core, env.name)
        rt = agent.runtime
        assert rt is not None
        for n in ("h", "a", "b"):
            env.create(n)
        pods = {p.metadata.name: p for p in eventually(
            lambda: all_running(env, ["h", "a", "b"]), "h, a, b Running", 60)}
        h_uid = pods["h"].metadata.uid

        # wedge the runtime on h, then give PLEG a reason to inspect h: its container dies
        agent.call(lambda: rt.hang.add(h_uid))
        eventually(lambda: h_uid in rt.hang, "the hang armed")
        relists0 = agent.sample("nodepulse_pleg_relist_duration_seconds_count")
        interval = "nodepulse_pleg_relist_interval_seconds"
        gaps0 = (agent.sample(f"{interval}_count"), agent.sample(f"{interval}_bucket", le="5.0"))
        os.kill(workload_pid(env.root, pods["h"].status.container_statuses[0].container_id),
                signal.SIGKILL)
        eventually(lambda: rt.in_flight > 0, "PLEG's inspection of h to hang", 20)
        hung_at = time.monotonic()

        # meanwhile: new pods start, a dying container is restarted, a pod is deleted
        env.create("c")
        env.create("d")
        b_cid = pods["b"].status.container_statuses[0].container_id
        os.kill(workload_pid(env.root, b_cid), signal.SIGKILL)
        env.core.delete_namespaced_pod("a", env.ns)
        eventually(lambda: all_running(env, ["c", "d"]), "c and d Running", 60)

        def b_restarted() -> bool:
            p = env.pod("b")
            cs = p.status.container_statuses[0] if p else None
            return bool(cs and cs.restart_count == 1 and cs.state.running
                        and cs.container_id != b_cid)

        eventually(b_restarted, "b's container restarted", 60)
        eventually(lambda: env.pod("a") is None and "a" not in workloads(env.name),
                   "a deleted and stopped", 60)
        # the hang lasts through all of it: an inspection times out (10 s) and the
        # next relist inspects h again, which hangs again; never two at once
        eventually(lambda: agent.sample("nodepulse_pleg_inspect_failures_total",
                                        reason="timeout") >= 1, "an inspection timeout", 30)
        eventually(lambda: rt.hung_calls >= 2 and rt.in_flight == 1,
                   "h inspected again after the timeout (and hanging again)", 10)
        assert h_uid in rt.hang and not rt.release.is_set()
        assert rt.max_in_flight == 1, "one inspection of a pod at a time"
        held = time.monotonic() - hung_at
        relists = agent.sample("nodepulse_pleg_relist_duration_seconds_count") - relists0
        gaps = agent.sample(f"{interval}_count") - gaps0[0]
        short_gaps = agent.sample(f"{interval}_bucket", le="5.0") - gaps0[1]
        code, body = agent.healthz()
        assert code == 200, body
        assert agent.sample("nodepulse_pleg_healthy") == 1.0
        assert agent.sample("nodepulse_pleg_runtime_up") == 1.0
        assert env.ready_condition()["status"] == "True"
        # relists kept their 1 s period while h's inspection hung: none waited for the
        # inspection (that would be a gap of 10 s, its timeout); a loaded machine may
        # delay one by a second or two
        assert gaps > 0 and short_gaps == gaps, \
            f"{gaps - short_gaps:.0f} of {gaps:.0f} relists came over 5 s after the one before"
        h = env.pod("h")
        assert h is not None and h.status.container_statuses[0].restart_count == 0
        print(f"\n[fault 7] h's status call hung for {held:.1f}s ({rt.hung_calls} calls, "
              f"{agent.sample('nodepulse_pleg_inspect_failures_total', reason='timeout'):.0f}"
              f" timed out); meanwhile {relists:.0f} relists, c and d started, b restarted, "
              "a deleted; /healthz 200, PLEG healthy")

        # the runtime answers again: h's dead container is restarted
        agent.call(rt.release.set)

        def h_restarted() -> bool:
            p = env.pod("h")
            cs = p.status.container_statuses[0] if p else None
            return bool(cs and cs.restart_count == 1 and cs.state.running and cs.ready)

        eventually(h_restarted, "h restarted once the runtime answers", 60)
        assert agent.error is None
        # pod status writes reuse the API client's connections (an unread response
        # would hold its connection until garbage collection: one TLS connection each)
        assert agent.kube is not None
        opened = agent.kube.transport.opened  # one pool for all its Transports
        writes = agent.sample("nodepulse_pod_status_writes_total", kind="patch", result="ok")
        print(f"[fault 7] the agent's API client opened {opened} connections in all; "
              f"{writes:.0f} pod status patches")
