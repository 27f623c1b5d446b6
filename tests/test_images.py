"""Image pulls (nodeagent/pods/images.py): names and policies, the credential keyring, the
back-off, and the manager with the fake runtime's registry, the in-memory API and a
FakeClock; then the same through the sync loops, as pods see it."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import PODS, SECRETS, SERVICE_ACCOUNTS
from nodeagent.config import ConfigError
from nodeagent.events import Events
from nodeagent.pods.images import (
    ImageManager,
    Keyring,
    PullBackoff,
    PullSettings,
    add_secret,
    go_duration,
    parse_image,
    pull_policy,
    registry_matches,
)
from nodeagent.pods.podupdate import Op, Pod
from nodeagent.runtime.base import RegistryAuth
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import LoopRig, agent_config, aio, mkpod, started
from tests.fakekube import FakeKube, api_error

REG = "registry.example:5000"
APP = f"{REG}/team/app:1"
CREDS = RegistryAuth(username="puller", password="s3cret")


def docker_secret(name: str, location: str = REG, user: str = "puller",
                  password: str = "s3cret", *, ns: str = "ns",
                  kind: str = "kubernetes.io/dockerconfigjson") -> dict[str, Any]:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    data: dict[str, Any]
    if kind == "kubernetes.io/dockercfg":
        data = {".dockercfg": {location: {"auth": auth}}}
    else:
        data = {".dockerconfigjson": {"auths": {location: {"auth": auth}}}}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns},
            "type": kind,
            "data": {k: base64.b64encode(json.dumps(v).encode()).decode()
                     for k, v in data.items()}}


NOT_IMAGES = ("MissingClusterDNS", "Created", "Started")  # the pod's resolver, containers


def events_of(kube: FakeKube) -> list[tuple[str, str, str]]:
    """(type, reason, message) of every Event written about images."""
    return [(b["type"], b["reason"], b["message"]) for b in kube.bodies("create events")
            if b["reason"] not in NOT_IMAGES]


# --- names and policies ----------------------------------------------------------------

def test_image_names_are_normalized_as_the_kubelet_does() -> None:
    n = parse_image("busybox")
    assert (n.repository, n.tag, n.digest) == ("docker.io/library/busybox", "", "")
    assert parse_image("index.docker.io/team/app:2").repository == "docker.io/team/app"
    assert parse_image("team/app").repository == "docker.io/team/app"
    assert parse_image("localhost/busybox:1").repository == "localhost/busybox"
    n = parse_image(f"{REG}/team/app:1")
    assert (n.domain, n.path, n.tag) == (REG, "team/app", "1")
    digest = "sha256:" + "a" * 64
    n = parse_image(f"[::1]:5000/app:1@{digest}")
    assert (n.domain, n.tag, n.digest) == ("[::1]:5000", "1", digest)
    for bad, why in [("Bad Image", "invalid reference format"),
                     ("library/Busybox", "must be lowercase"),
                     ("", "at least one component"),
                     ("a" * 64, "64-byte hexadecimal"),
                     ("app@sha256:abc", "invalid reference format"),
                     ("app@md5:" + "a" * 32, "unsupported digest algorithm"),
                     ("app:" + "t" * 129, "invalid reference format"),
                     ("x/" + "a" * 300, "not be more than 255")]:
        with pytest.raises(ValueError, match=why):
            parse_image(bad)


def test_pull_policy_defaults_as_the_api_server_sets_them() -> None:
    assert pull_policy({"image": "busybox"}) == "Always"
    assert pull_policy({"image": "localhost:5000/busybox:latest"}) == "Always"
    assert pull_policy({"image": "localhost:5000/busybox:1"}) == "IfNotPresent"
    assert pull_policy({"image": "x@sha256:" + "a" * 64}) == "IfNotPresent"
    assert pull_policy({"image": "x:latest@sha256:" + "a" * 64}) == "Always"
    assert pull_policy({"image": "x:1", "imagePullPolicy": "Never"}) == "Never"


def test_go_durations() -> None:
    assert [go_duration(s) for s in (0, 0.0004, 0.512, 1.5, 2, 123.25, 3725)] == [
        "0s", "0s", "512ms", "1.5s", "2s", "2m3.25s", "1h2m5s"]


# --- credentials -----------------------------------------------------------------------

def test_registry_locations_match_host_port_and_path_prefix() -> None:
    assert registry_matches(REG, f"{REG}/team/app")
    assert not registry_matches("registry.example", f"{REG}/team/app")   # port differs
    assert not registry_matches(REG, "registry.example/team/app")
    assert registry_matches(f"{REG}/team", f"{REG}/team/app")
    assert registry_matches(f"{REG}/team", f"{REG}/teamwork/app")       # a string prefix
    assert not registry_matches(f"{REG}/other", f"{REG}/team/app")
    assert registry_matches("*.example.com", "eu.example.com/app")
    assert not registry_matches("*.example.com", "a.eu.example.com/app")  # one part each


def test_keyring_most_specific_first_and_the_default_registry() -> None:
    k = Keyring()
    k.add({REG: {"username": "host", "password": "1"},
           f"https://{REG}/v2/team": {"auth": base64.b64encode(b"team:2").decode()},
           "http://other.example/v1/": {"username": "o", "password": "3"},
           "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:4").decode()
                                           .rstrip("=")}}, "test")
    assert [a.username for a in k.lookup(f"{REG}/team/app")] == ["team", "host"]
    assert [a.username for a in k.lookup(f"{REG}/else/app")] == ["host"]
    assert [(a.username, a.password) for a in k.lookup("other.example/app")] == [("o", "3")]
    assert [a.username for a in k.lookup("docker.io/library/busybox")] == ["hub"]
    assert k.lookup("quay.example/app") == []
    with pytest.raises(ValueError, match=r"test\['r.example'\]\.auth is not base64"):
        k.add({"r.example": {"auth": "%%%"}}, "test")
    with pytest.raises(ValueError, match="username:password"):
        k.add({"r.example": {"auth": base64.b64encode(b"nocolon").decode()}}, "test")


def test_pull_secrets_of_both_docker_types_and_bad_ones_named() -> None:
    k = Keyring()
    add_secret(k, docker_secret("a"))
    add_secret(k, docker_secret("b", "other.example", "cfg", kind="kubernetes.io/dockercfg"))
    assert k.lookup(f"{REG}/team/app") == [CREDS]
    assert k.lookup("other.example/x") == [RegistryAuth(username="cfg", password="s3cret")]
    opaque = {"type": "Opaque", "data": {}}
    with pytest.raises(ValueError, match="type Opaque is not kubernetes.io/dockerconfigjson"):
        add_secret(k, opaque)
    empty = {"type": "kubernetes.io/dockerconfigjson", "data": {}}
    with pytest.raises(ValueError, match=r"data\[.dockerconfigjson\] is missing"):
        add_secret(k, empty)
    junk = {"type": "kubernetes.io/dockerconfigjson",
            "data": {".dockerconfigjson": base64.b64encode(b"{not json").decode()}}
    with pytest.raises(ValueError, match=r"data\[.dockerconfigjson\] is not base64 of JSON"):
        add_secret(k, junk)


def test_backoff_doubles_to_five_minutes_and_starts_over() -> None:
    clock = FakeClock()
    b = PullBackoff(clock)
    key = ("u", "img")
    delays = []
    for _ in range(7):
        b.failed(key)
        delays.append(b.remaining(key))
    assert delays == [10, 20, 40, 80, 160, 300, 300]
    clock._t += 601  # not failed for 2 x 5 min
    b.failed(key)
    assert b.remaining(key) == 10


# --- the manager -------------------------------------------------------------------------

class Rig:
    def __init__(self, **kw: Any) -> None:
        self.clock = FakeClock()
        self.rt = FakeRuntime(self.clock, images=[])
        self.kube = FakeKube(now=self.clock.monotonic)
        self.events = Events(self.kube, "n1", self.clock, node_uid=lambda: "node-uid")
        self.registry = CollectorRegistry()
        self.m = ImageManager(self.rt, self.clock, kube=self.kube, events=self.events,
                              registry=self.registry, settings=PullSettings(**kw))

    async def ensure(self, pod: Pod, i: int = 0) -> Any:
        return await self.m.ensure(pod, pod["spec"]["containers"][i])

    async def events_(self) -> list[tuple[str, str, str]]:
        await self.events.drain()
        return events_of(self.kube)


def pods(n: int, image: str = "", **kw: Any) -> list[Pod]:
    return [mkpod(f"p{i}", image=image or f"{REG}/img{i}:1", **kw) for i in range(n)]


@aio
async def test_pulls_are_serialized_by_default_and_bounded_when_parallel() -> None:
    runs: list[tuple[dict[str, Any], int, int]] = [
        ({}, 1, 15), ({"serialize": False, "max_parallel": 2}, 2, 10),
        ({"serialize": False}, 3, 5)]
    for kw, most, took in runs:
        r = Rig(**kw)
        r.rt.pull_delay = 5
        r.rt.registry = {f"{REG}/img{i}:1": None for i in range(3)}
        ps = pods(3)
        checks = [await r.ensure(p) for p in ps]
        assert all(c.pulling is not None and not c.ready and c.waiting is None for c in checks)
        await settle()
        await r.clock.advance(took - 0.5)
        assert not all(c.pulling.done() for c in checks)
        await r.clock.advance(0.5)
        await settle()
        assert all(c.pulling.done() for c in checks), kw
        assert r.rt.max_pulling == most
        assert [(await r.ensure(p)).ready for p in ps] == [True] * 3
        pulled = [m for _, reason, m in await r.events_() if reason == "Pulled"]
        assert f'Successfully pulled image "{REG}/img2:1" in 5s ({took}s including waiting). ' \
               "Image size: 5000000 bytes." in pulled


@aio
async def test_one_pull_is_shared_by_the_pods_that_want_it() -> None:
    r = Rig()
    r.rt.pull_delay = 5
    r.rt.registry = {APP: None}
    a, b = pods(2, image=APP)
    first, second = await r.ensure(a), await r.ensure(b)
    assert first.pulling is second.pulling
    await settle()  # the pull's task starts
    await r.clock.advance(5)
    await settle()
    assert len(r.rt.pulls) == 1
    assert (await r.ensure(a)).ready and (await r.ensure(b)).ready
    assert r.registry.get_sample_value("nodepulse_image_pulls_total",
                                       {"result": "pulled"}) == 1
    assert r.registry.get_sample_value("nodepulse_image_pull_duration_seconds_sum") == 5
    # each pod hears of it
    assert [e[1] for e in await r.events_()].count("Pulled") == 2


@aio
async def test_if_not_present_pulls_once_always_every_time_never_not_at_all() -> None:
    r = Rig()
    r.rt.registry = {APP: None}
    p = mkpod("p", image=APP)                           # IfNotPresent by default
    check = await r.ensure(p)
    await settle()
    assert check.pulling is not None and check.pulling.done()
    assert (await r.ensure(p)).ready
    assert (await r.ensure(p)).ready and len(r.rt.pulls) == 1
    assert ("Normal", "Pulled", f'Container image "{APP}" already present on machine') \
        in await r.events_()
    always = mkpod("a", image=APP, containers=[{"name": "c", "image": APP,
                                                 "imagePullPolicy": "Always"}])
    for n in (2, 3):
        assert (await r.ensure(always)).pulling is not None
        await settle()
        assert (await r.ensure(always)).ready and len(r.rt.pulls) == n
    never = mkpod("n", containers=[{"name": "c", "image": f"{REG}/absent:1",
                                    "imagePullPolicy": "Never"}])
    check = await r.ensure(never)
    msg = f'Container image "{REG}/absent:1" is not present with pull policy of Never'
    assert (check.waiting.reason, check.waiting.message, check.failed) == (
        "ErrImageNeverPull", msg, True)
    assert ("Warning", "ErrImageNeverPull", msg) in await r.events_()
    assert len(r.rt.pulls) == 3


@aio
async def test_a_failed_pull_backs_off_per_pod_and_image() -> None:
    r = Rig()
    r.rt.registry = {APP: CREDS}
    p = mkpod("p", image=APP)
    await r.ensure(p)
    await settle()
    err = await r.ensure(p)
    assert err.waiting.reason == "ErrImagePull" and "401 Unauthorized" in err.waiting.message
    assert err.failed and err.retry_after == 1.0
    seen = []
    for _ in range(4):  # retried at 10 s, 20 s, 40 s after each failure
        check = await r.ensure(p)
        assert check.waiting.reason == "ImagePullBackOff"
        assert check.waiting.message.startswith(f'Back-off pulling image "{APP}": '
                                                "ErrImagePull: fake PullImage")
        seen.append(check.retry_after)
        await r.clock.advance(check.retry_after)
        pulling = await r.ensure(p)
        # while it pulls again, the status keeps saying back-off
        assert pulling.pulling is not None and pulling.waiting.reason == "ImagePullBackOff"
        await settle()
        assert (await r.ensure(p)).waiting.reason == "ErrImagePull"
    assert seen == [10, 20, 40, 80]
    assert r.registry.get_sample_value("nodepulse_image_pulls_total",
                                       {"result": "failed"}) == 5
    # another pod is not held back by this one's failures
    other = mkpod("q", image=APP)
    assert (await r.ensure(other)).pulling is not None
    got = await r.events_()
    assert ("Normal", "Pulling", f'Pulling image "{APP}"') in got
    assert ("Normal", "BackOff", f'Back-off pulling image "{APP}"') in got
    assert any(t == "Warning" and reason == "Failed" and
               m.startswith(f'Failed to pull image "{APP}": fake PullImage') and "401" in m
               for t, reason, m in got)


@aio
async def test_credentials_from_pod_and_service_account_secrets() -> None:
    r = Rig()
    r.rt.registry = {APP: CREDS}
    r.kube.put(SECRETS, docker_secret("right"))
    r.kube.put(SECRETS, docker_secret("wrong", password="nope"))
    r.kube.put(SECRETS, docker_secret("elsewhere", "other.example"))
    r.kube.put(SERVICE_ACCOUNTS, {"metadata": {"name": "builder", "namespace": "ns"},
                                  "imagePullSecrets": [{"name": "right"}]})
    cases: list[tuple[dict[str, Any], bool]] = [
        ({"imagePullSecrets": [{"name": "right"}]}, True),
        ({"imagePullSecrets": [{"name": "wrong"}]}, False),
        ({"imagePullSecrets": [{"name": "elsewhere"}]}, False),  # not for this registry
        ({"serviceAccountName": "builder"}, True),
        # the pod's own are tried first, then the account's
        ({"serviceAccountName": "builder", "imagePullSecrets": [{"name": "wrong"}]}, True),
        ({"serviceAccountName": "nobody"}, False),
    ]
    for i, (spec, runs) in enumerate(cases):
        p = mkpod(f"p{i}", image=APP, **spec)
        await r.ensure(p)
        await settle()
        check = await r.ensure(p)
        assert check.ready is runs, spec
        r.rt.images = set()  # pulled afresh for each case
    sent = [auth for _, auth in r.rt.pulls]
    assert sent == [CREDS, RegistryAuth(username="puller", password="nope"), None, CREDS,
                    RegistryAuth(username="puller", password="nope"), CREDS, None]


@aio
async def test_unreadable_pull_secrets_are_named_and_the_pull_goes_on() -> None:
    r = Rig()
    r.rt.registry = {APP: None}
    r.kube.put(SECRETS, {"metadata": {"name": "opaque", "namespace": "ns"}, "type": "Opaque"})
    r.kube.put(SECRETS, docker_secret("secret-denied"))
    r.kube.intercept("get secrets", lambda c: api_error(403) if c.name == "secret-denied"
                     else None)
    p = mkpod("p", image=APP, imagePullSecrets=[{"name": "missing"}, {"name": "opaque"},
                                                {"name": "secret-denied"}, {"name": ""}])
    await r.ensure(p)
    await settle()
    assert (await r.ensure(p)).ready
    assert ("Warning", "FailedToRetrieveImagePullSecret",
            "Unable to retrieve some image pull secrets (missing: not found; opaque: type "
            "Opaque is not kubernetes.io/dockerconfigjson or kubernetes.io/dockercfg; "
            "secret-denied: forbidden); attempting to pull the image may not succeed.") \
        in await r.events_()


@aio
async def test_invalid_image_names_are_refused_before_any_pull() -> None:
    r = Rig()
    p = mkpod("p", image="not an/image")
    check = await r.ensure(p)
    assert check.waiting.reason == "InvalidImageName" and check.failed
    assert check.waiting.message == ('Failed to apply default image tag "not an/image": '
                                      'couldn\'t parse image name "not an/image": invalid '
                                      "reference format")
    assert r.rt.pulls == [] and r.rt.calls["image_present"] == 0
    assert ("Warning", "InspectFailed", check.waiting.message) in await r.events_()


@aio
async def test_an_untagged_image_is_pulled_as_latest() -> None:
    r = Rig()
    r.rt.registry = {f"{REG}/tools:latest": None}
    p = mkpod("p", image=f"{REG}/tools")
    await r.ensure(p)
    await settle()
    assert (await r.ensure(p)).ready
    assert r.rt.pulls == [(f"{REG}/tools:latest", None)]


@aio
async def test_close_stops_pulls_under_way() -> None:
    r = Rig()
    r.rt.pull_delay = 600
    r.rt.registry = {APP: None}
    check = await r.ensure(mkpod("p", image=APP))
    await settle()
    assert r.m.pulls_in_progress() == 1
    await r.m.close()
    assert check.pulling.cancelled() and r.m.pulls_in_progress() == 0
    # also one whose task never got to run
    check = await r.ensure(mkpod("q", image=APP))
    await r.m.close()
    assert check.pulling.cancelled() and r.m.pulls_in_progress() == 0


def test_agent_flags_for_pull_concurrency(tmp_path: Path) -> None:
    assert agent_config(tmp_path).serialize_image_pulls is True
    cfg = agent_config(tmp_path, "--serialize-image-pulls=false",
                       "--max-parallel-image-pulls", "3")
    assert (cfg.serialize_image_pulls, cfg.max_parallel_image_pulls) == (False, 3)
    with pytest.raises(ConfigError, match="--max-parallel-image-pulls .2. must be 1 or unset "
                                          "while --serialize-image-pulls is true"):
        agent_config(tmp_path, "--max-parallel-image-pulls", "2")
    with pytest.raises(ConfigError, match="--max-parallel-image-pulls"):
        agent_config(tmp_path, "--serialize-image-pulls=false",
                     "--max-parallel-image-pulls", "0")


# --- through the sync loops ----------------------------------------------------------------

def reasons(a: LoopRig, uid: str) -> list[str]:
    """The waiting reasons the pod's first container showed, in order, repeats merged."""
    out: list[str] = []
    for u, st in a.patches():
        for cs in st.get("containerStatuses") or []:
            state = cs.get("state") or {}
            r = (state.get("waiting") or {}).get("reason") or next(iter(state), "")
            if u == uid and (not out or out[-1] != r):
                out.append(r)
    return out


