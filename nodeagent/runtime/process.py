"""ProcessRuntime: every container is a local process, so the agent runs anywhere.

- A container runs `command + args` (env and workingDir from the pod spec) in its own
  session and process group, with stdout and stderr appended to its log file
  (`<log dir>/<container>/<attempt>.log`). The image name is only a label: every image
  is present, and a pull fetches nothing.
- The process is started through a tiny `/bin/sh` wrapper that writes its PID to
  `<id>.pid`, waits for the workload and writes the exit code to `<id>.exit`. The exit
  code therefore survives an agent restart, even when the agent is no longer the
  parent. The wrapper defers SIGTERM/INT/HUP/QUIT until the workload has exited, so
  signalling the group stops the workload and still records its code.
- Sandboxes are records only (no network namespace): pods share the host network.
- State is one small JSON per sandbox and per container under `state_dir`, written
  atomically. A restarted agent reloads it and adopts running processes by PID, after
  checking that the PID still belongs to the process recorded (same boot, same start
  time in /proc), so it never starts a duplicate. A lock file keeps two agents from
  sharing one state dir.
- stop = SIGTERM to the process group, SIGKILL after the timeout.
- Events (`container_events`): starts, stops and removals are reported as this runtime
  does them; exits as they happen, each running wrapper watched with a pidfd on the
  event loop while a stream is open.

Blocking work (fork/exec, /proc reads, waits) runs in threads; one lock guards state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nodeagent.api.clock import Clock, RealClock
from nodeagent.runtime.base import (
    ANNOTATION_INIT,
    ANNOTATION_RESTART_COUNT,
    ANNOTATION_SPEC_HASH,
    LABEL_CONTAINER_NAME,
    LABEL_POD_NAME,
    LABEL_POD_NAMESPACE,
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
    NotFound,
    PodRuntimeStatus,
    RegistryAuth,
    RelistResult,
    Resources,
    Runtime,
    RuntimeTimeout,
    RuntimeVersion,
    Sandbox,
    SandboxConfig,
    SandboxState,
    StreamRequest,
    Unsupported,
)
from nodeagent.runtime.execserver import ExecSpec, StreamingServer
from nodeagent.runtime.security import UNCONFINED, ContainerSecurity

log = logging.getLogger(__name__)
T = TypeVar("T")

LABEL_ATTEMPT = "nodepulse.dev/attempt"
ANNOTATION_PID = "nodepulse.dev/pid"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
START_ERROR_CODE = 128  # what containerd reports when a container cannot start

# $0 is the record's path prefix; "$@" the workload, run through env so it is always
# a program of its own (never a shell builtin). A trapped signal is handled only after
# the foreground workload ends, so the wrapper always records the code.
WRAPPER = ('echo $$ > "$0.pid"; trap : TERM INT HUP QUIT; env -- "$@"; rc=$?; '
           'echo $rc > "$0.exit"; exit $rc')


_WRAPPER_ARGV = b"/bin/sh\0-c\0" + WRAPPER.encode() + b"\0"


def default_state_dir() -> Path:
    env = os.environ.get("NODEPULSE_PROCESS_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/nodepulse/process")
    return Path.home() / ".local" / "state" / "nodepulse" / "process"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, process group, start time in clock ticks) from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rpartition(")")[2].split()
    return fields[0], int(fields[2]), int(fields[19])


def _iso(t: dt.datetime | None) -> str | None:
    return t.isoformat() if t else None


def _parse(t: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(t) if t else None


@dataclass
class _SandboxRec:
    id: str
    uid: str
    name: str
    namespace: str
    attempt: int
    state: str
    created_at: str | None
    log_directory: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass
class _ContainerRec:
    id: str
    sandbox_id: str
    pod_uid: str
    name: str
    image: str
    attempt: int
    restart_count: int
    argv: list[str]
    env: list[list[str]]
    working_dir: str
    log_path: str
    state: str = ContainerState.CREATED.value
    created_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    pid: int | None = None
    start_ticks: int | None = None
    boot_id: str = ""
    killed: bool = False  # we escalated to SIGKILL
    spec_hash: str = ""
    init: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def _refuse_security(sec: ContainerSecurity, where: str) -> None:
    """A process runs as the agent's own user, with its privileges and in the host's
    filesystem: a security setting that would change that cannot be honoured."""
    own_groups = {os.getgid(), *os.getgroups()}
    why = ""
    if sec.run_as_user is not None and sec.run_as_user != os.getuid():
        why = f"runAsUser {sec.run_as_user}: every process runs as the agent's user " \
              f"(uid {os.getuid()})"
    elif sec.run_as_group is not None and sec.run_as_group != os.getgid():
        why = f"runAsGroup {sec.run_as_group}: every process runs with the agent's group " \
              f"(gid {os.getgid()})"
    elif set(sec.supplemental_groups) - own_groups:
        why = f"supplementalGroups/fsGroup {sorted(set(sec.supplemental_groups) - own_groups)}:" \
              " every process has the agent's groups"
    elif sec.privileged:
        why = "privileged: a process has the agent's privileges, no more"
    elif sec.readonly_rootfs:
        why = "readOnlyRootFilesystem: a process writes to the host's filesystem"
    elif sec.no_new_privs:
        why = "allowPrivilegeEscalation: false: not applied to processes"
    elif sec.capabilities_add or sec.capabilities_drop:
        why = "capabilities: a process has the agent's capabilities"
    elif sec.seccomp.kind != UNCONFINED:
        why = f"seccompProfile {sec.seccomp.kind}: processes run without a seccomp filter"
    elif sec.apparmor is not None and sec.apparmor.kind != UNCONFINED:
        why = f"appArmorProfile {sec.apparmor.kind}: processes run unconfined"
    elif sec.selinux is not None:
        why = "seLinuxOptions: processes keep the agent's SELinux label"
    if why:
        raise Unsupported(f"{where}.{why} (the process runtime)")


class ProcessRuntime(Runtime):
    """Containers as local processes. `state_dir` holds records, wrapper files and (by
    default) logs; `host_ip` is reported as every sandbox's IP (pods share the host
    network); `kill_wait` bounds the wait after SIGKILL."""

    scheme = "process"
    log_format = "raw"  # the program writes straight to the file: no times, no streams
    can_mount = False  # a process sees the host's filesystem as it is
    cgroups = "none"  # a process runs in the agent's own cgroup

    def __init__(self, state_dir: str | Path | None = None, *, clock: Clock | None = None,
                 host_ip: str = "", kill_wait: float = 10.0) -> None:
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.clock = clock or RealClock()
        self.host_ip = host_ip
        self.kill_wait = kill_wait
        self._lock = threading.RLock()
        self._sandboxes: dict[str, _SandboxRec] = {}
        self._containers: dict[str, _ContainerRec] = {}
        self._children: dict[str, subprocess.Popen[bytes]] = {}  # ours to reap
        self._starting: set[str] = set()  # between fork and the saved RUNNING record
        self._boot = _boot_id()
        self._streaming: StreamingServer | None = None  # exec, started at the first one
        # open event streams, all on one event loop; the pidfds watched on it, by
        # container id, and the tasks reading the exits they report
        self._streams: list[asyncio.Queue[ContainerEvent]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit_fds: dict[str, int] = {}
        self._exit_tasks: set[asyncio.Task[None]] = set()
        # Our own threads, not the event loop's default pool: the pod status writes and
        # the API source use that one, and while the API server is down each of their
        # calls holds a thread for up to its timeout; relists must not queue behind them.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="process-runtime")
        for sub in ("sandboxes", "containers", "pods", "logs"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        self._lockfile = self._take_lock()
        self._load()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # --- persistence -----------------------------------------------------------------

    def _take_lock(self) -> Any:
        path = self.state_dir / "lock"
        f = open(path, "a+")  # noqa: SIM115 - held for the runtime's lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise ContainerRuntimeError(
                f"process runtime: state dir {self.state_dir} is in use by another agent "
                f"(pid {holder})") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        return f

    def _write(self, path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, path)

    def _save_sandbox(self, s: _SandboxRec) -> None:
        self._write(self.state_dir / "sandboxes" / f"{s.id}.json", dataclasses.asdict(s))

    def _save(self, c: _ContainerRec) -> None:
        self._write(self._base(c.id).with_suffix(".json"), dataclasses.asdict(c))

    def _base(self, cid: str) -> Path:
        """Path prefix of a container's files (<base>.json, .pid, .exit)."""
        return self.state_dir / "containers" / cid

    def _load(self) -> None:
        for kind, cls, into in (("sandboxes", _SandboxRec, self._sandboxes),
                                ("containers", _ContainerRec, self._containers)):
            for path in sorted((self.state_dir / kind).glob("*.json")):
                try:
                    rec = cls(**json.loads(path.read_text()))
                except (OSError, ValueError, TypeError) as e:
                    # keep the bytes for a human, never crash the agent on one bad file
                    bad = path.with_name(path.name + ".corrupt")
                    log.error("process runtime: %s is unreadable (%s); moved to %s",
                              path, e, bad)
                    with contextlib.suppress(OSError):
                        os.replace(path, bad)
                    continue
                into[rec.id] = rec  # type: ignore[assignment]
        with self._lock:
            for c in self._containers.values():
                self._refresh(c)

    # --- process identity and exit -----------------------------------------------------

    def _same_process(self, c: _ContainerRec) -> bool:
        """The recorded PID is still our wrapper (same boot, same start time)."""
        if c.pid is None or c.boot_id != self._boot:
            return False
        st = _proc_stat(c.pid)
        return st is not None and st[2] == c.start_ticks

    def _alive(self, c: _ContainerRec) -> bool:
        child = self._children.get(c.id)
        if child is not None:
            return child.poll() is None
        if not self._same_process(c):
            return False
        st = _proc_stat(c.pid) if c.pid else None
        return st is not None and st[0] != "Z"

    def _adopt_started(self, c: _ContainerRec) -> None:
        """A CREATED record whose wrapper wrote its pid file: an earlier agent died
        between starting the process and saving the record. Adopt it."""
        try:
            pid = int(self._base(c.id).with_suffix(".pid").read_text().strip())
            mtime = self._base(c.id).with_suffix(".pid").stat().st_mtime
        except (OSError, ValueError):
            return
        st = _proc_stat(pid)
        if st is not None and not self._is_wrapper(pid, c.id):
            st = None  # the number was reused by something else: ours has exited
        c.pid, c.boot_id = pid, self._boot
        c.start_ticks = st[2] if st else None
        c.started_at = _iso(dt.datetime.fromtimestamp(mtime, dt.UTC))
        c.state = ContainerState.RUNNING.value
        self._save(c)
        self._emit(ContainerEventType.STARTED, c.pod_uid, c.id)

    def _is_wrapper(self, pid: int, cid: str) -> bool:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return len(args) > 3 and args[3] == str(self._base(cid)).encode()

    def _refresh(self, c: _ContainerRec) -> None:
        if (c.state == ContainerState.CREATED.value and c.pid is None
                and c.id not in self._starting):
            self._adopt_started(c)
        if c.state == ContainerState.RUNNING.value and not self._alive(c):
            self._finish(c)

    def _read_exit(self, cid: str) -> int | None:
        try:
            return int(self._base(cid).with_suffix(".exit").read_text().strip())
        except (OSError, ValueError):
            return None

    def _finish(self, c: _ContainerRec) -> None:
        child = self._children.pop(c.id, None)
        code = self._read_exit(c.id)
        message = ""
        if code is None and child is not None and child.returncode is not None:
            rc = child.returncode
            code = 128 - rc if rc < 0 else rc  # killed by signal N -> 128 + N
        if code is None:
            code = 137
            message = ("killed after the stop timeout" if c.killed else
                       "the process and its wrapper were killed; exit code not recorded")
        self._reap_group(c)
        c.state = ContainerState.EXITED.value
        c.exit_code = code
        c.reason = "Completed" if code == 0 else "Error"
        c.message = message
        finished = self.clock.now()
        if isinstance(self.clock, RealClock):
            # the wrapper's file says when, even for an exit while no agent ran
            with contextlib.suppress(OSError):
                mtime = self._base(c.id).with_suffix(".exit").stat().st_mtime
                finished = dt.datetime.fromtimestamp(mtime, dt.UTC)
        started = _parse(c.started_at)
        # file times are coarser than the clock: a quick exit may look older than the
        # start we recorded once exec was confirmed
        if started is not None and finished < started:
            finished = started
        c.finished_at = _iso(finished)
        self._save(c)
        self._emit(ContainerEventType.DIED, c.pod_uid, c.id)

    def _reap_group(self, c: _ContainerRec) -> None:
        """When the wrapper is gone the container is gone: like a container's PID 1
        ending, whatever is left in its process group is killed. Linux does not reuse
        a number while a process group of that id exists, so unless the number now
        names another process, a group of that id is still ours."""
        if c.pid is None or c.boot_id != self._boot:
            return
        leader = _proc_stat(c.pid)
        if leader is not None and leader[2] != c.start_ticks:
            return  # the number was reused: not our group any more
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.pid, signal.SIGKILL)

    def _signal_group(self, c: _ContainerRec, sig: int) -> None:
        if self._same_process(c) and c.pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.pid, sig)

    async def _await_exit(self, c: _ContainerRec, timeout: float) -> bool:
        """Wait up to `timeout` s for the wrapper to exit; True if it did. Waits on the
        event loop (a pidfd becomes readable at exit, child or not), never in a worker
        thread: a long grace period must not tie up the threads the relist uses."""
        if c.pid is None:
            return True
        try:
            fd = os.pidfd_open(c.pid)
        except ProcessLookupError:
            return True
        except OSError:  # no pidfd (old kernel): poll
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not await self._call(self._locked_alive, c):
                    return True
                await asyncio.sleep(0.05)
            return not await self._call(self._locked_alive, c)
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()
        try:
            if not await self._call(self._locked_same, c):
                return True  # checked after pinning the pid: the pidfd is another's
            def readable() -> None:
                if not exited.done():
                    exited.set_result(None)
            loop.add_reader(fd, readable)
            try:
                await asyncio.wait_for(exited, max(0.0, timeout))
                return True
            except TimeoutError:
                return False
            finally:
                loop.remove_reader(fd)
        finally:
            os.close(fd)

    def _locked_alive(self, c: _ContainerRec) -> bool:
        with self._lock:
            return self._alive(c)

    def _locked_same(self, c: _ContainerRec) -> bool:
        with self._lock:
            return self._same_process(c)

    # --- events ----------------------------------------------------------------------

    def _emit(self, type_: ContainerEventType, pod_uid: str, rid: str) -> None:
        """Called with the lock held, from any thread."""
        if not self._streams or self._loop is None:
            return
        ev = ContainerEvent(type_, pod_uid, rid, self.clock.now())
        for q in self._streams:
            self._loop.call_soon_threadsafe(q.put_nowait, ev)
        if type_ == ContainerEventType.STARTED and rid in self._containers:
            self._loop.call_soon_threadsafe(self._watch_exit, rid)

    def _watch_exit(self, cid: str) -> None:
        """On the event loop: report the container's exit when its wrapper ends."""
        with self._lock:
            c = self._containers.get(cid)
            if (c is None or c.pid is None or cid in self._exit_fds or not self._streams
                    or c.state != ContainerState.RUNNING.value):
                return
            try:
                fd = os.pidfd_open(c.pid)
            except OSError:  # already gone
                fd = -1
            if fd >= 0 and not self._same_process(c):  # checked after pinning the pid
                os.close(fd)
                fd = -1
        if fd < 0:
            self._exited(cid)
            return
        self._exit_fds[cid] = fd
        asyncio.get_running_loop().add_reader(fd, self._exited, cid)

    def _exited(self, cid: str) -> None:
        fd = self._exit_fds.pop(cid, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        c = self._containers.get(cid)
        if c is not None:  # the exit code is read, and DIED sent, by the refresh
            task = asyncio.create_task(self._call(self._settle, c))
            self._exit_tasks.add(task)
            task.add_done_callback(self._exit_tasks.discard)

    def _unwatch_all(self) -> None:
        for cid in list(self._exit_fds):
            fd = self._exit_fds.pop(cid)
            if self._loop is not None:
                self._loop.remove_reader(fd)
            os.close(fd)

    async def container_events(self) -> AsyncIterator[ContainerEvent]:
        try:
            os.close(os.pidfd_open(os.getpid()))
        except OSError as e:
            raise Unsupported(f"the process runtime watches exits with pidfds, which this "
                              f"kernel does not offer ({e})") from None
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[ContainerEvent] = asyncio.Queue()
        with self._lock:
            if self._loop is not None and self._loop is not loop:
                raise ContainerRuntimeError("process runtime: event streams are served on "
                                            "one event loop only")
            self._loop = loop
            self._streams.append(q)
            running = [c.id for c in self._containers.values()
                       if c.state == ContainerState.RUNNING.value]
        for cid in running:
            self._watch_exit(cid)
        return self._deliver(q)

    async def _deliver(self, q: asyncio.Queue[ContainerEvent]) -> AsyncIterator[ContainerEvent]:
        try:
            while True:
                yield await q.get()
        finally:
            with self._lock:
                self._streams.remove(q)
                if not self._streams:
                    self._unwatch_all()
                    self._loop = None

    # --- records to interface objects ----------------------------------------------

    def _sandbox_obj(self, s: _SandboxRec) -> Sandbox:
        return Sandbox(id=s.id, pod_uid=s.uid, name=s.name, namespace=s.namespace,
                       attempt=s.attempt, state=SandboxState(s.state),
                       created_at=_parse(s.created_at), ip=self.host_ip, host_network=True,
                       labels=dict(s.labels), annotations=dict(s.annotations))

    def _container_obj(self, c: _ContainerRec) -> Container:
        annotations = dict(c.annotations)
        if c.pid is not None:
            annotations[ANNOTATION_PID] = str(c.pid)
        return Container(
            id=c.id, sandbox_id=c.sandbox_id, pod_uid=c.pod_uid, name=c.name, image=c.image,
            state=ContainerState(c.state), attempt=c.attempt, restart_count=c.restart_count,
            exit_code=c.exit_code, reason=c.reason, message=c.message,
            created_at=_parse(c.created_at), started_at=_parse(c.started_at),
            finished_at=_parse(c.finished_at), image_id=c.image, spec_hash=c.spec_hash,
            init=c.init, labels=dict(c.labels), annotations=annotations,
            log_path=c.log_path)

    # --- synchronous bodies (run in threads) ------------------------------------------

    def _relist(self) -> RelistResult:
        with self._lock:
            for c in self._containers.values():
                self._refresh(c)
            return RelistResult(sandboxes=[self._sandbox_obj(s) for s in self._sandboxes.values()],
                                containers=[self._container_obj(c)
                                            for c in self._containers.values()])

    def _pod_status(self, uid: str) -> PodRuntimeStatus:
        with self._lock:
            cs = [c for c in self._containers.values() if c.pod_uid == uid]
            for c in cs:
                self._refresh(c)
            sbs = sorted((s for s in self._sandboxes.values() if s.uid == uid),
                         key=lambda s: (s.attempt, s.created_at or ""), reverse=True)
            return PodRuntimeStatus(uid=uid, sandboxes=[self._sandbox_obj(s) for s in sbs],
                                    containers=[self._container_obj(c) for c in cs])

    def _run_sandbox(self, config: SandboxConfig) -> str:
        where = f"process run_sandbox {config.namespace}/{config.name}"
        if config.security.sysctls:
            raise Unsupported(f"{where}: spec.securityContext.sysctls: the process runtime "
                              "runs pods in the host's namespaces, where a sysctl would "
                              "change the whole node")
        if config.runtime_handler:
            raise Unsupported(f"{where}: spec.runtimeClassName: the process runtime has no "
                              f"runtime handler {config.runtime_handler!r}")
        if config.dns is not None:
            raise Unsupported(f"{where}: dnsPolicy/dnsConfig: the process runtime runs pods "
                              "in the host's filesystem, with the node's /etc/resolv.conf; "
                              "use dnsPolicy: Default without dnsConfig")
        sid = uuid.uuid4().hex
        log_dir = config.log_directory or str(
            self.state_dir / "logs" / f"{config.namespace}_{config.name}_{config.uid}")
        labels = {**config.labels, LABEL_POD_UID: config.uid, LABEL_POD_NAME: config.name,
                  LABEL_POD_NAMESPACE: config.namespace, LABEL_ATTEMPT: str(config.attempt)}
        rec = _SandboxRec(id=sid, uid=config.uid, name=config.name,
                          namespace=config.namespace, attempt=config.attempt,
                          state=SandboxState.READY.value, created_at=_iso(self.clock.now()),
                          log_directory=log_dir, labels=labels,
                          annotations=dict(config.annotations))
        (self.state_dir / "pods" / sid).mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._sandboxes[sid] = rec
            self._save_sandbox(rec)
            self._emit(ContainerEventType.STARTED, rec.uid, sid)
        return sid

    def _create(self, sandbox_id: str, config: ContainerConfig) -> str:
        argv = [*config.command, *config.args]
        where = f"process create_container {config.pod_namespace}/{config.pod_name} " \
                f"container {config.name}"
        if not argv:
            raise ContainerRuntimeError(f"{where}: command and args are both empty (the "
                                        "process runtime has no image entrypoint)")
        if config.stdin or config.tty:
            field_name = "tty" if config.tty else "stdin"
            raise ContainerRuntimeError(f"{where}: {field_name}: the process runtime cannot "
                                        "give a process a terminal or keep its stdin open")
        _refuse_security(config.security, f"{where}: securityContext")
        r = config.resources
        if r.cpu_limit_millis is not None or r.memory_limit_bytes is not None:
            which = "cpu" if r.cpu_limit_millis is not None else "memory"
            raise Unsupported(f"{where}: resources.limits.{which}: the process runtime runs "
                              "a process in the agent's own cgroup, where no limit of its "
                              "own would be enforced")
        if config.mounts:
            raise Unsupported(f"{where}: volumeMounts: the process runtime runs a process "
                              f"in the host's filesystem and cannot mount "
                              f"{config.mounts[0].container_path} into it")
        with self._lock:
            sb = self._sandboxes.get(sandbox_id)
            if sb is None:
                raise NotFound(f"{where}: sandbox {sandbox_id} not found")
            if sb.state != SandboxState.READY.value:
                raise NotFound(f"{where}: sandbox {sandbox_id} is not ready")
            # every process runs in the node's PID namespace, the target's too: an
            # ephemeral container sees its target's processes as long as it runs
            target = self._containers.get(config.target_id) if config.target_id else None
            if target is not None:
                self._refresh(target)
            if config.target_id and (target is None or target.sandbox_id != sandbox_id
                                     or target.state != ContainerState.RUNNING.value):
                raise ContainerRuntimeError(f"{where}: targetContainerName: container "
                                            f"{config.target_id} is not running in the pod")
            cid = uuid.uuid4().hex
            rel = config.log_path or f"{config.name}/{config.attempt}.log"
            labels = {**config.labels, LABEL_POD_UID: config.pod_uid,
                      LABEL_CONTAINER_NAME: config.name, LABEL_ATTEMPT: str(config.attempt)}
            annotations = {**config.annotations,
                           ANNOTATION_RESTART_COUNT: str(config.restart_count)}
            if config.spec_hash:
                annotations[ANNOTATION_SPEC_HASH] = config.spec_hash
            if config.init:
                annotations[ANNOTATION_INIT] = "true"
            env = [["PATH", os.environ.get("PATH", DEFAULT_PATH)],
                   ["HOME", os.environ.get("HOME", "/")], ["HOSTNAME", sb.name],
                   *([k, v] for k, v in config.env)]
            rec = _ContainerRec(
                id=cid, sandbox_id=sandbox_id, pod_uid=sb.uid, name=config.name,
                image=config.image, attempt=config.attempt,
                restart_count=config.restart_count, argv=argv, env=env,
                working_dir=config.working_dir,
                log_path=str(Path(sb.log_directory) / rel),
                created_at=_iso(self.clock.now()), spec_hash=config.spec_hash,
                init=config.init, labels=labels, annotations=annotations)
            self._containers[cid] = rec
            self._save(rec)
            return cid

    def _start_error(self, c: _ContainerRec, message: str) -> ContainerRuntimeError:
        c.state = ContainerState.EXITED.value
        c.exit_code, c.reason, c.message = START_ERROR_CODE, "StartError", message
        c.finished_at = _iso(self.clock.now())
        self._save(c)
        self._emit(ContainerEventType.DIED, c.pod_uid, c.id)
        return ContainerRuntimeError(f"process start_container {c.id} ({c.name}): {message}")

    def _start(self, cid: str) -> None:
        # checks under the lock; fork/exec and the wait for exec outside it, so starts
        # run side by side and a relist never waits behind one
        with self._lock:
            c = self._containers.get(cid)
            if c is None:
                raise NotFound(f"process start_container: container {cid} not found")
            self._refresh(c)
            if c.state != ContainerState.CREATED.value or cid in self._starting:
                raise ContainerRuntimeError(
                    f"process start_container {cid} ({c.name}): container is "
                    f"{'starting' if cid in self._starting else c.state}; a restart is a "
                    "new container")
            env = dict((k, v) for k, v in c.env)
            cwd = c.working_dir or str(self.state_dir / "pods" / c.sandbox_id)
            if not os.path.isdir(cwd):
                raise self._start_error(c, f"workingDir {cwd} does not exist")
            exe = c.argv[0]
            found = (os.access(os.path.join(cwd, exe), os.X_OK) if "/" in exe
                     else shutil.which(exe, path=env.get("PATH", DEFAULT_PATH)))
            if not found:
                raise self._start_error(c, f"executable {exe!r} not found"
                                           + ("" if "/" in exe else " in $PATH"))
            self._starting.add(cid)
        try:
            Path(c.log_path).parent.mkdir(parents=True, exist_ok=True)
            base = self._base(cid)
            for suffix in (".pid", ".exit"):
                with contextlib.suppress(FileNotFoundError):
                    base.with_suffix(suffix).unlink()
            with open(c.log_path, "ab") as logf:
                try:
                    proc = subprocess.Popen(
                        ["/bin/sh", "-c", WRAPPER, str(base), *c.argv], cwd=cwd, env=env,
                        stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                        start_new_session=True, close_fds=True)
                except OSError as e:
                    with self._lock:
                        raise self._start_error(c, f"cannot start /bin/sh: {e}") from e
            self._wait_forked(proc)
            st = _proc_stat(proc.pid)
            with self._lock:
                self._children[cid] = proc
                c.pid, c.boot_id = proc.pid, self._boot
                c.start_ticks = st[2] if st else None
                c.state = ContainerState.RUNNING.value
                c.started_at = _iso(self.clock.now())
                self._save(c)
                self._emit(ContainerEventType.STARTED, c.pod_uid, cid)
        finally:
            with self._lock:
                self._starting.discard(cid)

    @staticmethod
    def _wait_forked(proc: subprocess.Popen[bytes], limit: float = 5.0) -> None:
        """Return once the workload has been exec'd (or the wrapper ended). A SIGTERM
        sent earlier would reach only the wrapper, whose trap defers it, or the forked
        child before exec, still running the wrapper's handler: the workload would
        never see it. So "started" means the workload program runs."""
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        deadline = time.monotonic() + limit
        pause = 0.0002
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                kids = children.read_text().split()
                if kids:
                    with contextlib.suppress(OSError):
                        # empty while an exec is under way; the wrapper's own argv until
                        # the forked child has exec'd
                        argv = Path(f"/proc/{kids[0]}/cmdline").read_bytes()
                        if argv and not argv.startswith(_WRAPPER_ARGV):
                            return
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
        except OSError:
            return  # no /proc children file here: best effort

    def _stop_begin(self, cid: str, timeout: float) -> _ContainerRec | None:
        """First step of a stop: the record if it runs (SIGTERM sent), else None."""
        with self._lock:
            c = self._containers.get(cid)
            if c is None:
                return None
            self._refresh(c)
            if c.state == ContainerState.CREATED.value:
                c.state, c.exit_code, c.reason = ContainerState.EXITED.value, 0, "Stopped"
                c.finished_at = _iso(self.clock.now())
                self._save(c)
                self._emit(ContainerEventType.DIED, c.pod_uid, cid)
                return None
            if c.state != ContainerState.RUNNING.value:
                return None
            if timeout > 0:
                self._signal_group(c, signal.SIGTERM)
            return c

    def _kill(self, c: _ContainerRec) -> None:
        with self._lock:
            c.killed = True
            self._signal_group(c, signal.SIGKILL)

    def _settle(self, c: _ContainerRec) -> None:
        with self._lock:
            self._refresh(c)

    def _sandbox_containers(self, sid: str) -> list[str]:
        with self._lock:
            return [c.id for c in self._containers.values() if c.sandbox_id == sid]

    def _mark_sandbox(self, sid: str, state: SandboxState) -> None:
        with self._lock:
            sb = self._sandboxes.get(sid)
            if sb is not None and sb.state != state.value:
                sb.state = state.value
                self._save_sandbox(sb)
                self._emit(ContainerEventType.STARTED if state == SandboxState.READY
                           else ContainerEventType.DIED, sb.uid, sid)

    def _forget_container(self, cid: str) -> None:
        with self._lock:
            c = self._containers.pop(cid, None)
            if c is None:
                return
            self._emit(ContainerEventType.REMOVED, c.pod_uid, cid)
            self._children.pop(cid, None)
            base = self._base(cid)
            for suffix in (".json", ".pid", ".exit"):
                with contextlib.suppress(FileNotFoundError):
                    base.with_suffix(suffix).unlink()

    def _forget_sandbox(self, sid: str) -> None:
        with self._lock:
            sb = self._sandboxes.pop(sid, None)
            if sb is None:
                return
            self._emit(ContainerEventType.REMOVED, sb.uid, sid)
            with contextlib.suppress(FileNotFoundError):
                (self.state_dir / "sandboxes" / f"{sid}.json").unlink()
            shutil.rmtree(self.state_dir / "pods" / sid, ignore_errors=True)
            logs = Path(sb.log_directory)
            if logs.is_relative_to(self.state_dir / "logs") and not any(
                    s.log_directory == sb.log_directory for s in self._sandboxes.values()):
                shutil.rmtree(logs, ignore_errors=True)

    # --- Runtime ---------------------------------------------------------------------

    async def version(self) -> RuntimeVersion:
        return RuntimeVersion("process", "0.1.0", "v1")

    async def relist(self) -> RelistResult:
        return await self._call(self._relist)

    async def pod_status(self, pod_uid: str) -> PodRuntimeStatus:
        return await self._call(self._pod_status, pod_uid)

    async def run_sandbox(self, config: SandboxConfig) -> str:
        return await self._call(self._run_sandbox, config)

    async def stop_sandbox(self, sandbox_id: str) -> None:
        # like StopPodSandbox: whatever still runs is killed (grace was the caller's job)
        ids = await self._call(self._sandbox_containers, sandbox_id)
        await asyncio.gather(*(self.stop_container(cid, 0) for cid in ids))
        await self._call(self._mark_sandbox, sandbox_id, SandboxState.NOTREADY)

    async def remove_sandbox(self, sandbox_id: str) -> None:
        await self.stop_sandbox(sandbox_id)
        for cid in await self._call(self._sandbox_containers, sandbox_id):
            await self.remove_container(cid)
        await self._call(self._forget_sandbox, sandbox_id)

    async def create_container(self, sandbox_id: str, config: ContainerConfig,
                               sandbox_config: SandboxConfig) -> str:
        return await self._call(self._create, sandbox_id, config)

    async def start_container(self, container_id: str) -> None:
        await self._call(self._start, container_id)

    async def stop_container(self, container_id: str, timeout: float) -> None:
        c = await self._call(self._stop_begin, container_id, timeout)
        if c is None:
            return
        if timeout <= 0 or not await self._await_exit(c, timeout):
            await self._call(self._kill, c)
            await self._await_exit(c, self.kill_wait)
        await self._call(self._settle, c)

    async def update_container_resources(self, container_id: str, resources: Resources,
                                         oom_score_adj: int | None = None) -> None:
        """Refused: a process runs in the agent's own cgroup, so no CPU or memory of its
        own can be set, at its start or later (an in-place resize says why)."""
        raise Unsupported(f"process update_container_resources {container_id}: the process "
                          "runtime runs a process in the agent's own cgroup and cannot "
                          "change its CPU or memory in place")

    async def remove_container(self, container_id: str) -> None:
        await self.stop_container(container_id, 0)
        await self._call(self._forget_container, container_id)

    async def image_present(self, ref: str) -> bool:
        return True  # the image is only a label here

    async def image_user(self, ref: str) -> tuple[int | None, str]:
        return os.getuid(), ""  # every process runs as the agent's own user

    async def pull_image(self, ref: str, auth: RegistryAuth | None = None) -> ImageInfo:
        """Nothing to fetch: an image is only a label here, so every image is present
        and a pull (imagePullPolicy Always) succeeds at once, without a registry."""
        return ImageInfo(id="sha256:" + hashlib.sha256(ref.encode()).hexdigest(),
                         names=[ref], size_bytes=0)

    async def list_images(self) -> list[ImageInfo]:
        with self._lock:
            refs = sorted({c.image for c in self._containers.values()})
        return [ImageInfo(id="sha256:" + hashlib.sha256(r.encode()).hexdigest(), names=[r],
                          size_bytes=0) for r in refs]

    async def exec_url(self, container_id: str, cmd: list[str], req: StreamRequest) -> str:
        """A command run beside the container's process, with its environment and
        working directory (no namespaces to enter: it is a local process too), served by
        this runtime's own streaming server (execserver.py)."""
        with self._lock:
            c = self._containers.get(container_id)
            if c is None:
                raise NotFound(f"process exec: container {container_id} not found")
            self._refresh(c)
            if c.state != ContainerState.RUNNING.value:
                raise ContainerRuntimeError(f"process exec: container {c.name} is {c.state}, "
                                            "not running")
            env = dict((k, v) for k, v in c.env)
            cwd = c.working_dir or str(self.state_dir / "pods" / c.sandbox_id)
        if not cmd:
            raise ContainerRuntimeError("process exec: no command")
        if self._streaming is None:
            self._streaming = StreamingServer()
        return await self._streaming.url(ExecSpec(
            argv=list(cmd), env=env, cwd=cwd, stdin=req.stdin, stdout=req.stdout,
            stderr=req.stderr, tty=req.tty))

    async def exec_sync(self, container_id: str, cmd: list[str],
                        timeout: float) -> ExecResult:
        """The command run beside the container's process with its environment and
        working directory, to completion (exec probes and hooks); killed at `timeout`."""
        with self._lock:
            c = self._containers.get(container_id)
            if c is None:
                raise NotFound(f"process exec_sync: container {container_id} not found")
            self._refresh(c)
            if c.state != ContainerState.RUNNING.value:
                raise ContainerRuntimeError(f"process exec_sync: container {c.name} is "
                                            f"{c.state}, not running")
            env = dict((k, v) for k, v in c.env)
            cwd = c.working_dir or str(self.state_dir / "pods" / c.sandbox_id)
        if not cmd:
            raise ContainerRuntimeError("process exec_sync: no command")
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:  # no such program: what a shell says, exit 127 or 126
            return ExecResult(127 if isinstance(e, FileNotFoundError) else 126,
                              stderr=f"{cmd[0]}: {e.strerror}\n".encode())
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout or None)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise RuntimeTimeout(f'command "{" ".join(cmd)}" timed out') from None
        return ExecResult(proc.returncode or 0, out, err)

    async def container_stats(self) -> list[ContainerStats]:
        """Each running container's processes (its wrapper's process group) and the
        memory they hold resident (RSS): a process has no cgroup of its own here, so
        its working set is its resident set. One pass over /proc for all of them."""
        return await self._call(self._stats)

    def _stats(self) -> list[ContainerStats]:
        with self._lock:
            running = {c.pid: c.id for c in self._containers.values()
                       if c.state == ContainerState.RUNNING.value and c.pid is not None}
        groups: dict[int, list[int]] = {}  # process group -> its processes
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                st = _proc_stat(int(entry.name))
                if st is not None and st[1] in running:
                    groups.setdefault(st[1], []).append(int(entry.name))
        page = os.sysconf("SC_PAGE_SIZE")
        now = self.clock.now()
        out = []
        for pgid, cid in running.items():
            pids = groups.get(pgid, [])
            rss = 0
            for pid in pids:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
            out.append(ContainerStats(container_id=cid, timestamp=now,
                                      memory_working_set_bytes=rss, memory_rss_bytes=rss,
                                      processes=len(pids)))
        return out

    async def rotate_container_log(self, container_id: str, path: str, rotated: str) -> None:
        """Copy, then truncate: the process keeps its file open in append mode, so its
        next write lands at the start of the emptied file. What it writes between the
        copy and the truncate is lost (a few bytes at most, at each rotation)."""
        def rotate() -> None:
            with self._lock:
                c = self._containers.get(container_id)
                if c is None:
                    raise NotFound(f"process rotate_container_log: container {container_id} "
                                   "not found")
            shutil.copyfile(path, rotated)
            os.truncate(path, 0)
        await self._call(rotate)

    async def wait_container(self, container_id: str, timeout: float) -> bool:
        """Wait up to `timeout` s for a running container to exit; True once it has.
        For tests and tools; the agent learns of exits from the relist."""
        def current() -> _ContainerRec:
            with self._lock:
                c = self._containers.get(container_id)
                if c is None:
                    raise NotFound(f"process wait_container: container {container_id} "
                                   "not found")
                self._refresh(c)
                return c
        c = await self._call(current)
        if c.state == ContainerState.RUNNING.value:
            await self._await_exit(c, timeout)
            await self._call(self._settle, c)
        return c.state == ContainerState.EXITED.value

    async def close(self) -> None:
        """Release the state dir lock; processes keep running (a new runtime on the
        same dir adopts them)."""
        if self._streaming is not None:
            await self._streaming.close()
        with self._lock:
            self._unwatch_all()
        self._pool.shutdown(wait=False)
        with self._lock:
            if self._lockfile is not None:
                self._lockfile.close()
                self._lockfile = None
