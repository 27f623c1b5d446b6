"""A pod's volumes: made real on the host before its containers are created, turned
into the containers' mounts, and removed with the pod.

Each volume lives where the kubelet keeps it, `<root>/pods/<uid>/volumes/<plugin>/<name>`
(hostPath volumes are the host's own path). Every sync of a pod sets its volumes up
again, which costs nothing when nothing changed: configMap, secret, downwardAPI and
projected volumes are written by nodeagent.pods.volumes.atomic, which compares content
hashes and swaps `..data` only on a real change. A ConfigMap or Secret change reaches
running containers that way (nodeagent.pods.objects makes the pods sync), and so does a
label or annotation change for downwardAPI files (the pod update makes it sync).
Service account tokens are refreshed at 80 % of their life: `PodVolumes.refresh_in`
tells the syncer when to sync again.

What is supported: emptyDir (disk, and `medium: Memory` as a tmpfs of sizeLimit, or of
the pod's memory limit, or of the node's allocatable memory), configMap, secret,
downwardAPI, projected (configMap, secret, downwardAPI, serviceAccountToken), hostPath
(with its type checks), subPath and subPathExpr, readOnly, mountPropagation, and the
pod's fsGroup on every volume but hostPath. Any other volume type, projected source or
volume field makes `check` refuse the pod, naming it (VolumeRefused); a volume that
cannot be set up now (a missing ConfigMap, a hostPath of the wrong type) is a
MountFailed, tried again on the next sync.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import logging
import os
import shutil
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.api.client import ApiError, brief
from nodeagent.api.clock import Clock
from nodeagent.api.kube import CONFIG_MAPS, SECRETS
from nodeagent.api.quantity import parse_quantity
from nodeagent.pods.env import (
    EnvError,
    expand,
    field_value,
    find_container,
    object_data,
    resource_value,
)
from nodeagent.pods.objects import ObjectCache, ObjectUnavailable, Ref, ref_text
from nodeagent.pods.volumes import atomic
from nodeagent.pods.volumes.atomic import File
from nodeagent.pods.volumes.mount import Mounter
from nodeagent.pods.volumes.tokens import TokenManager
from nodeagent.runtime.base import Mount

log = logging.getLogger(__name__)

Pod = Mapping[str, Any]

# volume type -> the folder the kubelet keeps it in (hostPath has none)
PLUGINS = {"emptyDir": "kubernetes.io~empty-dir", "configMap": "kubernetes.io~configmap",
           "secret": "kubernetes.io~secret", "downwardAPI": "kubernetes.io~downward-api",
           "projected": "kubernetes.io~projected", "hostPath": ""}
# volumes whose content the API decides: always mounted read-only, as the kubelet does
API_DATA = {"configMap", "secret", "downwardAPI", "projected"}
PROJECTED_SOURCES = {"configMap", "secret", "downwardAPI", "serviceAccountToken"}
HOST_PATH_TYPES = {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket",
                   "CharDevice", "BlockDevice"}
PROPAGATION = {None: "None", "None": "None", "HostToContainer": "HostToContainer",
               "Bidirectional": "Bidirectional"}
DEFAULT_MODE = 0o644


class VolumeRefused(ValueError):
    """The pod asks for a volume (or a volume field) this agent does not implement, or
    a mount it cannot make; the message names the field. The pod cannot run."""


class MountFailed(Exception):
    """Volumes could not be set up now: (volume name, the kubelet's message) each."""

    def __init__(self, failures: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"volume {v!r}: {m}" for v, m in failures))
        self.failures = failures


@dataclass(frozen=True)
class VolumeDir:
    kind: str
    path: Path
    read_only: bool  # API data volumes: always


@dataclass
class PodVolumes:
    dirs: dict[str, VolumeDir] = field(default_factory=dict)
    refresh_in: float | None = None  # seconds until a token must be refreshed


def volume_kind(vol: Mapping[str, Any]) -> str:
    kinds = [k for k in vol if k != "name"]
    return kinds[0] if len(kinds) == 1 else ",".join(sorted(kinds)) or "none"


