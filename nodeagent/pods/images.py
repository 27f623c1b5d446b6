"""Image pulls, as the kubelet makes them: one `ImageManager` per runtime, asked by the
syncer before each container is created.

- `imagePullPolicy` (the API server's default where a pod has none: Always for a
  `:latest` or untagged image, else IfNotPresent): Always pulls at every container
  start, IfNotPresent only when the runtime lacks the image, Never never (the container
  waits with `ErrImageNeverPull`). A name that is no image reference: `InvalidImageName`.
- Credentials: the pod's `imagePullSecrets`, then those of its service account, read
  with a GET each when a pull starts (kubernetes.io/dockerconfigjson and
  kubernetes.io/dockercfg), matched to the image's registry as the kubelet's keyring
  does (`Keyring`): host globs part by part, the port exactly, the path as a prefix,
  the most specific entry first; each matching credential is tried in turn. A secret
  that cannot be read is named in a `FailedToRetrieveImagePullSecret` Warning and the
  pull goes on without it.
- A pull runs in a task of its own: the pod's sync does not wait for it (its container
  waits, ContainerCreating), and the pod is synced again when the pull ends (`pulling`
  is the future to wake it on). Pods that want the same image with the same credentials
  share one pull. `serialize` (the kubelet's --serialize-image-pulls, default on) lets
  one pull run at a time; otherwise up to `max_parallel` (0: no limit).
- A failed pull: the container waits with `ErrImagePull` (the runtime's error), then
  `ImagePullBackOff` until the back-off for that pod and image (10 s, doubling to
  5 min; forgotten after 10 min without a failure) lets the next pull start.
- Events on the pod, the kubelet's: Normal `Pulling`, `Pulled` (with the time and the
  size, or "already present on machine"), `BackOff`; Warning `Failed`,
  `ErrImageNeverPull`, `InspectFailed`, `FailedToRetrieveImagePullSecret`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import fnmatch
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from nodeagent.api.client import brief, status_of
from nodeagent.api.clock import Clock, clock_timeout
from nodeagent.api.kube import SECRETS, SERVICE_ACCOUNTS, Kube, describe
from nodeagent.events import NORMAL, WARNING, Events
from nodeagent.metrics import per_registry
from nodeagent.pods.podstatus import Waiting
from nodeagent.pods.podupdate import Pod
from nodeagent.runtime.base import (
    ContainerRuntimeError,
    ImageInfo,
    RegistryAuth,
    Runtime,
    start_call,
)

log = logging.getLogger(__name__)

# --- image references ------------------------------------------------------------------
# The grammar of distribution's reference package (what the kubelet parses names with).

_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = (rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
           r"(?::[0-9]+)?")
_REFERENCE = re.compile(
    rf"((?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    r"(?::([\w][\w.-]{0,127}))?"
    r"(?:@([A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?")
_DIGEST_HEX = {"sha256": 64, "sha384": 96, "sha512": 128}
MAX_NAME = 255
DEFAULT_DOMAIN = "docker.io"


@dataclass(frozen=True)
class ImageName:
    domain: str      # "docker.io" for familiar names such as "busybox"
    path: str        # "library/busybox"
    tag: str = ""
    digest: str = ""

    @property
    def repository(self) -> str:
        """What credentials are looked up by: domain/path."""
        return f"{self.domain}/{self.path}"


def parse_image(image: str) -> ImageName:
    """An image reference, normalized as the kubelet does ("busybox" is
    docker.io/library/busybox). ValueError says what is wrong with it."""
    if re.fullmatch(r"[a-f0-9]{64}", image):
        raise ValueError(f"invalid repository name ({image}), cannot specify 64-byte "
                         "hexadecimal strings")
    first, slash, rest = image.partition("/")
    if not slash:
        domain, remainder = DEFAULT_DOMAIN, image
    elif first == "localhost" or any(ch in first for ch in ".:") or first.lower() != first:
        domain, remainder = first, rest
    elif first == "index.docker.io":
        domain, remainder = DEFAULT_DOMAIN, rest
    else:
        domain, remainder = DEFAULT_DOMAIN, image
    if domain in ("index.docker.io", DEFAULT_DOMAIN):
        domain = DEFAULT_DOMAIN
        if "/" not in remainder:
            remainder = "library/" + remainder
    remote = remainder.split(":", 1)[0]
    if remote.lower() != remote:
        raise ValueError(f"invalid reference format: repository name ({remote}) must be "
                         "lowercase")
    full = f"{domain}/{remainder}"
    m = _REFERENCE.fullmatch(full)
    if m is None:
        if not image:
            raise ValueError("repository name must have at least one component")
        if _REFERENCE.fullmatch(full.lower()):
            raise ValueError("repository name must be lowercase")
        raise ValueError("invalid reference format")
    path = m.group(1)[len(domain) + 1:]
    if len(path) > MAX_NAME:
        raise ValueError(f"repository name must not be more than {MAX_NAME} characters")
    digest = m.group(3) or ""
    if digest:
        algorithm, _, hexpart = digest.partition(":")
        if algorithm not in _DIGEST_HEX:
            raise ValueError("unsupported digest algorithm")
        if len(hexpart) != _DIGEST_HEX[algorithm]:
            raise ValueError("invalid checksum digest length")
    return ImageName(domain, path, m.group(2) or "", digest)


def pull_ref(image: str, name: ImageName) -> str:
    """The image as the runtime is asked for it: with ":latest" when it names neither a
    tag nor a digest."""
    return image if name.tag or name.digest else image + ":latest"


def pull_policy(container: Mapping[str, Any]) -> str:
    """imagePullPolicy, with the API server's default where it is unset: Always when the
    tag is latest, or when there is neither tag nor digest; else IfNotPresent."""
    p = container.get("imagePullPolicy")
    if p:
        return str(p)
    try:
        name = parse_image(str(container.get("image") or ""))
    except ValueError:
        return "IfNotPresent"  # refused as InvalidImageName before any pull
    tag = name.tag or ("" if name.digest else "latest")
    return "Always" if tag == "latest" else "IfNotPresent"


# --- credentials -----------------------------------------------------------------------

DOCKER_CONFIG_JSON = ("kubernetes.io/dockerconfigjson", ".dockerconfigjson")
DOCKER_CFG = ("kubernetes.io/dockercfg", ".dockercfg")
DEFAULT_REGISTRY_KEY = "index.docker.io"


def _host_port(netloc: str) -> tuple[str, str]:
    """Go's net.SplitHostPort, falling back to (netloc, "") where it would fail."""
    if netloc.startswith("["):
        end = netloc.find("]")
        if end != -1 and netloc[end + 1:end + 2] == ":":
            return netloc[1:end], netloc[end + 2:]
        return netloc, ""
    if netloc.count(":") == 1:
        host, _, port = netloc.partition(":")
        return host, port
    return netloc, ""