async def loop_rig(**registry: RegistryAuth | None) -> LoopRig:
    clock = FakeClock()
    rt = FakeRuntime(clock, images=["localhost/busybox:1"])
    rt.registry = {APP: None, **{k.replace("_", "/"): v for k, v in registry.items()}}
    return await started(clock, rt)


@aio
async def test_a_pod_whose_image_is_only_in_the_registry_pulls_and_runs() -> None:
    a = await loop_rig()
    a.rt.pull_delay = 4
    a.send(Op.ADD, mkpod("p", "u1", image=APP))
    await a.run_for(8)
    assert a.status("u1")["phase"] == "Running"
    assert reasons(a, "u1") == ["ContainerCreating", "running"]
    await a.events.drain()
    got = [(t, r) for t, r, _ in events_of(a.kube)]
    assert got[:2] == [("Normal", "Pulling"), ("Normal", "Pulled")]
    await a.loops.stop()


@aio
async def test_err_image_pull_then_back_off_then_runs_once_the_credentials_are_there() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock, images=[])
    rt.registry = {APP: CREDS}
    a = await started(clock, rt)
    a.send(Op.ADD, mkpod("p", "u1", image=APP, policy="Never"))
    pulls_at = []
    for t in range(40):
        n = len(rt.pulls)
        await a.run_for(1)
        if len(rt.pulls) > n:
            pulls_at.append(t)
    # the first pull at once; then 10 s and 20 s after the failures (+ a sync's lag)
    assert len(pulls_at) == 3 and pulls_at[0] == 0
    assert 10 <= pulls_at[1] <= 12 and 30 <= pulls_at[2] <= 34
    assert reasons(a, "u1")[:4] == ["ContainerCreating", "ErrImagePull", "ImagePullBackOff",
                                    "ErrImagePull"]
    assert a.status("u1")["phase"] == "Pending"
    warnings = [w["message"] for w in a.warnings()]
    assert "Error: ErrImagePull" in warnings and "Error: ImagePullBackOff" in warnings
    # the same pod's account gets the secret: the next pull uses it
    a.kube.put(SECRETS, docker_secret("regcred"))
    pod = a.kube.obj(PODS, "p", "ns")
    a.kube.put(SERVICE_ACCOUNTS, {"metadata": {"name": "default", "namespace": "ns"},
                                  "imagePullSecrets": [{"name": "regcred"}]})
    pod["spec"]["serviceAccountName"] = "default"
    a.send(Op.UPDATE, pod)
    await a.run_for(45)
    assert a.status("u1")["phase"] == "Running"
    assert rt.pulls[-1] == (APP, CREDS)
    await a.loops.stop()