def _fs_group(pod: Pod) -> int | None:
    g = ((pod.get("spec") or {}).get("securityContext") or {}).get("fsGroup")
    return None if g is None else int(g)


def _fs_user(pod: Pod) -> int | None:
    """The user every container runs as, when they all run as one (a token file is
    then that user's, mode 0600)."""
    spec = pod.get("spec") or {}
    pod_user = (spec.get("securityContext") or {}).get("runAsUser")
    users = {(c.get("securityContext") or {}).get("runAsUser", pod_user)
             for g in ("initContainers", "containers") for c in spec.get(g) or []}
    if len(users) != 1:
        return None
    (user,) = users
    return None if user is None else int(user)


def _mode(value: Any, default: int) -> int:
    return default if value is None else int(value)


def _memory_limit(pod: Pod) -> int | None:
    """The pod's memory limit: the sum of its containers' (the largest init container's
    if more), None when one container has none."""
    spec = pod.get("spec") or {}

    def limit(c: Mapping[str, Any]) -> int | None:
        raw = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        return None if raw is None else int(parse_quantity(raw, "memory limit"))
    main = [limit(c) for c in spec.get("containers") or []]
    if not main or any(x is None for x in main):
        return None
    total = sum(x for x in main if x is not None)
    for c in spec.get("initContainers") or []:
        x = limit(c)
        if x is None:
            return None
        total = max(total, x)
    return total


# runs a blocking call and returns its result: the agent hands in threads of its own
BlockingCall = Callable[..., Awaitable[Any]]