def _split(url: str) -> tuple[str, str]:
    """(host[:port], path) of a registry location given without a scheme."""
    parts = urlsplit("https://" + url)
    return parts.netloc, parts.path


def registry_matches(pattern: str, repository: str) -> bool:
    """Whether a credential's location (a host that may hold globs, an optional port,
    an optional path) covers an image repository (host[:port]/path): the same number of
    host parts, each matching its glob, the same port, and the credential's path a
    prefix of the image's."""
    try:
        (glob_loc, glob_path), (loc, path) = _split(pattern), _split(repository)
    except ValueError:
        return False
    glob_host, glob_port = _host_port(glob_loc)
    host, port = _host_port(loc)
    glob_parts, parts = glob_host.split("."), host.split(".")
    if glob_port != port or len(glob_parts) != len(parts) or not path.startswith(glob_path):
        return False
    return all(fnmatch.fnmatchcase(p, g) for g, p in zip(glob_parts, parts, strict=True))


def _default_registry(repository: str) -> bool:
    first, slash, _ = repository.partition("/")
    if not first:
        return False
    return (not slash or first in ("docker.io", "index.docker.io")
            or not any(ch in first for ch in ".:"))


def _decode_auth(value: str) -> tuple[str, str]:
    """A docker config's "auth": base64 of "user:password", padded or not."""
    text = value.strip()
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError("auth is not base64") from None
    user, sep, password = raw.partition(":")
    if not sep:
        raise ValueError("auth must be base64 of username:password")
    return user, password


