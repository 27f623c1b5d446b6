"""An in-memory runtime: deterministic, driven by a Clock, with knobs for faults.

Used by unit tests (with FakeClock) and scale runs (virtual nodes, bench/). Containers
"run" until a test (or `stop_container`) ends them, or as their pod's annotations
script them (runtime/script.py: exit after a time with a code, fail to start); nothing
executes. A scripted exit happens at its time on the clock: an open event stream
(`container_events`) delivers it then, and without one the next call that reads
containers (a relist, a pod's status) sees it, as a real runtime's exit is seen by the
next relist. Every change is an event on the open streams, as it happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import heapq
import itertools
import os
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TypeVar

from nodeagent.api.clock import Clock, RealClock, clock_timeout
from nodeagent.runtime.base import (
    LABEL_POD_UID,
    Container,
    ContainerConfig,
    ContainerEvent,
    ContainerEventType,
    ContainerRuntimeError,
    ContainerState,
    ContainerStats,
    ExecResult,
    ImageInfo,
    ImageNotPresent,
    NotFound,
    PodRuntimeStatus,
    PullFailed,
    RegistryAuth,
    RelistResult,
    Resources,
    Runtime,
    RuntimeVersion,
    Sandbox,
    SandboxConfig,
    SandboxState,
    Unsupported,
)
from nodeagent.runtime.script import Script, ScriptError, script_for
from nodeagent.runtime.usage import NONE, Usage

R = TypeVar("R", Sandbox, Container)
ExecAnswer = (ExecResult | BaseException
              | Callable[[list[str]], "ExecResult | BaseException"])


def _clone(rec: R) -> R:
    """Shallow copy, so callers cannot change our records (cheaper than
    dataclasses.replace, which matters at thousands of records per relist)."""
    new = object.__new__(type(rec))
    new.__dict__.update(rec.__dict__)
    return new


class FakeRuntime(Runtime):
    scheme = "fake"
    inline = True  # in-process: only simulated delays and hangs wait
    runs_workloads = False  # what the agent builds with it; its tests may say otherwise
    cgroups = "simulated"   # the sandboxes' cgroup parents and the limits are recorded

    def __init__(self, clock: Clock | None = None, *, images: Iterable[str] | None = None,
                 host_ip: str = "192.0.2.10", image_size: int = 5_000_000,
                 default_cpu: Usage = NONE, default_memory: Usage = NONE) -> None:
        """`images`: refs present in the store; None means every image is present.
        `default_cpu`, `default_memory`: the usage a container reports whose pod has
        no fake.nodepulse.dev/cpu or memory annotation."""
        self.clock = clock or RealClock()
        self.images: set[str] | None = None if images is None else {_tagged(r) for r in images}
        self.pinned: set[str] = set()  # refs the store says are pinned (never collected)
        self.image_size = image_size
        self.host_ip = host_ip
        self.sandboxes: dict[str, Sandbox] = {}
        self.containers: dict[str, Container] = {}
        self.configs: dict[str, ContainerConfig] = {}  # container id -> what created it
        self.sandbox_configs: dict[str, SandboxConfig] = {}  # sandbox id -> the same
        # image ref -> (uid, user name) it runs as; an image not named runs as root
        self.image_users: dict[str, tuple[int | None, str]] = {}
        self.runtime_handlers: set[str] = {""}  # handlers it has (RuntimeClass)
        self.calls: Counter[str] = Counter()
        # faults and behaviours a test can set
        self.hang_pod_status: set[str] = set()   # pod uids whose pod_status never returns
        self.fail: dict[str, BaseException] = {}  # method name -> raise once
        self.ignore_sigterm: set[str] = set()    # container names that run to the kill
        self.exit_on_start: dict[str, int] = {}  # container name -> exits at once, code
        # what exec_sync (exec probes and hooks) answers, by container name: an
        # ExecResult, an exception to raise (RuntimeTimeout: the command timed out), or a
        # function of the command giving either; unscripted commands exit 0
        self.exec_results: dict[str, ExecAnswer] = {}
        self.execs: list[tuple[str, list[str]]] = []  # (container name, cmd) as run
        # network probes and hooks (httpGet, tcpSocket, grpc): nothing listens in a fake
        # container, so they are answered here, by container name (unscripted: success),
        # unless `dial` is set (a test or benchmark with real servers on the pod IP)
        self.network_results: dict[str, ExecResult] = {}
        self.network_probes: list[tuple[str, str]] = []  # (container name, action)
        self.dial = False
        # the registry pulls come from: ref -> the credentials it asks for (None: anyone
        # may pull). A ref not listed cannot be pulled, unless every image is present.
        self.registry: dict[str, RegistryAuth | None] = {}
        self.pull_delay = 0.0   # seconds (on the clock) each pull takes
        self.pulls: list[tuple[str, RegistryAuth | None]] = []  # every pull, as asked
        self.pulling = 0        # pulls under way now, and the most there were at once
        self.max_pulling = 0
        # pod uid -> its sandbox and container ids, so pod_status costs O(pod), like a
        # runtime with an index would (keeps the per-pod polling comparison fair)
        self._by_pod: dict[str, set[str]] = {}
        self._ids = itertools.count(1)
        self._ips = itertools.count(2)
        self._log_dirs: dict[str, str] = {}  # sandbox id -> its log directory
        self.scripts: dict[str, Script] = {}  # container id -> its pod's script for it
        self.default_cpu, self.default_memory = default_cpu, default_memory
        self._exits: list[tuple[float, str]] = []  # (monotonic time, container id) heap
        # open event streams; None in one wakes it (a new scripted exit to wait for)
        self._streams: list[asyncio.Queue[ContainerEvent | BaseException | None]] = []
        self.lost_events = 0  # the next this many events reach no stream (a lossy runtime)
        self.has_events = True  # False: no event stream, like containerd 1.6 (relists only)

    # --- test helpers --------------------------------------------------------------

    def exit_container(self, container_id: str, code: int = 0, reason: str = "") -> None:
        """The container's process ends by itself (crash or completion)."""
        c = self.containers[container_id]
        if c.state != ContainerState.RUNNING:
            raise ValueError(f"fake: container {container_id} is {c.state}, not RUNNING")
        self._finish(c, code, reason or ("Completed" if code == 0 else "Error"))

    def break_event_streams(self, error: BaseException | None = None) -> None:
        """Every open event stream fails with `error` (a runtime restart, a dropped
        connection); only streams subscribed after this see later events."""
        err = error or ContainerRuntimeError("fake: the event stream broke")
        for q in self._streams:
            q.put_nowait(err)
        self._streams.clear()

    def write_log(self, container_id: str, text: str, stream: str = "stdout") -> None:
        """The container "prints" `text`: one CRI log line per line of it, stamped with
        the clock, in its log file (none when its sandbox has no log directory)."""
        c = self.containers[container_id]
        if not c.log_path:
            return
        stamp = self.clock.now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        lines = text.split("\n")
        body = "".join(f"{stamp} {stream} F {line}\n" for line in
                       (lines[:-1] if text.endswith("\n") else lines))
        with open(c.log_path, "a") as f:
            f.write(body)

    def running(self, pod_uid: str | None = None) -> list[Container]:
        return [c for c in self.containers.values() if c.state == ContainerState.RUNNING
                and (pod_uid is None or c.pod_uid == pod_uid)]

    def find(self, pod_uid: str, name: str) -> list[Container]:
        """All attempts of one container, oldest first."""
        return sorted((c for c in self.containers.values()
                       if c.pod_uid == pod_uid and c.name == name), key=lambda c: c.attempt)

    # --- internals -----------------------------------------------------------------

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        exc = self.fail.pop(name, None)
        if exc is not None:
            raise exc

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):08x}"

    def _event(self, type_: ContainerEventType, pod_uid: str, rid: str,
               at: dt.datetime | None = None) -> None:
        if not self._streams:
            return
        if self.lost_events > 0:
            self.lost_events -= 1
            return
        ev = ContainerEvent(type_, pod_uid, rid, at or self.clock.now())
        for q in self._streams:
            q.put_nowait(ev)

    def _finish(self, c: Container, code: int, reason: str,
                at: dt.datetime | None = None) -> None:
        c.state = ContainerState.EXITED
        c.exit_code = code
        c.reason = reason
        c.finished_at = at or self.clock.now()
        self._event(ContainerEventType.DIED, c.pod_uid, c.id, c.finished_at)
        self.write_log(c.id, f"fake runtime: container {c.name} exited with code {code} "
                             f"({reason})", "stderr")

    def _containers_in(self, sb: Sandbox) -> list[Container]:
        """The sandbox's containers, found through its pod's records (not by a scan of
        every container: a virtual node's process holds thousands)."""
        return [c for i in sorted(self._by_pod.get(sb.pod_uid, ()))
                if (c := self.containers.get(i)) is not None and c.sandbox_id == sb.id]

    def _forget(self, uid: str, rid: str) -> None:
        ids = self._by_pod.get(uid)
        if ids is not None:
            ids.discard(rid)
            if not ids:
                del self._by_pod[uid]

    def _present(self, ref: str) -> bool:
        return self.images is None or _tagged(ref) in self.images

    def _scripted_exits(self) -> None:
        """The scripted exits due by now, each at its own time."""
        now = self.clock.monotonic()
        while self._exits and self._exits[0][0] <= now:
            at, cid = heapq.heappop(self._exits)
            c = self.containers.get(cid)
            if c is None or c.state != ContainerState.RUNNING:
                continue  # stopped or removed first
            code = self.scripts[cid].exit_code
            self._finish(c, code, "Completed" if code == 0 else "Error",
                         at=self.clock.now() - dt.timedelta(seconds=now - at))

    async def _deliver(self, q: asyncio.Queue[ContainerEvent | BaseException | None]
                       ) -> AsyncIterator[ContainerEvent]:
        """One stream's events. It also ends scripted runs at their time: nothing
        else would notice them before a call reads containers."""
        try:
            while True:
                self._scripted_exits()
                if q.empty() and self._exits:
                    try:
                        item = await clock_timeout(
                            self.clock, q.get(), self._exits[0][0] - self.clock.monotonic(),
                            "the next scripted exit is due")
                    except TimeoutError:
                        continue
                else:
                    item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item is not None:
                    yield item
        finally:
            with contextlib.suppress(ValueError):
                self._streams.remove(q)

    # --- Runtime -------------------------------------------------------------------

    async def container_events(self) -> AsyncIterator[ContainerEvent]:
        self._call("container_events")
        if not self.has_events:
            raise Unsupported("the fake runtime streams no container events (has_events "
                              "is off)")
        q: asyncio.Queue[ContainerEvent | BaseException | None] = asyncio.Queue()
        self._streams.append(q)
        return self._deliver(q)

    async def version(self) -> RuntimeVersion:
        self._call("version")
        return RuntimeVersion("fake", "0.1.0", "v1")

    async def relist(self) -> RelistResult:
        self._call("relist")
        self._scripted_exits()
        return RelistResult(
            sandboxes=[_clone(s) for s in self.sandboxes.values()],
            containers=[_clone(c) for c in self.containers.values()])

    async def pod_status(self, pod_uid: str) -> PodRuntimeStatus:
        self._call("pod_status")
        if pod_uid in self.hang_pod_status:
            await asyncio.get_running_loop().create_future()  # never resolves
        self._scripted_exits()
        ids = self._by_pod.get(pod_uid, set())
        sandboxes = sorted((_clone(self.sandboxes[i]) for i in ids if i in self.sandboxes),
                           key=lambda s: (s.attempt, s.id), reverse=True)
        containers = sorted((_clone(self.containers[i]) for i in ids if i in self.containers),
                            key=lambda c: c.id)
        return PodRuntimeStatus(uid=pod_uid, sandboxes=sandboxes, containers=containers)

    async def run_sandbox(self, config: SandboxConfig) -> str:
        self._call("run_sandbox")
        if config.runtime_handler not in self.runtime_handlers:
            raise ContainerRuntimeError(f"run_sandbox {config.namespace}/{config.name}: "
                                        f"no runtime for {config.runtime_handler!r} is "
                                        "configured")
        sid = self._new_id("sb")
        self.sandbox_configs[sid] = config
        n = next(self._ips)
        ip = self.host_ip if config.host_network else f"10.88.{n // 250}.{n % 250 + 2}"
        self.sandboxes[sid] = Sandbox(
            id=sid, pod_uid=config.uid, name=config.name, namespace=config.namespace,
            attempt=config.attempt, state=SandboxState.READY, created_at=self.clock.now(),
            ip=ip, host_network=config.host_network,
            labels={**config.labels, LABEL_POD_UID: config.uid},
            annotations=dict(config.annotations))
        self._by_pod.setdefault(config.uid, set()).add(sid)
        if config.log_directory:
            self._log_dirs[sid] = config.log_directory
        self._event(ContainerEventType.STARTED, config.uid, sid)
        return sid

    async def stop_sandbox(self, sandbox_id: str) -> None:
        self._call("stop_sandbox")
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            return
        for c in self._containers_in(sb):
            if c.state == ContainerState.RUNNING:
                self._finish(c, 137, "Killed")
        if sb.state == SandboxState.READY:
            sb.state = SandboxState.NOTREADY
            self._event(ContainerEventType.DIED, sb.pod_uid, sandbox_id)

    async def remove_sandbox(self, sandbox_id: str) -> None:
        self._call("remove_sandbox")
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            return
        uid = sb.pod_uid
        for c in self._containers_in(sb):
            self._forget(uid, c.id)
            del self.containers[c.id]
            self._event(ContainerEventType.REMOVED, uid, c.id)
        del self.sandboxes[sandbox_id]
        self._event(ContainerEventType.REMOVED, uid, sandbox_id)
        self.sandbox_configs.pop(sandbox_id, None)
        log_dir = self._log_dirs.pop(sandbox_id, None)
        # the pod is gone, its logs too (unless another of its sandboxes writes there)
        if log_dir and not any(self._log_dirs.get(i) == log_dir
                               for i in self._by_pod.get(uid, ())):
            shutil.rmtree(log_dir, ignore_errors=True)
        self._forget(uid, sandbox_id)

    async def create_container(self, sandbox_id: str, config: ContainerConfig,
                               sandbox_config: SandboxConfig) -> str:
        self._call("create_container")
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise NotFound(f"create_container {config.name}: sandbox {sandbox_id} not found")
        if sb.state != SandboxState.READY:
            raise NotFound(f"create_container {config.name}: sandbox {sandbox_id} is not ready")
        if not self._present(config.image):
            raise ImageNotPresent(f"create_container {config.name}: image {config.image} "
                                  "is not present")
        target = self.containers.get(config.target_id) if config.target_id else None
        if config.target_id and (target is None or target.sandbox_id != sandbox_id
                                 or target.state != ContainerState.RUNNING):
            # containerd cannot join the PID namespace of a container not running
            raise ContainerRuntimeError(f"fake: create_container {config.name}: "
                                        f"targetContainerName: container "
                                        f"{config.target_id} is not running in the sandbox")
        try:
            script = script_for(sb.annotations, config.name)
        except ScriptError as e:
            raise ContainerRuntimeError(f"fake: create_container {config.name}: {e}") from None
        cid = self._new_id("c")
        self.configs[cid] = config
        self.scripts[cid] = script
        self.containers[cid] = Container(
            id=cid, sandbox_id=sandbox_id, pod_uid=sb.pod_uid, name=config.name,
            image=config.image, state=ContainerState.CREATED, attempt=config.attempt,
            restart_count=config.restart_count, created_at=self.clock.now(),
            image_id=_image_id(config.image),
            spec_hash=config.spec_hash, init=config.init,
            labels=dict(config.labels), annotations=dict(config.annotations),
            resources=config.resources)
        log_dir = self._log_dirs.get(sandbox_id)
        if log_dir and config.log_path:
            path = os.path.join(log_dir, config.log_path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()  # noqa: SIM115 - the runtime creates the file, like containerd
            self.containers[cid].log_path = path
        self._by_pod.setdefault(sb.pod_uid, set()).add(cid)
        return cid

    async def start_container(self, container_id: str) -> None:
        self._call("start_container")
        c = self.containers.get(container_id)
        if c is None:
            raise NotFound(f"start_container: container {container_id} not found")
        if c.state != ContainerState.CREATED:
            raise NotFound(f"start_container: container {container_id} is {c.state}")
        script = self.scripts.get(container_id, Script())
        if script.fail_start is not None:
            self._finish(c, 128, "StartError")  # as containerd reports a failed start
            c.message = script.fail_start
            raise ContainerRuntimeError(f"fake: start_container {c.name}: {script.fail_start}")
        c.state = ContainerState.RUNNING
        c.started_at = self.clock.now()
        self._event(ContainerEventType.STARTED, c.pod_uid, c.id, c.started_at)
        self.write_log(c.id, f"fake runtime: container {c.name} started (image {c.image}); "
                             "nothing runs in a fake container")
        if c.name in self.exit_on_start:
            code = self.exit_on_start[c.name]
            self._finish(c, code, "Completed" if code == 0 else "Error")
        elif script.run_for is not None:
            heapq.heappush(self._exits, (self.clock.monotonic() + script.run_for, c.id))
            for q in self._streams:  # each stream waits for the next exit due
                q.put_nowait(None)
            self._scripted_exits()  # run-for 0: at once

    async def stop_container(self, container_id: str, timeout: float) -> None:
        self._call("stop_container")
        self._scripted_exits()  # one due first ended it by itself
        c = self.containers.get(container_id)
        if c is None or c.state == ContainerState.EXITED:
            return
        if c.state == ContainerState.CREATED:
            self._finish(c, 0, "Stopped")
            return
        if c.name in self.ignore_sigterm:
            await self.clock.sleep(timeout)
            if c.state == ContainerState.RUNNING:
                self._finish(c, 137, "Killed")
            return
        self._finish(c, 143, "Stopped")

    async def update_container_resources(self, container_id: str, resources: Resources,
                                         oom_score_adj: int | None = None) -> None:
        """Apply the new CPU and memory to the container (its record and its config say
        so from then on); a memory limit below what the container uses is refused, as
        the kernel refuses it."""
        self._call("update_container_resources")
        c = self.containers.get(container_id)
        if c is None:
            raise NotFound(f"update_container_resources: container {container_id} not found")
        used = self._usage(c, self.clock.now()).memory_usage_bytes \
            if c.state == ContainerState.RUNNING else None
        if resources.memory_limit_bytes and used and resources.memory_limit_bytes < used:
            raise ContainerRuntimeError(
                f"fake: update_container_resources {c.name}: memory limit "
                f"{resources.memory_limit_bytes} is below the {used} bytes it uses")
        c.resources = resources
        config = self.configs.get(container_id)
        if config is not None:
            config.resources = resources
            if oom_score_adj is not None:
                config.oom_score_adj = oom_score_adj

    async def remove_container(self, container_id: str) -> None:
        self._call("remove_container")
        c = self.containers.pop(container_id, None)
        self.configs.pop(container_id, None)
        self.scripts.pop(container_id, None)
        if c is not None:
            self._forget(c.pod_uid, container_id)
            self._event(ContainerEventType.REMOVED, c.pod_uid, container_id)

    async def exec_sync(self, container_id: str, cmd: list[str],
                        timeout: float) -> ExecResult:
        self._call("exec_sync")
        c = self.containers.get(container_id)
        if c is None:
            raise NotFound(f"exec_sync: container {container_id} not found")
        if c.state != ContainerState.RUNNING:
            raise ContainerRuntimeError(f"exec_sync: container {c.name} is {c.state}, "
                                        "not running")
        self.execs.append((c.name, list(cmd)))
        if (starting := self._not_up_yet(c)) is not None:
            return starting
        answer = self.exec_results.get(c.name, ExecResult(0))
        if callable(answer) and not isinstance(answer, BaseException):
            answer = answer(list(cmd))
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def simulated_network(self, container_id: str, action: str) -> ExecResult | None:
        if self.dial:
            return None
        c = self.containers.get(container_id)
        name = c.name if c is not None else ""
        self.network_probes.append((name, action))
        if c is None or c.state != ContainerState.RUNNING:
            return ExecResult(1, f"fake: container {name or container_id} is not "
                                 "running".encode())
        if (starting := self._not_up_yet(c)) is not None:
            return starting
        return self.network_results.get(name, ExecResult(0))

    def _not_up_yet(self, c: Container) -> ExecResult | None:
        """A failed probe while a scripted container is still coming up (ready-after)."""
        script = self.scripts.get(c.id)
        if script is None or not script.ready_after or c.started_at is None:
            return None
        up = c.started_at + dt.timedelta(seconds=script.ready_after)
        if self.clock.now() >= up:
            return None
        return ExecResult(1, f"fake: container {c.name} is not up yet (ready after "
                             f"{script.ready_after:g}s)".encode())

    async def container_stats(self) -> list[ContainerStats]:
        """Each running container's simulated usage (see _usage)."""
        self._call("container_stats")
        self._scripted_exits()
        now = self.clock.now()
        return [self._usage(c, now) for c in self.containers.values()
                if c.state == ContainerState.RUNNING and c.started_at is not None]

    def _usage(self, c: Container, now: dt.datetime) -> ContainerStats:
        """A running container's usage: its script's (or the defaults'), CPU as
        core-seconds since it started, memory as the level now, the disk its writable
        layer holds and the processes it runs (runtime/script.py)."""
        script = self.scripts.get(c.id, Script())
        t = (now - c.started_at).total_seconds() if c.started_at else 0.0
        memory = int((script.memory or self.default_memory).at(t))
        return ContainerStats(
            container_id=c.id, timestamp=now,
            cpu_usage_core_seconds=(script.cpu or self.default_cpu).integral(t),
            memory_working_set_bytes=memory, memory_usage_bytes=memory,
            writable_layer_bytes=script.disk,
            writable_layer_inodes=1 if script.disk else 0, processes=script.processes)

    async def rotate_container_log(self, container_id: str, path: str, rotated: str) -> None:
        self._call("rotate_container_log")
        if container_id not in self.containers:
            raise NotFound(f"rotate_container_log: container {container_id} not found")
        os.rename(path, rotated)
        open(path, "a").close()  # noqa: SIM115 - reopened, as CRI ReopenContainerLog does

    async def image_present(self, ref: str) -> bool:
        self._call("image_present")
        return self._present(ref)

    async def image_user(self, ref: str) -> tuple[int | None, str]:
        self._call("image_user")
        if not self._present(ref):
            raise ImageNotPresent(f"image_user: image {ref} is not present")
        return self.image_users.get(ref, (None, ""))

    async def pull_image(self, ref: str, auth: RegistryAuth | None = None) -> ImageInfo:
        self._call("pull_image")
        self.pulls.append((ref, auth))
        self.pulling += 1
        self.max_pulling = max(self.max_pulling, self.pulling)
        try:
            if self.pull_delay:
                await self.clock.sleep(self.pull_delay)
        finally:
            self.pulling -= 1
        if _tagged(ref) not in {_tagged(r) for r in self.registry}:
            if self.images is not None:
                raise PullFailed(f"fake PullImage {ref}: not found in the registry")
        else:
            need = next(v for r, v in self.registry.items() if _tagged(r) == _tagged(ref))
            if need is not None and (auth is None or (auth.username, auth.password) !=
                                     (need.username, need.password)):
                raise PullFailed(f"fake PullImage {ref}: 401 Unauthorized")
        if self.images is not None:
            self.images.add(_tagged(ref))
        return ImageInfo(id=_image_id(ref), names=[_tagged(ref)], size_bytes=self.image_size)

    async def list_images(self) -> list[ImageInfo]:
        self._call("list_images")
        refs = self.images if self.images is not None else {_tagged(c.image) for c in
                                                            self.containers.values()}
        return [ImageInfo(id=_image_id(r), names=[r], size_bytes=self.image_size,
                          pinned=r in self.pinned) for r in sorted(refs)]

    async def remove_image(self, image_id: str) -> None:
        self._call("remove_image")
        if self.images is None:
            raise Unsupported("the fake runtime was made with every image present; it "
                              "has none to remove")
        for ref in [r for r in self.images if _image_id(r) == image_id]:
            self.images.discard(ref)


def _image_id(ref: str) -> str:
    """The id the fake store gives an image: a hash of its tagged name."""
    return "sha256:" + hashlib.sha256(_tagged(ref).encode()).hexdigest()


def _tagged(ref: str) -> str:
    """`ref` with the tag a runtime assumes when it names none (":latest")."""
    last = ref.rsplit("/", 1)[-1]
    return ref if ":" in last or "@" in last else ref + ":latest"