async def on_the_loop(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class VolumeManager:
    """`blocking` runs what touches the files (making, writing, removing volumes): on
    the agent's threads, so a slow disk slows the pod it serves and not the event loop
    (the Lease renewals); by default on the loop (tests, virtual nodes)."""

    def __init__(self, root_dir: str | os.PathLike[str], clock: Clock, *,
                 objects: ObjectCache | None = None, tokens: TokenManager | None = None,
                 mounter: Mounter | None = None,
                 allocatable: Callable[[str], Mapping[str, Any] | None] | None = None,
                 blocking: BlockingCall = on_the_loop) -> None:
        self.pods_dir = Path(root_dir) / "pods"
        self.clock = clock
        self.blocking = blocking
        self.objects = objects
        self.tokens = tokens
        self.mounter = mounter
        self.allocatable = allocatable  # node name -> its status.allocatable
        self.writes = 0  # atomic payloads written (not counting unchanged ones)

    # -- what the syncer asks --------------------------------------------------------

    def refs(self, pod: Pod) -> set[Ref]:
        """The ConfigMaps and Secrets the pod's volumes read."""
        ns = str((pod.get("metadata") or {}).get("namespace") or "default")
        out: set[Ref] = set()
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            sources = [vol] + list((vol.get("projected") or {}).get("sources") or [])
            for s in sources:
                if (s.get("configMap") or {}).get("name"):
                    out.add((CONFIG_MAPS, ns, str(s["configMap"]["name"])))
                secret = s.get("secret") or {}
                name = secret.get("secretName") or secret.get("name")
                if name:
                    out.add((SECRETS, ns, str(name)))
        return out

    def check(self, pod: Pod) -> None:
        """VolumeRefused naming the first volume, source or field not implemented."""
        spec = pod.get("spec") or {}
        names = set()
        for i, vol in enumerate(spec.get("volumes") or []):
            name = str(vol.get("name") or "")
            names.add(name)
            where = f"spec.volumes[{i}] ({name!r})"
            kind = volume_kind(vol)
            if kind not in PLUGINS:
                raise VolumeRefused(f"{where}: {kind} volumes are not supported by this agent")
            body = vol.get(kind) or {}
            if kind == "emptyDir":
                medium = str(body.get("medium") or "")
                if medium not in ("", "Memory"):
                    raise VolumeRefused(f"{where}: emptyDir.medium {medium!r} is not "
                                        "supported by this agent (only disk and Memory)")
                if medium == "" and body.get("sizeLimit") is not None:
                    raise VolumeRefused(f"{where}: emptyDir.sizeLimit on disk is not "
                                        "enforced by this agent (it evicts nothing for "
                                        "local storage); use medium: Memory or no limit")
            elif kind == "hostPath":
                t = str(body.get("type") or "")
                if t not in HOST_PATH_TYPES:
                    raise VolumeRefused(f"{where}: hostPath.type {t!r} is an invalid volume "
                                        "type")
            elif kind == "projected":
                for j, source in enumerate(body.get("sources") or []):
                    skind = volume_kind(source)
                    if skind not in PROJECTED_SOURCES:
                        raise VolumeRefused(f"{where}: projected.sources[{j}].{skind} is not "
                                            "supported by this agent")
        for group in ("initContainers", "containers"):
            for c in spec.get(group) or []:
                cwhere = f"spec.{group}[{c.get('name')}]"
                if c.get("volumeDevices"):
                    raise VolumeRefused(f"{cwhere}.volumeDevices: raw block volumes are not "
                                        "supported by this agent")
                for m in c.get("volumeMounts") or []:
                    if m.get("name") not in names:
                        raise VolumeRefused(f"{cwhere}.volumeMounts: no volume named "
                                            f"{m.get('name')!r}")
                    if m.get("mountPropagation") not in PROPAGATION:
                        raise VolumeRefused(f"{cwhere}.volumeMounts[{m.get('name')}]."
                                            f"mountPropagation {m['mountPropagation']!r} is "
                                            "not supported")
                    if m.get("recursiveReadOnly") == "Enabled":
                        raise VolumeRefused(f"{cwhere}.volumeMounts[{m.get('name')}]."
                                            "recursiveReadOnly: Enabled is not supported by "
                                            "this agent's container runtime interface")

    async def setup(self, pod: Pod) -> PodVolumes:
        """Every volume of the pod, ready to mount. VolumeRefused (see check) or
        MountFailed (each volume that could not be set up, with the reason)."""
        self.check(pod)
        meta = pod.get("metadata") or {}
        uid = str(meta["uid"])
        out = PodVolumes()
        failures: list[tuple[str, str]] = []
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            name = str(vol["name"])
            kind = volume_kind(vol)
            try:
                out.dirs[name], refresh = await self._setup_one(pod, uid, name, kind,
                                                                vol[kind] or {})
            except (_Failed, EnvError, ObjectUnavailable, atomic.PayloadError) as e:
                failures.append((name, str(e)))
                continue
            except OSError as e:
                failures.append((name, f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")))
                continue
            if refresh is not None:
                out.refresh_in = refresh if out.refresh_in is None else min(out.refresh_in,
                                                                            refresh)
        if failures:
            raise MountFailed(failures)
        return out

    def plan(self, pod: Pod) -> PodVolumes:
        """Where each volume of the pod would be, without making it: for nodes whose
        containers run nothing that could read it (virtual nodes), so their pods need
        no ConfigMap, Secret or token read. What is not supported is still refused."""
        self.check(pod)
        uid = str((pod.get("metadata") or {})["uid"])
        out = PodVolumes()
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            name, kind = str(vol["name"]), volume_kind(vol)
            path = (Path(str((vol[kind] or {}).get("path") or "/")) if kind == "hostPath"
                    else self.pod_dir(uid) / "volumes" / PLUGINS[kind] / name)
            out.dirs[name] = VolumeDir(kind, path, read_only=kind in API_DATA)
        return out

    def mounts(self, pod: Pod, container: Mapping[str, Any], volumes: PodVolumes,
               env: Iterable[tuple[str, str]]) -> list[Mount]:
        """The container's volumeMounts as host paths. VolumeRefused for a subPath that
        cannot be used (it leaves the volume, or subPathExpr names an unset variable)."""
        values = dict(env)
        out: list[Mount] = []
        for m in container.get("volumeMounts") or []:
            vname = str(m.get("name"))
            where = f"volumeMount {vname!r} at {m.get('mountPath')}"
            vol = volumes.dirs.get(vname)
            if vol is None:
                raise VolumeRefused(f"{where}: volume {vname!r} is not set up")
            sub = str(m.get("subPath") or "")
            if m.get("subPathExpr"):
                sub, missing = _expand_sub_path(str(m["subPathExpr"]), values)
                if missing:
                    raise VolumeRefused(f"{where}: subPathExpr: missing value for "
                                        f"{', '.join(sorted(set(missing)))}")
            host = vol.path
            if sub:
                host = self._sub_path(vol, sub, where)
            out.append(Mount(container_path=str(m.get("mountPath")), host_path=str(host),
                             read_only=bool(m.get("readOnly")) or vol.read_only,
                             propagation=PROPAGATION[m.get("mountPropagation")]))
        return out

    def pod_dir(self, uid: str) -> Path:
        return self.pods_dir / uid

    async def teardown(self, uid: str) -> None:
        """The pod is gone: unmount what the agent mounted for it, remove its folder."""
        if self.tokens is not None:
            self.tokens.forget(uid)
        await self.blocking(self._remove, self.pod_dir(uid))

    def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """Remove the folders of pods that are neither known nor in the runtime."""
        try:
            found = [e.name for e in os.scandir(self.pods_dir) if e.is_dir()]
        except FileNotFoundError:
            return []
        gone = sorted(set(found) - keep)
        for uid in gone:
            log.info("housekeeping: removing the volumes of pod %s, which no source has", uid)
            self._remove(self.pod_dir(uid))
        return gone

    # -- inside ----------------------------------------------------------------------

    def _remove(self, path: Path) -> None:
        if not path.exists():
            return
        if self.mounter is not None:
            for point in self.mounter.mounts_under(str(path)):
                try:
                    self.mounter.unmount(point)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # EINVAL: not mounted any more
                        log.warning("cannot remove %s: %s; kept", path, e)
                        return
        shutil.rmtree(path, ignore_errors=True)

    def _sub_path(self, vol: VolumeDir, sub: str, where: str) -> Path:
        if sub.startswith("/") or ".." in sub.split("/"):
            raise VolumeRefused(f"{where}: subPath {sub!r} must be a relative path that "
                                "does not contain '..'")
        host = vol.path / sub
        if not os.path.lexists(host):
            if vol.kind in ("emptyDir", "hostPath"):
                host.mkdir(parents=True, exist_ok=True, mode=0o755)
                with contextlib.suppress(OSError):
                    os.chmod(host, 0o777 if vol.kind == "emptyDir" else 0o755)
            else:
                raise VolumeRefused(f"{where}: subPath {sub!r} does not exist in the volume")
        real, base = os.path.realpath(host), os.path.realpath(vol.path)
        if real != base and not real.startswith(base.rstrip("/") + "/"):
            raise VolumeRefused(f"{where}: subPath {sub!r} leads out of the volume "
                                f"(to {real})")
        return Path(real)

    async def _setup_one(self, pod: Pod, uid: str, name: str, kind: str,
                         body: Mapping[str, Any]) -> tuple[VolumeDir, float | None]:
        if kind == "hostPath":
            return VolumeDir(kind, await self.blocking(self._host_path, body),
                             read_only=False), None
        path = self.pod_dir(uid) / "volumes" / PLUGINS[kind] / name
        gid = _fs_group(pod)
        if kind == "emptyDir":
            await self.blocking(self._empty_dir, pod, path, body, gid)
            return VolumeDir(kind, path, read_only=False), None
        payload, refresh = await self._payload(pod, kind, body)
        if await self.blocking(_write, path, payload, self.clock.now(), gid):
            self.writes += 1
        return VolumeDir(kind, path, read_only=True), refresh

    def _empty_dir(self, pod: Pod, path: Path, body: Mapping[str, Any],
                   gid: int | None) -> None:
        memory = body.get("medium") == "Memory"
        if path.exists() and (not memory or self._mounted(path)):
            return  # set up by an earlier sync: its content is the containers'
        path.mkdir(parents=True, exist_ok=True)
        if memory:
            if self.mounter is None:
                raise _Failed("emptyDir medium Memory: this agent cannot mount a tmpfs")
            size = self._tmpfs_size(pod, body)
            try:
                self.mounter.mount_tmpfs(str(path), size)
            except OSError as e:
                raise _Failed(f"emptyDir medium Memory: cannot mount a tmpfs: {e}") from e
        os.chmod(path, 0o777)
        if gid is not None:
            atomic.set_group(path, gid, read_only=False)

    def _mounted(self, path: Path) -> bool:
        return self.mounter is not None and str(os.path.realpath(path)) in \
            self.mounter.mounts_under(str(path))

    def _tmpfs_size(self, pod: Pod, body: Mapping[str, Any]) -> int | None:
        """The smallest of sizeLimit, the pod's memory limit and the node's allocatable
        memory (None: the kernel's default, half the memory)."""
        sizes = []
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        alloc = self.allocatable(node) if self.allocatable else None
        if alloc and alloc.get("memory") is not None:
            sizes.append(int(parse_quantity(alloc["memory"], "allocatable memory")))
        limit = _memory_limit(pod)
        if limit:
            sizes.append(limit)
        if body.get("sizeLimit") is not None:
            size = int(parse_quantity(body["sizeLimit"], "emptyDir.sizeLimit"))
            if size > 0:
                sizes.append(size)
        return min(sizes) if sizes else None

    def _host_path(self, body: Mapping[str, Any]) -> Path:
        path = Path(str(body.get("path") or ""))
        t = str(body.get("type") or "")
        if not path.is_absolute():
            raise _Failed(f"invalid HostPath `{path}`: must be an absolute path")
        exists = os.path.lexists(path)
        if t == "DirectoryOrCreate" and not exists:
            path.mkdir(parents=True, mode=0o755)
        elif t == "FileOrCreate" and not exists:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
            os.close(fd)
        checks: dict[str, tuple[Callable[[Path], bool], str]] = {
            "Directory": (Path.is_dir, "a directory"),
            "DirectoryOrCreate": (Path.is_dir, "a directory"),
            "File": (Path.is_file, "a file"), "FileOrCreate": (Path.is_file, "a file"),
            "Socket": (Path.is_socket, "a socket file"),
            "CharDevice": (Path.is_char_device, "a character device"),
            "BlockDevice": (Path.is_block_device, "a block device")}
        if t in checks:
            test, what = checks[t]
            if not test(path):
                raise _Failed(f"hostPath type check failed: {path} is not {what}")
        return path

    # -- the content of API data volumes ---------------------------------------------

    async def _object(self, pod: Pod, res: Any, name: str) -> dict[str, bytes] | None:
        ns = str((pod.get("metadata") or {}).get("namespace") or "default")
        ref: Ref = (res, ns, name)
        if self.objects is None:
            raise _Failed(f"cannot read {ref_text(ref)}: this agent has no API access")
        obj = await self.objects.get(ref)
        return None if obj is None else object_data(ref, obj)

    async def _keys(self, pod: Pod, res: Any, body: Mapping[str, Any], name: str,
                    default_mode: int) -> dict[str, File]:
        """A configMap or secret volume (or projected source) as files."""
        label = "configmap" if res is CONFIG_MAPS else "secret"
        optional = bool(body.get("optional"))
        data = await self._object(pod, res, name)
        if data is None:
            if optional:
                return {}
            raise _Failed(f'{label} "{name}" not found')
        items = body.get("items") or []
        if not items:
            return {k: File(v, default_mode) for k, v in data.items()}
        out: dict[str, File] = {}
        for item in items:
            key = str(item.get("key") or "")
            if key not in data:
                if optional:
                    continue
                what = "config" if res is CONFIG_MAPS else "secret"
                raise _Failed(f"{label} references non-existent {what} key: {key}")
            out[str(item["path"])] = File(data[key], _mode(item.get("mode"), default_mode))
        return out

    def _downward(self, pod: Pod, items: Iterable[Mapping[str, Any]],
                  default_mode: int) -> dict[str, File]:
        out: dict[str, File] = {}
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        for item in items:
            mode = _mode(item.get("mode"), default_mode)
            if item.get("fieldRef"):
                text = field_value(pod, str(item["fieldRef"].get("fieldPath") or ""), {})
            elif item.get("resourceFieldRef"):
                ref = item["resourceFieldRef"]
                container = find_container(pod, str(ref.get("containerName") or ""))
                if container is None:
                    raise _Failed(f"resourceFieldRef: container "
                                  f"{ref.get('containerName')!r} not found")
                alloc = self.allocatable(node) if self.allocatable else None
                text = resource_value(pod, container, ref, alloc)
            else:
                raise _Failed(f"downwardAPI item {item.get('path')!r}: neither fieldRef "
                              "nor resourceFieldRef")
            out[str(item["path"])] = File(text.encode(), mode)
        return out

    async def _payload(self, pod: Pod, kind: str,
                       body: Mapping[str, Any]) -> tuple[dict[str, File], float | None]:
        default_mode = _mode(body.get("defaultMode"), DEFAULT_MODE)
        if kind == "configMap":
            return await self._keys(pod, CONFIG_MAPS, body, str(body.get("name") or ""),
                                    default_mode), None
        if kind == "secret":
            return await self._keys(pod, SECRETS, body, str(body.get("secretName") or ""),
                                    default_mode), None
        if kind == "downwardAPI":
            return self._downward(pod, body.get("items") or [], default_mode), None
        payload: dict[str, File] = {}
        refresh: float | None = None
        errors: list[str] = []
        for source in body.get("sources") or []:
            try:
                if "configMap" in source:
                    s = source["configMap"]
                    payload.update(await self._keys(pod, CONFIG_MAPS, s,
                                                    str(s.get("name") or ""), default_mode))
                elif "secret" in source:
                    s = source["secret"]
                    payload.update(await self._keys(pod, SECRETS, s, str(s.get("name") or ""),
                                                    default_mode))
                elif "downwardAPI" in source:
                    payload.update(self._downward(pod, source["downwardAPI"].get("items") or [],
                                                  default_mode))
                elif "serviceAccountToken" in source:
                    file, due = await self._token(pod, source["serviceAccountToken"],
                                                  default_mode)
                    payload[str(source["serviceAccountToken"].get("path"))] = file
                    refresh = due if refresh is None else min(refresh, due)
            except _Failed as e:
                errors.append(str(e))
        if errors:
            raise _Failed(", ".join(errors))
        return payload, refresh

    async def _token(self, pod: Pod, source: Mapping[str, Any],
                     default_mode: int) -> tuple[File, float]:
        if self.tokens is None:
            raise _Failed("serviceAccountToken: this agent has no API access")
        user, gid = _fs_user(pod), _fs_group(pod)
        mode = 0o600 if user is not None or gid is not None else default_mode
        try:
            token, due = await self.tokens.token(pod, str(source.get("audience") or ""),
                                                 source.get("expirationSeconds"))
        except ApiError as e:
            raise _Failed(f"failed to fetch token: {brief(e)}") from e
        except (OSError, TimeoutError) as e:
            raise _Failed(f"failed to fetch token: {e}") from e
        return File(token.encode(), mode, uid=user), due


def _write(path: Path, payload: Mapping[str, File], now: dt.datetime,
           gid: int | None) -> bool:
    """The payload into the volume's folder (made if missing); True if it changed."""
    if not path.exists():
        path.mkdir(parents=True, mode=0o755)
        os.chmod(path, 0o777 if gid is None else 0o755)
    return atomic.write(path, payload, now=now, gid=gid)


def _expand_sub_path(expr: str, values: Mapping[str, str]) -> tuple[str, list[str]]:
    """subPathExpr expanded from the container's environment, and the variables it
    names that are unset or empty (the kubelet refuses those)."""
    missing: list[str] = []

    def lookup(key: str) -> str:
        v = values.get(key, "")
        if not v:
            missing.append(key)
        return v
    return expand(expr, lookup), missing


class _Failed(Exception):
    """One volume cannot be set up now (the kubelet's words)."""