class Keyring:
    """Registry credentials by location, looked up by image repository."""

    def __init__(self) -> None:
        self._creds: dict[str, list[RegistryAuth]] = {}

    def add(self, config: Any, where: str) -> None:
        """The entries of a docker config ({location: {username, password, auth, ...}}).
        ValueError names the entry and field that is wrong; nothing is added then."""
        if not isinstance(config, Mapping):
            raise ValueError(f"{where}: expected an object of registry locations")
        found: list[tuple[str, RegistryAuth]] = []
        for loc, entry in config.items():
            if not isinstance(entry, Mapping):
                raise ValueError(f"{where}[{loc!r}]: expected an object")
            user, password = str(entry.get("username") or ""), str(entry.get("password") or "")
            if entry.get("auth"):
                try:
                    user, password = _decode_auth(str(entry["auth"]))
                except ValueError as e:
                    raise ValueError(f"{where}[{loc!r}].{e}") from None
            value = loc if loc.startswith(("https://", "http://")) else "https://" + loc
            try:
                parts = urlsplit(value)
            except ValueError:
                log.info("%s: registry location %r is not a URL; ignored", where, loc)
                continue
            path = parts.path
            if path.startswith(("/v2/", "/v1/")):
                path = path[3:]
            key = parts.netloc + path if path and path != "/" else parts.netloc
            found.append((key, RegistryAuth(username=user, password=password)))
        for key, auth in found:
            self._creds.setdefault(key, []).append(auth)

    def lookup(self, repository: str) -> list[RegistryAuth]:
        """Every credential whose location covers `repository`, the most specific
        location first (reverse order of the locations)."""
        out = [auth for key in sorted(self._creds, reverse=True)
               if registry_matches(key, repository) for auth in self._creds[key]]
        if not out and _default_registry(repository):
            out = list(self._creds.get(DEFAULT_REGISTRY_KEY, []))
        return out


def add_secret(keyring: Keyring, secret: Mapping[str, Any]) -> None:
    """A pull Secret's docker config into `keyring`; ValueError says why it cannot be."""
    kind = secret.get("type") or ""
    data = secret.get("data") or {}
    for secret_type, key in (DOCKER_CONFIG_JSON, DOCKER_CFG):
        if kind != secret_type:
            continue
        if not data.get(key):
            raise ValueError(f"data[{key}] is missing or empty")
        try:
            config = json.loads(base64.b64decode(data[key], validate=True))
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"data[{key}] is not base64 of JSON ({e})") from None
        if secret_type == DOCKER_CONFIG_JSON[0]:
            if not isinstance(config, Mapping):
                raise ValueError(f"data[{key}]: expected a JSON object")
            config = config.get("auths") or {}
            keyring.add(config, f"data[{key}].auths")
        else:
            keyring.add(config, f"data[{key}]")
        return
    raise ValueError(f"type {kind or '(none)'} is not {DOCKER_CONFIG_JSON[0]} or "
                     f"{DOCKER_CFG[0]}")


# --- back-off ----------------------------------------------------------------------------

class PullBackoff:
    """The kubelet's image back-off per (pod uid, image): after a failed pull the next
    waits `initial` s, doubling with each failure up to `maximum`; an entry not failed
    for 2 x `maximum` starts over."""

    def __init__(self, clock: Clock, initial: float = 10.0, maximum: float = 300.0) -> None:
        self.clock = clock
        self.initial = initial
        self.maximum = maximum
        self._e: dict[tuple[str, str], tuple[float, float]] = {}  # key -> (delay, failed at)

    def failed(self, key: tuple[str, str]) -> None:
        now = self.clock.monotonic()
        e = self._e.get(key)
        if e is None or now - e[1] > 2 * self.maximum:
            self._e[key] = (self.initial, now)
        else:
            self._e[key] = (min(e[0] * 2, self.maximum), now)

    def remaining(self, key: tuple[str, str]) -> float:
        e = self._e.get(key)
        return 0.0 if e is None else max(0.0, e[1] + e[0] - self.clock.monotonic())

    def forget(self, key: tuple[str, str]) -> None:
        self._e.pop(key, None)

    def forget_pod(self, uid: str) -> None:
        for k in [k for k in self._e if k[0] == uid]:
            del self._e[k]


# --- the manager -----------------------------------------------------------------------

def go_duration(seconds: float) -> str:
    """A duration as Go prints it, to the millisecond: 512ms, 1.5s, 2m3.25s."""
    ms = int(seconds * 1000)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, frac = divmod(rest, 1000)
    head = f"{hours}h{minutes}m" if hours else (f"{minutes}m" if minutes else "")
    return f"{head}{secs}{f'.{frac:03d}'.rstrip('0') if frac else ''}s"


