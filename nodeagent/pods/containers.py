"""One container started and stopped as the kubelet does it.

Start: the image (images.py, a pull may still be under way), the container's config
(environment, volume mounts, the managed /etc/hosts, its termination-message file,
runAsNonRoot against the image's user, the OOM score adjustment of its QoS class),
create, start, the postStart hook; a failure counts for the crash back-off. Stop: a
`Killing` Event, the preStop hook within the grace period, then SIGTERM and SIGKILL
after what is left. Resize: a running container's CPU or memory changed in place, and
what each such update gave it remembered (resize.py). Also what an exited container
leaves behind: its termination message, read once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.events import NORMAL, WARNING, Events
from nodeagent.pods import resize as rz
from nodeagent.pods.backoff import CrashBackoff, crash_key
from nodeagent.pods.decide import (
    RETRY,
    ResizeContainer,
    StartContainer,
    all_containers,
    grace_of,
)
from nodeagent.pods.dns import hostname_and_domain, hosts_file
from nodeagent.pods.env import EnvResolver, expand_command
from nodeagent.pods.handlers import Target
from nodeagent.pods.hooks import Hooks, cap_messages, termination_message, termination_mount
from nodeagent.pods.images import ImageManager
from nodeagent.pods.podstatus import Waiting
from nodeagent.pods.podupdate import Pod
from nodeagent.pods.qos import oom_score_adj
from nodeagent.pods.runtimecalls import RuntimeCalls
from nodeagent.pods.settings import NodePodSettings
from nodeagent.pods.volumes import PodVolumes, VolumeManager, on_the_loop
from nodeagent.runtime.base import (
    Container,
    ContainerConfig,
    ContainerRuntimeError,
    ContainerState,
    ImageNotPresent,
    Mount,
    PodRuntimeStatus,
    Resources,
    Sandbox,
    SandboxConfig,
)

log = logging.getLogger(__name__)

DEFAULT_MESSAGE_PATH = "/dev/termination-log"
ETC_HOSTS = "/etc/hosts"


@dataclass
class Progress:
    """What carrying out a sync's actions found: why containers wait, when to sync
    again, the image pulls to wake up for, whether anything was started."""
    waiting: dict[str, Waiting] = field(default_factory=dict)
    requeue: float = math.inf
    wake: list[asyncio.Future[None]] = field(default_factory=list)
    started: bool = False

    def again(self, seconds: float) -> None:
        self.requeue = min(self.requeue, seconds)


@dataclass(frozen=True)
class Place:
    """Where a pod's containers go: its sandbox, the sandbox's config, its volumes and
    the pod fields its containers' environment may name."""
    sandbox: Sandbox
    config: SandboxConfig
    volumes: PodVolumes
    fields: Mapping[str, str]

    @property
    def pod_ip(self) -> str:
        return self.fields.get("status.podIP", "")


def remove_pod_files(pods_dir: str, uid: str) -> None:
    """What the agent wrote for a pod (termination-message files, its /etc/hosts)."""
    shutil.rmtree(os.path.join(pods_dir, uid, "containers"), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(pods_dir, uid, "etc-hosts"))
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(pods_dir, uid))  # only when nothing else is left in it


