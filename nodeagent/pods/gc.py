"""Garbage collection, as the kubelet's: dead containers and their sandboxes every
`container_period`, unused images every `image_period`, and both at once when the
eviction manager asks for node-level reclaim (eviction.py).

Containers (the kubelet's policy, --minimum-container-ttl-duration,
--maximum-dead-containers-per-container, --maximum-dead-containers): the dead
(exited, unknown) instances of each container of a pod the node knows, older than the
minimum age, newest first; the first `max_per_container` are kept (the default 1 is
the instance `kubectl logs --previous` reads), the rest removed; with a node-wide
limit, the oldest go beyond it too. A running container, one of a pod no source has
(housekeeping's to remove, loops.py) and one created but not started yet (its pod
worker's to start) are never touched. A node-level reclaim removes, on top of that,
every container of the pods that have terminated. Sandboxes: a pod's stopped
sandboxes that hold no container, but its newest (all of them for a terminated pod
under reclaim).

Images (--image-gc-high-threshold, --image-gc-low-threshold, --minimum-image-ttl-duration):
once the image filesystem is used at the high threshold or more, images are removed
until it is down to the low one, least recently used first (then oldest first seen);
never an image a container uses (running or not: from a fresh relist), a pinned one
(the runtime's sandbox image), nor one first seen less than the minimum age ago. A
node-level reclaim removes every image that qualifies. When not enough could be freed,
a Warning `FreeDiskSpaceFailed` says so. A high threshold of 100 turns image collection
off.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Protocol

from nodeagent.api.clock import Clock, clock_timeout
from nodeagent.events import Events
from nodeagent.runtime.base import (
    Container,
    ContainerRuntimeError,
    ContainerState,
    ImageInfo,
    RelistResult,
    Runtime,
    Sandbox,
    SandboxState,
    Unsupported,
)

log = logging.getLogger(__name__)

ACTIVE, TERMINATED = "active", "terminated"


@dataclasses.dataclass(frozen=True)
class GcSettings:
    image_high_percent: int = 85
    image_low_percent: int = 80
    image_min_age: float = 120.0        # seconds since an image was first seen
    container_min_age: float = 0.0      # seconds since a dead container was created
    max_per_container: int = 1          # dead instances kept per container; < 0: all
    max_containers: int = -1            # dead containers kept on the node; < 0: all
    container_period: float = 60.0      # the kubelet's
    image_period: float = 300.0         # the kubelet's


# --- containers ------------------------------------------------------------------------

_EPOCH = dt.datetime.fromtimestamp(0, dt.UTC)


def _newest_first(cs: Iterable[Container]) -> list[Container]:
    return sorted(cs, key=lambda c: (c.created_at or _EPOCH, c.attempt), reverse=True)


def plan_containers(result: RelistResult, states: Mapping[str, str], now: dt.datetime,
                    settings: GcSettings, reclaim: bool = False
                    ) -> tuple[list[Container], list[str]]:
    """The containers, then the sandbox ids, to remove (the module docstring's policy).
    `states`: pod uid -> ACTIVE or TERMINATED for the pods the node knows."""
    oldest = now - dt.timedelta(seconds=settings.container_min_age)
    units: dict[tuple[str, str], list[Container]] = {}
    remove: list[Container] = []
    for c in result.containers:
        state = states.get(c.pod_uid)
        if state is None or c.state == ContainerState.RUNNING:
            continue
        if reclaim and state == TERMINATED:
            remove.append(c)
            continue
        if c.state == ContainerState.CREATED:
            continue
        if c.created_at is not None and c.created_at > oldest:
            continue
        units.setdefault((c.pod_uid, c.name), []).append(c)
    for key in units:
        units[key] = _newest_first(units[key])
    if settings.max_per_container >= 0:
        for key, cs in units.items():
            remove += cs[settings.max_per_container:]
            units[key] = cs[:settings.max_per_container]
    if settings.max_containers >= 0:
        total = sum(len(cs) for cs in units.values())
        if total > settings.max_containers:
            each = max(1, settings.max_containers // max(1, len(units)))
            for key, cs in units.items():
                remove += cs[each:]
                units[key] = cs[:each]
            left = _newest_first(c for cs in units.values() for c in cs)
            remove += left[settings.max_containers:]
    gone = {c.id for c in remove}
    holding = {c.sandbox_id for c in result.containers if c.id not in gone}
    by_pod: dict[str, list[Sandbox]] = {}
    for s in result.sandboxes:
        if s.pod_uid in states:
            by_pod.setdefault(s.pod_uid, []).append(s)
    sandboxes: list[str] = []
    for uid, sbs in by_pod.items():
        sbs.sort(key=lambda s: (s.attempt, s.created_at or _EPOCH), reverse=True)
        keep_newest = not (reclaim and states[uid] == TERMINATED)
        for s in sbs[1:] if keep_newest else sbs:
            if s.state == SandboxState.NOTREADY and s.id not in holding:
                sandboxes.append(s.id)
    return remove, sandboxes


# --- images ----------------------------------------------------------------------------

@dataclasses.dataclass
class _Image:
    id: str
    names: tuple[str, ...]
    size: int
    pinned: bool
    first_seen: float      # monotonic
    last_used: float = float("-inf")


class ImageRecords:
    """Every image of the store as the collector knows it: when it was first seen and
    last seen in use."""

    def __init__(self) -> None:
        self.images: dict[str, _Image] = {}

    def seen(self, images: Sequence[ImageInfo], now: float,
             in_use: set[str] | None = None) -> None:
        """The store's images as listed at `now` (and, when known, what containers use:
        image ids and names)."""
        current = set()
        for i in images:
            current.add(i.id)
            rec = self.images.get(i.id)
            if rec is None:
                rec = self.images[i.id] = _Image(i.id, tuple(i.names), i.size_bytes,
                                                 i.pinned, now)
            rec.names, rec.size, rec.pinned = tuple(i.names), i.size_bytes, i.pinned
            if in_use is not None and used(rec, in_use):
                rec.last_used = now
        for gone in set(self.images) - current:
            del self.images[gone]

    def candidates(self, in_use: set[str], now: float, min_age: float) -> list[_Image]:
        """The images that may go, least recently used first, then first seen first."""
        out = [r for r in self.images.values()
               if not r.pinned and not used(r, in_use) and now - r.first_seen >= min_age]
        return sorted(out, key=lambda r: (r.last_used, r.first_seen))


def used(image: _Image, in_use: set[str]) -> bool:
    return image.id in in_use or any(n in in_use for n in image.names)


def images_in_use(result: RelistResult) -> set[str]:
    """The images containers use, running or not: their ids and the names they were
    made with."""
    out = set()
    for c in result.containers:
        out.add(c.image)
        if c.image_id:
            out.add(c.image_id)
    return out


def bytes_to_free(capacity: float, available: float, high: int, low: int) -> float:
    """What the image collector frees: 0 below the high threshold; else down to the
    low one (the kubelet's integer percentages)."""
    available = min(available, capacity)
    usage = 100 - int(available * 100 / capacity)
    if usage < high:
        return 0.0
    return capacity * (100 - low) / 100 - available


# --- the collector -------------------------------------------------------------------

class PodStates(Protocol):
    """The pods the node knows (the sync loops)."""

    def pod_states(self) -> dict[str, str]:
        """uid -> ACTIVE or TERMINATED."""

    def last_relist(self) -> RelistResult | None:
        """What the PLEG's last relist found (None: none yet)."""


ImageFs = Callable[[], Awaitable[tuple[float, float] | None]]  # (capacity, available)


class GarbageCollector:
    def __init__(self, runtime: Runtime, clock: Clock, settings: GcSettings,
                 pods: PodStates | None = None, image_fs: ImageFs | None = None,
                 events: Events | None = None) -> None:
        """`pods`: the sync loops (set once built); `image_fs`: the image filesystem's
        capacity and available bytes (None: not measured), read off the event loop."""
        self.runtime = runtime
        self.clock = clock
        self.settings = settings
        self.pods = pods
        self.image_fs = image_fs
        self.events = events
        self.records = ImageRecords()
        self.removed_containers = 0
        self.removed_images = 0
        self._kick = asyncio.Event()
        self._lock = asyncio.Lock()  # one collection at a time
        self._cannot_remove: str | None = None  # the runtime refuses image removal

    def kick(self) -> None:
        """Collect images now (the thresholds changed)."""
        self._kick.set()

    def images_listed(self, images: Sequence[ImageInfo]) -> None:
        """The store's images, as the pod half's periodic reading listed them: first
        sightings are dated from here."""
        self.records.seen(images, self.clock.monotonic())

    async def run(self) -> None:
        await asyncio.gather(self._every(self.settings.container_period,
                                          self.collect_containers, None),
                             self._every(self.settings.image_period, self.collect_images,
                                         self._kick))

    async def _every(self, period: float, step: Callable[[], Awaitable[object]],
                     kick: asyncio.Event | None) -> None:
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except ContainerRuntimeError as e:
                log.warning("garbage collection: %s", e)
            except Exception:  # a bug: log it, keep collecting
                log.exception("garbage collection failed")
            if kick is None:
                await self.clock.sleep(period)
                continue
            kick.clear()
            with contextlib.suppress(TimeoutError):
                await clock_timeout(self.clock, kick.wait(), period, "the next collection")

    # -- containers --
    async def collect_containers(self, reclaim: bool = False) -> int:
        """Remove the dead containers and sandboxes the policy does not keep; how many
        containers went."""
        if self.pods is None:
            return 0
        async with self._lock:
            # the PLEG's last relist will do for the periodic collection (what died
            # since waits for the next one); node-level reclaim wants what is there now
            result = await self.runtime.relist() if reclaim else self.pods.last_relist()
            if result is None:
                return 0
            states = self.pods.pod_states()
            containers, sandboxes = plan_containers(result, states, self.clock.now(),
                                                    self.settings, reclaim)
            failures = []
            removed = 0
            for c in containers:
                try:
                    if c.state == ContainerState.UNKNOWN:  # stopped first, as the kubelet
                        await self.runtime.stop_container(c.id, 0)
                    await self.runtime.remove_container(c.id)
                    removed += 1
                except ContainerRuntimeError as e:
                    failures.append(f"container {c.id}: {e}")
            for sid in sandboxes:
                try:
                    await self.runtime.stop_sandbox(sid)
                    await self.runtime.remove_sandbox(sid)
                except ContainerRuntimeError as e:
                    failures.append(f"sandbox {sid}: {e}")
            self.removed_containers += removed
            if containers or sandboxes:
                log.info("garbage collection: removed %d dead container(s) and %d stopped "
                         "sandbox(es)", removed, len(sandboxes))
            if failures:
                raise ContainerRuntimeError("; ".join(failures))
            return removed

    async def remove_dead_containers(self) -> None:
        """Node-level reclaim: every dead container the policy allows and those of
        terminated pods."""
        await self.collect_containers(reclaim=True)

    # -- images --
    async def collect_images(self) -> float:
        """The high/low threshold policy; the bytes freed."""
        s = self.settings
        if s.image_high_percent >= 100 or self.image_fs is None:
            return 0.0
        fs = await self.image_fs()
        if fs is None:
            return 0.0
        capacity, available = fs
        if capacity <= 0:
            if self.events is not None:
                self.events.warning("InvalidDiskCapacity",
                                    "invalid capacity 0 on image filesystem")
            return 0.0
        want = bytes_to_free(capacity, available, s.image_high_percent, s.image_low_percent)
        if want <= 0:
            return 0.0
        usage = 100 - int(min(available, capacity) * 100 / capacity)
        log.info("garbage collection: image filesystem %d%% used (high threshold %d%%): "
                 "freeing %d bytes", usage, s.image_high_percent, want)
        freed = await self._free(want)
        if freed < want and self.events is not None:
            self.events.warning(
                "FreeDiskSpaceFailed",
                f"Insufficient free disk space on the node's image filesystem ({usage}% of "
                f"{_size(capacity)} used). Failed to free sufficient space by deleting "
                f"unused images (freed {int(freed)} bytes). Investigate disk usage, as it "
                "could be used by active images, logs, volumes, or other data.")
        return freed

    async def remove_unused_images(self) -> None:
        """Node-level reclaim: every image that may go."""
        await self._free(float("inf"))

    async def _free(self, want: float) -> float:
        async with self._lock:
            now = self.clock.monotonic()
            images, result = await asyncio.gather(self.runtime.list_images(),
                                                  self.runtime.relist())
            in_use = images_in_use(result)
            self.records.seen(images, now, in_use)
            freed = 0.0
            for img in self.records.candidates(in_use, now, self.settings.image_min_age):
                if freed >= want:
                    break
                try:
                    await self.runtime.remove_image(img.id)
                except Unsupported as e:
                    if self._cannot_remove is None:
                        log.info("garbage collection: images are not collected: %s", e)
                    self._cannot_remove = str(e)
                    break
                except ContainerRuntimeError as e:
                    log.warning("garbage collection: image %s: %s", img.id, e)
                    continue
                log.info("garbage collection: removed image %s (%s, %d bytes)", img.id,
                         ", ".join(img.names) or "no name", img.size)
                self.records.images.pop(img.id, None)
                self.removed_images += 1
                freed += img.size
            return freed


def _size(n: float) -> str:
    """Bytes for a person (the kubelet's format in its Event)."""
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"