@dataclass
class ImageCheck:
    """What the syncer does with a container's image: create the container (`ready`),
    or leave it waiting with `waiting` (None: ContainerCreating) and look again after
    `retry_after` s or once `pulling` is done. `failed`: the kubelet writes a Warning
    "Error: <reason>" for it."""
    ready: bool = False
    waiting: Waiting | None = None
    failed: bool = False
    retry_after: float | None = None
    pulling: asyncio.Future[None] | None = None


READY = ImageCheck(ready=True)


@dataclass
class _Waiter:
    pod: Pod
    container: str
    image: str     # as the pod spec names it
    since: float   # when the pod asked (monotonic)


@dataclass
class _Pull:
    ref: str
    creds: tuple[RegistryAuth, ...]
    done: asyncio.Future[None]
    waiters: dict[tuple[str, str], _Waiter] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None


@dataclass
class _PullMetrics:
    pulls: Counter
    duration: Histogram


@per_registry
def _pull_metrics(registry: CollectorRegistry) -> _PullMetrics:
    return _PullMetrics(
        pulls=Counter("nodepulse_image_pulls_total",
                      "Image pulls by result (pulled, failed).", ["result"],
                      registry=registry),
        duration=Histogram("nodepulse_image_pull_duration_seconds",
                           "Time one image pull took, not counting its wait for a turn.",
                           buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
                           registry=registry))


@dataclass(frozen=True)
class PullSettings:
    serialize: bool = True          # the kubelet's --serialize-image-pulls
    max_parallel: int = 0           # --max-parallel-image-pulls, when not serialized (0: any)
    backoff_initial: float = 10.0   # ImagePullBackOff: the first wait, doubling
    backoff_max: float = 300.0      # ... up to this
    call_timeout: float = 60.0      # a runtime call other than the pull itself
    # a Normal `Pulled` Event for an image already there, at every container start
    # (False where containers run nothing: see NodePodSettings.runs_workloads)
    present_events: bool = True


