"""Garbage collection (nodeagent.pods.gc): which dead containers and sandboxes go, as
tables (no runtime, no clock); then the image collector on the fake runtime and
FakeClock: the high and low thresholds, least recently used first, never an image in
use, pinned, or younger than the minimum age."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import pytest

from nodeagent.api.clock import FakeClock
from nodeagent.events import Events
from nodeagent.pods.gc import (
    ACTIVE,
    TERMINATED,
    GarbageCollector,
    GcSettings,
    bytes_to_free,
    plan_containers,
)
from nodeagent.runtime.base import (
    Container,
    ContainerConfig,
    ContainerState,
    RelistResult,
    Sandbox,
    SandboxConfig,
    SandboxState,
)
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import aio
from tests.fakekube import FakeKube

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
EXITED, RUNNING = ContainerState.EXITED, ContainerState.RUNNING


def c(uid: str, name: str, attempt: int, state: ContainerState = EXITED, *,
      age: float = 600, sandbox: str = "") -> Container:
    """A container of pod `uid` created `age` seconds before T0."""
    return Container(id=f"{uid}-{name}-{attempt}", sandbox_id=sandbox or f"{uid}-s0",
                     pod_uid=uid, name=name, image="img", state=state, attempt=attempt,
                     created_at=T0 - dt.timedelta(seconds=age - attempt))


def sb(uid: str, attempt: int, ready: bool = False) -> Sandbox:
    return Sandbox(id=f"{uid}-s{attempt}", pod_uid=uid, name=uid, namespace="ns",
                   attempt=attempt, state=SandboxState.READY if ready else SandboxState.NOTREADY,
                   created_at=T0 - dt.timedelta(seconds=1000 - attempt))


def plan(containers: Sequence[Container], sandboxes: Sequence[Sandbox] = (),
         states: dict[str, str] | None = None, reclaim: bool = False,
         settings: GcSettings | None = None) -> tuple[list[str], list[str]]:
    cs, sbs = plan_containers(RelistResult(list(sandboxes), list(containers)),
                              states if states is not None else {"p": ACTIVE, "q": ACTIVE},
                              T0, settings or GcSettings(), reclaim)
    return sorted(x.id for x in cs), sorted(sbs)


def test_the_newest_dead_instance_of_each_container_is_kept() -> None:
    assert plan([c("p", "a", 0), c("p", "a", 1), c("p", "a", 2, RUNNING),
                 c("p", "b", 0), c("q", "a", 0), c("q", "a", 1)]) == (
        ["p-a-0", "q-a-0"], [])


def test_policy_settings() -> None:
    dead = [c("p", "a", i) for i in range(4)]
    assert plan(dead, settings=GcSettings(max_per_container=2))[0] == ["p-a-0", "p-a-1"]
    assert plan(dead, settings=GcSettings(max_per_container=-1))[0] == []
    assert plan(dead, settings=GcSettings(max_per_container=0))[0] == [
        "p-a-0", "p-a-1", "p-a-2", "p-a-3"]
    # a node-wide cap: first a share per container, then the oldest
    many = [*dead, c("q", "a", 0), c("q", "b", 0, age=700)]
    assert plan(many, settings=GcSettings(max_per_container=-1, max_containers=2))[0] == [
        "p-a-0", "p-a-1", "p-a-2", "q-b-0"]
    # too young to go (the minimum age)
    young = [c("p", "a", 0, age=600), c("p", "a", 1, age=30), c("p", "a", 2, age=20)]
    assert plan(young, settings=GcSettings(container_min_age=60))[0] == []
    assert plan(young)[0] == ["p-a-0", "p-a-1"]


def test_what_is_never_touched() -> None:
    created = Container(id="p-a-9", sandbox_id="p-s0", pod_uid="p", name="a", image="img",
                        state=ContainerState.CREATED, attempt=9, created_at=T0)
    unknown_pod = [c("orphan", "a", 0), c("orphan", "a", 1)]
    assert plan([c("p", "a", 0, RUNNING), created, *unknown_pod],
                settings=GcSettings(max_per_container=0))[0] == []


def test_reclaim_takes_every_container_of_terminated_pods() -> None:
    cs = [c("p", "a", 0), c("p", "a", 1), c("q", "a", 0), c("q", "a", 1)]
    states = {"p": TERMINATED, "q": ACTIVE}
    assert plan(cs, states=states) == (["p-a-0", "q-a-0"], [])
    assert plan(cs, states=states, reclaim=True) == (["p-a-0", "p-a-1", "q-a-0"], [])


def test_sandboxes_a_pods_newest_is_kept_and_one_holding_a_container() -> None:
    sandboxes = [sb("p", 0), sb("p", 1), sb("p", 2, ready=True), sb("q", 0), sb("q", 1)]
    held = c("p", "a", 0, sandbox="p-s1")
    assert plan([held], sandboxes) == ([], ["p-s0", "q-s0"])
    # under reclaim a terminated pod keeps none
    assert plan([], [sb("q", 0), sb("q", 1)], states={"q": TERMINATED},
                reclaim=True) == ([], ["q-s0", "q-s1"])


@pytest.mark.parametrize("available, freed", [
    (20, 0.0),       # 80 % used: below 85
    (15, 5.0),       # 85 %: down to 80 % used, 5 of 100
    (5, 15.0),
    (150, 0.0),      # more available than capacity: none used
])
def test_bytes_to_free_between_the_high_and_low_thresholds(available: float,
                                                           freed: float) -> None:
    assert bytes_to_free(100, available, 85, 80) == freed


class ImageRig:
    def __init__(self, *images: str, size: int = 100, min_age: float = 0) -> None:
        self.clock = FakeClock()
        self.rt = FakeRuntime(self.clock, images=images, image_size=size)
        self.store: set[str] = self.rt.images or set()  # what the runtime's store holds
        self.fs = (1000.0, 500.0)  # capacity, available
        self.pods: dict[str, str] = {}

        async def image_fs() -> tuple[float, float]:
            return self.fs
        self.gc = GarbageCollector(self.rt, self.clock,
                                   GcSettings(image_min_age=min_age), pods=self,
                                   image_fs=image_fs)

    def pod_states(self) -> dict[str, str]:
        return self.pods

    def last_relist(self) -> RelistResult | None:
        return None  # images only here

    async def listed(self) -> None:
        """The periodic image list the node status reads, seen by the collector."""
        self.gc.images_listed(await self.rt.list_images())


@aio
async def test_images_go_least_recently_used_first_until_the_low_threshold() -> None:
    r = ImageRig("localhost/a:1", "localhost/b:1", "localhost/c:1", "localhost/used:1",
                 "localhost/pause:1", min_age=120)
    r.rt.pinned.add("localhost/pause:1")
    await r.listed()
    await r.clock.advance(60)
    r.store.add("localhost/new:1")  # pulled later: younger than the minimum age
    await r.listed()
    # b and c were used (by a container now gone); a never was
    for name, ref in (("b", "localhost/b:1"), ("c", "localhost/c:1")):
        sid = await r.rt.run_sandbox(_sandbox(name))
        r.pods[name] = ACTIVE
        cid = await r.rt.create_container(sid, _config(name, ref), _sandbox(name))
        await r.gc.collect_images()  # nothing to free yet: records what is in use
        await r.rt.remove_container(cid)
        await r.clock.advance(10)
    sid = await r.rt.run_sandbox(_sandbox("u"))
    await r.rt.create_container(sid, _config("u", "localhost/used:1"), _sandbox("u"))
    await r.clock.advance(60)
    r.fs = (1000.0, 50.0)  # 95 % used: 150 to free, down to 80 %
    assert await r.gc.collect_images() == 200.0  # a (never used), then b (used longest ago)
    assert r.rt.images == {"localhost/c:1", "localhost/used:1", "localhost/pause:1",
                           "localhost/new:1"}
    await r.gc.remove_unused_images()  # node-level reclaim: all that may go
    assert r.rt.images == {"localhost/used:1", "localhost/pause:1", "localhost/new:1"}
    await r.clock.advance(120)
    await r.gc.remove_unused_images()
    assert r.rt.images == {"localhost/used:1", "localhost/pause:1"}


@aio
async def test_not_enough_to_free_says_so_and_100_turns_it_off() -> None:
    r = ImageRig("localhost/a:1")
    kube = FakeKube(now=r.clock.monotonic)
    r.gc.events = Events(kube, "n1", r.clock, node_uid=lambda: "uid-n1")
    r.fs = (1000.0, 10.0)
    assert await r.gc.collect_images() == 100.0
    await r.gc.events.drain()
    msgs = [x.body["message"] for x in kube.calls_of("create events")
            if x.body and x.body["reason"] == "FreeDiskSpaceFailed"]
    assert msgs == ["Insufficient free disk space on the node's image filesystem (99% of "
                    "1000 B used). Failed to free sufficient space by deleting unused images "
                    "(freed 100 bytes). Investigate disk usage, as it could be used by active "
                    "images, logs, volumes, or other data."]
    r.store.add("localhost/b:1")
    r.gc.settings = GcSettings(image_high_percent=100, image_min_age=0)
    assert await r.gc.collect_images() == 0.0 and "localhost/b:1" in r.store


def _sandbox(name: str) -> SandboxConfig:
    return SandboxConfig(name=name, namespace="ns", uid=name)


def _config(name: str, image: str) -> ContainerConfig:
    return ContainerConfig(name="c", image=image, pod_uid=name)