class Containers:
    def __init__(self, calls: RuntimeCalls, images: ImageManager, env: EnvResolver,
                 volumes: VolumeManager | None, hooks: Hooks, backoff: CrashBackoff,
                 events: Events | None, settings: NodePodSettings) -> None:
        """`volumes`: the mounts of the pods' volumes (None: no volume support)."""
        self.calls = calls
        self.runtime = calls.runtime
        self.images = images
        self.env = env
        self.volumes = volumes
        self.hooks = hooks
        self.backoff = backoff
        self.events = events
        self.settings = settings
        # termination messages read, per pod uid and container id (read once: the file
        # of an exited container no longer changes)
        self._messages: dict[str, dict[str, str]] = {}
        # what in-place resizes gave running containers: pod uid -> container id -> it
        self._resized: dict[str, dict[str, Resources]] = {}

    # --- starting -------------------------------------------------------------------

    async def start(self, pod: Pod, s: StartContainer, place: Place,
                    progress: Progress) -> None:
        """Create and start the container once its image is there (first removing the
        one it replaces)."""
        spec, name, sc = s.spec, str(s.spec["name"]), place.config
        if s.replaces is not None:
            try:
                await self.calls(self.runtime.remove_container(s.replaces.id),
                                 "remove_container")
            except ContainerRuntimeError as e:
                # while it is there it might yet start: no second one beside it
                progress.waiting[name] = Waiting(
                    "CreateContainerError", f"container {s.replaces.id}, created and never "
                                            f"started, could not be removed: {e}")
                progress.again(RETRY)
                return
        image = await self.images.ensure(pod, spec)
        if not image.ready:
            if image.waiting is not None:
                progress.waiting[name] = image.waiting
            if image.failed and image.waiting is not None:
                self.warn(pod, name, f"Error: {image.waiting.reason}")
            if image.retry_after is not None:
                progress.again(image.retry_after)
            if image.pulling is not None:
                progress.wake.append(image.pulling)
            return
        if s.backoff_key is not None:
            self.backoff.restarted(s.backoff_key)
        try:
            cfg = await self._config(pod, s, place)
        except (ValueError, OSError) as e:  # a spec we cannot run (bad quantity, ...)
            progress.waiting[name] = Waiting("CreateContainerConfigError", str(e))
            self.warn(pod, name, f"Error: {e}")
            progress.again(RETRY)
            return
        try:
            cid = await self.calls(self.runtime.create_container(place.sandbox.id, cfg, sc),
                                   "create_container")
        except ImageNotPresent as e:  # removed since the image manager saw it
            progress.waiting[name] = Waiting("ErrImagePull", str(e))
            self.warn(pod, name, "Error: ErrImagePull")
            progress.again(RETRY)
            return
        except ContainerRuntimeError as e:
            progress.waiting[name] = Waiting("CreateContainerError", str(e))
            self.warn(pod, name, f"Error: {e}")
            progress.again(RETRY)
            return
        self._note(pod, name, "Created", "Container created")
        try:
            await self.calls(self.runtime.start_container(cid), "start_container")
            progress.started = True
        except ContainerRuntimeError as e:
            # counts as a crash: the next attempt waits for the back-off
            progress.waiting[name] = Waiting("RunContainerError", str(e))
            self.warn(pod, name, f"Error: {e}")
            self._crashed(crash_key(sc.uid, spec), progress)
            return
        self._note(pod, name, "Started", "Container started")
        failed = await self.hooks.post_start(pod, spec, Target(spec, cid, place.pod_ip))
        if failed is not None:
            # the kubelet's reason for a container whose postStart hook failed
            started = Container(id=cid, sandbox_id=place.sandbox.id, pod_uid=sc.uid,
                                name=name, image=str(spec.get("image", "")),
                                state=ContainerState.RUNNING, attempt=s.attempt)
            await self.kill(pod, spec, started, "FailedPostStartHook", place.pod_ip)
            progress.waiting[name] = Waiting("PostStartHookError", failed)
            self._crashed(crash_key(sc.uid, spec), progress)

    def _crashed(self, key: tuple[str, str, str], progress: Progress) -> None:
        self.backoff.restarted(key)
        progress.again(max(1.0, self.backoff.remaining(key)))

    async def _config(self, pod: Pod, s: StartContainer, place: Place) -> ContainerConfig:
        """The container's config: environment, mounts, command. Raises ValueError or
        OSError naming what cannot be honoured."""
        spec = s.spec
        env = await self.env.resolve(pod, spec, place.fields)
        mounts = self.volumes.mounts(pod, spec, place.volumes, env) if self.volumes else []
        cfg = ContainerConfig.from_pod(pod, spec, attempt=s.attempt,
                                       restart_count=s.restarts, init=s.init, env=env,
                                       mounts=mounts, seccomp_root=self.settings.seccomp_root)
        cfg.target_id = s.target_id
        if self.settings.memory_capacity:
            cfg.oom_score_adj = oom_score_adj(pod, spec, self.settings.memory_capacity)
        cfg.command, cfg.args = expand_command(spec, env)
        await self._check_non_root(pod, cfg)
        # the files under the pod's folder, written where the volumes' are (a slow disk
        # must not hold the event loop)
        files = self.volumes.blocking if self.volumes is not None else on_the_loop
        hosts = await files(self._etc_hosts, pod, spec, place)
        if hosts is not None:
            cfg.mounts.append(hosts)
        message = await files(self._message_mount, pod, spec, s.attempt)
        if message is not None:
            cfg.mounts.append(message)
        return cfg

    def _message_mount(self, pod: Pod, spec: Mapping[str, Any], attempt: int) -> Mount | None:
        """The termination-message file, where the runtime can mount it. A runtime that
        cannot (the process runtime) gets none for the API's default path, which every
        pod has, and refuses any other path."""
        path = spec.get("terminationMessagePath")
        if not path or not self.settings.pods_dir:
            return None
        if not self.runtime.can_mount:
            if path != DEFAULT_MESSAGE_PATH:
                raise ValueError(f"container {spec['name']}: terminationMessagePath "
                                 f"{path}: the {self.runtime.scheme} runtime cannot mount "
                                 "a file into a container")
            return None
        try:
            return termination_mount(self.settings.pods_dir, pod, spec, attempt)
        except OSError as e:
            raise ValueError(f"container {spec['name']}: terminationMessagePath: cannot "
                             f"create its file: {e}") from e

    async def _check_non_root(self, pod: Pod, cfg: ContainerConfig) -> None:
        """runAsNonRoot: refused when the container would run as root, or as a user
        name whose uid cannot be known (the kubelet's rule and wording)."""
        sec = cfg.security
        if not sec.run_as_non_root:
            return
        meta = pod["metadata"]
        who = f'(pod: "{meta["name"]}_{meta.get("namespace") or "default"}' \
              f'({meta["uid"]})", container: {cfg.name})'
        if sec.run_as_user is not None:
            if sec.run_as_user == 0:
                raise ValueError(f"container's runAsUser breaks non-root policy {who}")
            return
        uid, user = await self.calls(self.runtime.image_user(cfg.image), "image_user")
        if uid is None and user:
            raise ValueError(f"container has runAsNonRoot and image has non-numeric user "
                             f"({user}), cannot verify user is non-root {who}")
        if not uid:  # 0, or no user in the image at all: root
            raise ValueError(f"container has runAsNonRoot and image will run as root {who}")

    def _etc_hosts(self, pod: Pod, spec: Mapping[str, Any], place: Place) -> Mount | None:
        """The managed /etc/hosts (pod IP, hostname, FQDN, hostAliases; a host-network
        pod's is the node's own with the aliases), written under the pod's folder, unless
        the container mounts something at /etc/hosts itself."""
        if not self.settings.pods_dir or not self.runtime.can_mount:
            return None
        if any(m.get("mountPath") == ETC_HOSTS for m in spec.get("volumeMounts") or []):
            return None
        host_net = bool((pod.get("spec") or {}).get("hostNetwork"))
        ip = self.settings.pod_ip(host_net, place.sandbox.ip)
        if not ip and not host_net:
            return None  # no pod IP to name (the kubelet mounts none either)
        host, domain = hostname_and_domain(pod, self.settings.dns.cluster_domain)
        content = hosts_file(pod, [ip] if ip else [], host, domain,
                             self.settings.dns.node_hosts)
        path = os.path.join(self.settings.pods_dir, place.config.uid, "etc-hosts")
        try:
            with open(path) as f:
                same = f.read() == content
        except OSError:
            same = False
        if not same:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.write(content)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        return Mount(ETC_HOSTS, path)

    # --- stopping -------------------------------------------------------------------

    async def kill(self, pod: Pod, spec: Mapping[str, Any] | None, cur: Container,
                   message: str, pod_ip: str, *, grace: float | None = None) -> None:
        """Stop one container as the kubelet kills it: a `Killing` Event, its preStop
        hook within the grace period, then SIGTERM and SIGKILL after what is left. No
        `spec` (a container the spec no longer has): no Event, no hook."""
        grace = grace_of(pod) if grace is None else grace
        if spec is not None:
            self.hooks.killing(pod, cur.name, message)
            grace = await self.hooks.pre_stop(pod, spec, Target(spec, cur.id, pod_ip), grace)
        await self.calls(self.runtime.stop_container(cur.id, grace), "stop_container", grace)

    # --- resizing --------------------------------------------------------------------

    async def resize(self, pod: Pod, r: ResizeContainer, resource: str) -> None:
        """Change one resource ("memory" or "cpu") of the running container in place to
        what `r` wants, the other as last applied; remembered once the runtime took it.
        Raises ContainerRuntimeError."""
        uid = str(pod["metadata"]["uid"])
        have = self._resized.get(uid, {}).get(r.container.id, r.have)
        new = rz.with_resource(have, r.want, resource)
        adj = oom_score_adj(pod, r.spec, self.settings.memory_capacity) \
            if self.settings.memory_capacity else None
        await self.calls(self.runtime.update_container_resources(r.container.id, new, adj),
                         "update_container_resources")
        self._resized.setdefault(uid, {})[r.container.id] = new

    def resized(self, uid: str) -> dict[str, Resources]:
        """What in-place resizes gave the pod's containers, by container id."""
        return self._resized.get(uid, {})

    def prune_resized(self, uid: str, rs: PodRuntimeStatus) -> None:
        """Forget the resizes of containers that are no longer running."""
        held = self._resized.get(uid)
        if held:
            running = {c.id for c in rs.containers if c.state == ContainerState.RUNNING}
            for cid in held.keys() - running:
                del held[cid]

    # --- what exited containers leave ----------------------------------------------

    def messages(self, pod: Pod, rs: PodRuntimeStatus) -> dict[str, str]:
        """The termination messages of the pod's exited containers, by container id."""
        containers = all_containers(pod)
        by_name = {c.get("name"): c for c in containers}
        cache = self._messages.setdefault(str(pod["metadata"]["uid"]), {})
        for c in rs.containers:
            if c.state != ContainerState.EXITED or c.id in cache or c.name not in by_name:
                continue
            cache[c.id] = termination_message(self.settings.pods_dir, pod, by_name[c.name],
                                              c, self.runtime.log_format)
        for cid in cache.keys() - {c.id for c in rs.containers}:
            del cache[cid]  # pruned
        return cap_messages({k: v for k, v in cache.items() if v}, len(containers))

    def forget(self, uid: str) -> None:
        """The pod is gone: its back-offs, image pulls, messages and files."""
        self.backoff.forget(uid)
        self.images.forget(uid)
        self._messages.pop(uid, None)
        self._resized.pop(uid, None)
        if self.settings.pods_dir:  # the pod's files: termination messages, /etc/hosts
            remove_pod_files(self.settings.pods_dir, uid)

    # --- Events ---------------------------------------------------------------------

    def _note(self, pod: Pod, container: str, reason: str, message: str) -> None:
        """A Normal Event about a container's lifecycle, as the kubelet's."""
        if self.events is not None and self.settings.runs_workloads:
            self.events.pod(pod, NORMAL, reason, message, container=container)

    def warn(self, pod: Pod, container: str, message: str, reason: str = "Failed") -> None:
        """A Warning Event on the pod about one container, as the kubelet's."""
        if self.events is not None:
            self.events.pod(pod, WARNING, reason, message, container=container)