class ImageManager:
    NEVER_PULL_RETRY = 10.0  # look again for an image that must not be pulled
    AFTER_ERROR = 1.0        # after ErrImagePull was shown, show the back-off

    def __init__(self, runtime: Runtime, clock: Clock, *, kube: Kube | None = None,
                 events: Events | None = None, settings: PullSettings = PullSettings(),
                 registry: CollectorRegistry = REGISTRY) -> None:
        """`kube`: where the pull secrets are read."""
        self.runtime = runtime
        self.present_events = settings.present_events
        self._m = _pull_metrics(registry)
        self.clock = clock
        self.kube = kube
        self.events = events
        self.call_timeout = settings.call_timeout
        self.backoff = PullBackoff(clock, settings.backoff_initial, settings.backoff_max)
        slots = 1 if settings.serialize else settings.max_parallel
        self._slots = asyncio.Semaphore(slots) if slots > 0 else None
        self._pulls: dict[tuple[str, tuple[RegistryAuth, ...]], _Pull] = {}
        self._joined: dict[tuple[str, str], _Pull] = {}        # (uid, container) -> its pull
        self._results: dict[tuple[str, str], tuple[str, str | None]] = {}  # -> (image, error)
        self._errors: dict[tuple[str, str], str] = {}          # (uid, image) -> last error

    # --- what the syncer asks ---------------------------------------------------------

    async def ensure(self, pod: Pod, container: Mapping[str, Any]) -> ImageCheck:
        """Whether the container's image is there to create it from; starts (or joins)
        a pull when one is needed and allowed. Never waits for a pull."""
        uid = str(pod["metadata"]["uid"])
        cname = str(container.get("name") or "")
        image = str(container.get("image") or "")
        key = (uid, cname)
        try:
            name = parse_image(image)
        except ValueError as e:
            msg = (f'Failed to apply default image tag "{image}": couldn\'t parse image '
                   f'name "{image}": {e}')
            self._event(pod, cname, WARNING, "InspectFailed", msg)
            return ImageCheck(waiting=Waiting("InvalidImageName", msg), failed=True)
        ref = pull_ref(image, name)
        result = self._results.pop(key, None)
        if result is not None and result[0] == image:
            if result[1] is None:
                return READY
            return ImageCheck(waiting=Waiting("ErrImagePull", result[1]), failed=True,
                              retry_after=self.AFTER_ERROR)
        pull = self._joined.get(key)
        if pull is not None:
            if pull.ref == ref:
                return self._in_progress(uid, image, pull)
            self._leave(key)  # the spec names another image now; that pull goes on
        policy = pull_policy(container)
        if policy != "Always":
            present = start_call(self.runtime, self.runtime.image_present(ref))
            if not present.done():
                await clock_timeout(self.clock, present, self.call_timeout,
                                    f"runtime image_present {ref}")
            if present.result():
                if self.present_events:
                    self._event(pod, cname, NORMAL, "Pulled",
                                f'Container image "{image}" already present on machine')
                return READY
            if policy == "Never":
                msg = f'Container image "{image}" is not present with pull policy of Never'
                self._event(pod, cname, WARNING, "ErrImageNeverPull", msg)
                return ImageCheck(waiting=Waiting("ErrImageNeverPull", msg), failed=True,
                                  retry_after=self.NEVER_PULL_RETRY)
        wait = self.backoff.remaining((uid, image))
        if wait > 0:
            self._event(pod, cname, NORMAL, "BackOff", f'Back-off pulling image "{image}"')
            return ImageCheck(waiting=self._backoff_waiting(uid, image), failed=True,
                              retry_after=wait)
        creds = await self._credentials(pod, cname, name)
        self._event(pod, cname, NORMAL, "Pulling", f'Pulling image "{image}"')
        return self._in_progress(uid, image, self._join(pod, cname, image, ref, creds))

    def forget(self, uid: str) -> None:
        """The pod is gone: drop what is kept for it (a pull it waited for goes on)."""
        for key in [k for k in self._joined if k[0] == uid]:
            self._leave(key)
        for d in (self._results, self._errors):
            for k in [k for k in d if k[0] == uid]:
                del d[k]
        self.backoff.forget_pod(uid)

    async def close(self) -> None:
        """Stop the pulls under way (the runtime may finish them; nothing waits)."""
        pulls = list(self._pulls.values())
        for p in pulls:
            if p.task is not None:
                p.task.cancel()
        await asyncio.gather(*(p.task for p in pulls if p.task), return_exceptions=True)
        for p in pulls:  # a task cancelled before it ran never got to say so
            p.done.cancel()
        self._pulls.clear()

    def pulls_in_progress(self) -> int:
        return len(self._pulls)

    # --- internals -------------------------------------------------------------------

    def _event(self, pod: Pod, container: str, type_: str, reason: str, message: str) -> None:
        if self.events is not None:
            self.events.pod(pod, type_, reason, message, container=container)

    def _backoff_waiting(self, uid: str, image: str) -> Waiting:
        msg = f'Back-off pulling image "{image}"'
        last = self._errors.get((uid, image))
        return Waiting("ImagePullBackOff", f"{msg}: ErrImagePull: {last}" if last else msg)

    def _in_progress(self, uid: str, image: str, pull: _Pull) -> ImageCheck:
        # a pull after a failure: the status keeps saying back-off until it ends
        waiting = self._backoff_waiting(uid, image) if (uid, image) in self._errors else None
        return ImageCheck(waiting=waiting, pulling=pull.done)

    def _join(self, pod: Pod, container: str, image: str, ref: str,
              creds: tuple[RegistryAuth, ...]) -> _Pull:
        pull = self._pulls.get((ref, creds))
        if pull is None:
            pull = _Pull(ref, creds, asyncio.get_running_loop().create_future())
            self._pulls[(ref, creds)] = pull
            pull.task = asyncio.create_task(self._run(pull), name=f"pull {ref}")
        key = (str(pod["metadata"]["uid"]), container)
        pull.waiters[key] = _Waiter(pod, container, image, self.clock.monotonic())
        self._joined[key] = pull
        return pull

    def _leave(self, key: tuple[str, str]) -> None:
        pull = self._joined.pop(key, None)
        if pull is not None:
            pull.waiters.pop(key, None)

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        if self._slots is None:
            yield
            return
        async with self._slots:
            yield

    async def _run(self, pull: _Pull) -> None:
        info: ImageInfo | None = None
        try:
            async with self._slot():
                started = self.clock.monotonic()
                info, error = await self._pull(pull.ref, pull.creds)
                took = self.clock.monotonic() - started
        except asyncio.CancelledError:
            pull.done.cancel()
            raise
        finally:
            self._pulls.pop((pull.ref, pull.creds), None)
        now = self.clock.monotonic()
        for key, w in pull.waiters.items():
            self._joined.pop(key, None)
            self._results[key] = (w.image, error)
            bkey = (key[0], w.image)
            if error is None:
                assert info is not None
                self.backoff.forget(bkey)
                self._errors.pop(bkey, None)
                self._event(w.pod, w.container, NORMAL, "Pulled",
                            f'Successfully pulled image "{w.image}" in {go_duration(took)} '
                            f"({go_duration(now - w.since)} including waiting). Image size: "
                            f"{info.size_bytes} bytes.")
            else:
                self.backoff.failed(bkey)
                self._errors[bkey] = error
                self._event(w.pod, w.container, WARNING, "Failed",
                            f'Failed to pull image "{w.image}": {error}')
        self._m.pulls.labels(result="failed" if error else "pulled").inc()
        self._m.duration.observe(took)
        if error is None:
            log.info("pulled image %s (%d bytes) in %.1fs", pull.ref,
                     info.size_bytes if info else 0, took)
        else:
            log.info("pull of image %s failed: %s", pull.ref, error)
        pull.done.set_result(None)

    async def _pull(self, ref: str, creds: tuple[RegistryAuth, ...]
                    ) -> tuple[ImageInfo | None, str | None]:
        """Each credential in turn (none: anonymously) until one works. (info, None)
        or (None, the error; several, one per credential, as a list)."""
        errors = []
        for auth in creds or (None,):
            try:
                return await self.runtime.pull_image(ref, auth), None
            except ContainerRuntimeError as e:
                errors.append(str(e))
            except Exception as e:  # a bug, not the registry's answer: say so, go on
                log.exception("pull of image %s", ref)
                errors.append(f"{type(e).__name__}: {e}")
        return None, errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"

    async def _credentials(self, pod: Pod, container: str, name: ImageName
                           ) -> tuple[RegistryAuth, ...]:
        """The credentials for this image from the pod's pull secrets and its service
        account's; what cannot be read or used is named in one Warning."""
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        ns = str(meta.get("namespace") or "default")
        if self.kube is None:
            return ()
        names = [str(s.get("name")) for s in spec.get("imagePullSecrets") or []
                 if isinstance(s, Mapping) and s.get("name")]
        names += [n for n in await self._service_account_secrets(pod, ns) if n not in names]
        keyring = Keyring()
        problems = []
        for secret_name in names:
            try:
                secret = await self.kube.get(SECRETS, secret_name, namespace=ns, timeout=10)
            except Exception as e:  # unreadable: the pull goes on without it, as the kubelet's
                status = status_of(e)
                why = {404: "not found", 403: "forbidden"}.get(status or 0,
                                                               f"not read ({brief(e)})")
                problems.append(f"{secret_name}: {why}")
                continue
            try:
                add_secret(keyring, secret)
            except ValueError as e:
                problems.append(f"{secret_name}: {e}")
        if problems:
            self._event(pod, container, WARNING, "FailedToRetrieveImagePullSecret",
                        f"Unable to retrieve some image pull secrets ({'; '.join(problems)}); "
                        "attempting to pull the image may not succeed.")
        return tuple(keyring.lookup(name.repository))

    async def _service_account_secrets(self, pod: Pod, ns: str) -> list[str]:
        """The imagePullSecrets of the pod's service account. The API server's admission
        copies them into a new pod that names none of its own; reading them here also
        covers pods with their own and secrets added to the account later."""
        spec = pod.get("spec") or {}
        account = spec.get("serviceAccountName") or spec.get("serviceAccount")
        if not account or self.kube is None:
            return []
        try:
            sa = await self.kube.get(SERVICE_ACCOUNTS, str(account), namespace=ns, timeout=10)
        except Exception as e:  # not allowed (older API servers) or gone: the pod's own only
            log.debug("pod %s: service account %s not read (%s); its pull secrets are not "
                      "used", describe(pod), account, status_of(e) or type(e).__name__)
            return []
        return [str(s.get("name")) for s in sa.get("imagePullSecrets") or []
                if isinstance(s, Mapping) and s.get("name")]