@aio
async def test_a_slow_pull_holds_up_neither_other_pods_nor_its_own_deletion() -> None:
    a = await loop_rig()
    a.rt.pull_delay = 600
    slow = mkpod("slow", "u1", image=APP)
    a.send(Op.ADD, slow)
    await a.run_for(2)
    a.send(Op.ADD, mkpod("fast", "u2"))
    await a.run_for(3)
    assert a.status("u2")["phase"] == "Running"
    assert a.rt.pulling == 1
    a.send(Op.REMOVE, slow)
    await a.run_for(3)
    assert "u1" not in a.loop.workers
    assert not [s for s in a.rt.sandboxes.values() if s.pod_uid == "u1"]
    await a.loops.stop()


@aio
async def test_always_pulls_again_for_a_restart_without_a_crash_back_off() -> None:
    a = await loop_rig()
    a.send(Op.ADD, mkpod("p", "u1", containers=[{"name": "c", "image": APP,
                                                  "imagePullPolicy": "Always"}]))
    await a.run_for(3)
    first = a.rt.find("u1", "c")
    assert len(a.rt.pulls) == 1 and first[-1].state == "RUNNING"
    a.rt.exit_container(first[-1].id, 1)
    await a.run_for(4)  # the first restart is immediate, its pull too
    assert len(a.rt.pulls) == 2
    assert a.rt.find("u1", "c")[-1].attempt == 1
    assert a.rt.find("u1", "c")[-1].state == "RUNNING"
    await a.loops.stop()


@aio
async def test_never_waits_until_the_image_is_imported() -> None:
    a = await loop_rig()
    never = mkpod("never", "u1", containers=[{"name": "c", "image": "localhost/missing:1",
                                              "imagePullPolicy": "Never"}])
    a.send(Op.ADD, never, mkpod("ok", "u3"))
    await a.run_for(3)
    w = a.cstatus("u1")["state"]["waiting"]
    assert (w["reason"], w["message"]) == (
        "ErrImageNeverPull",
        'Container image "localhost/missing:1" is not present with pull policy of Never')
    assert a.status("u3")["phase"] == "Running" and a.rt.pulls == []
    assert a.rt.images is not None
    a.rt.images.add("localhost/missing:1")  # imported by hand
    await a.run_for(12)
    assert a.status("u1")["phase"] == "Running"
    await a.loops.stop()
