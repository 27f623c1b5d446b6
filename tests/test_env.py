"""nodeagent.pods.env: a container's environment, command and args as the kubelet builds them,
with ConfigMaps, Secrets and Services from the in-memory API."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import CONFIG_MAPS, SECRETS, SERVICES
from nodeagent.pods.env import (
    EnvError,
    EnvResolver,
    env_refs,
    expand,
    expand_command,
    field_value,
    format_map,
    go_quote,
    resource_value,
    service_env,
)
from nodeagent.pods.objects import ObjectCache, ServiceCache, ServiceInfo, ServicePort
from tests.conftest import aio, mkpod
from tests.fakekube import FakeKube, api_error

ALLOC = {"cpu": "4", "memory": "8Gi", "ephemeral-storage": "100Gi"}


@pytest.mark.parametrize(("text", "want"), [
    ("$(A)", "a"), ("x$(A)y", "xay"), ("$(MISSING)", "$(MISSING)"), ("$$(A)", "$(A)"),
    ("$$", "$"), ("$", "$"), ("a$", "a$"), ("$x", "$x"), ("$(A", "$(A"), ("$(", "$("),
    ("$()", ""), ("$(A)$(B)", "ab"), ("$$$(A)", "$a"), ("$(A)$", "a$"), ("$(A))", "a)"),
])
def test_expand_as_the_kubelet(text: str, want: str) -> None:
    values = {"A": "a", "B": "b", "": ""}
    assert expand(text, values.get) == want


def test_command_and_args_expand_from_the_final_env() -> None:
    c = {"command": ["sh", "-c", "echo $(X) $$(X) $(NOPE)"], "args": ["$(Y)"]}
    assert expand_command(c, [("X", "1"), ("Y", "2")]) == (
        ["sh", "-c", "echo 1 $(X) $(NOPE)"], ["2"])


def test_service_variables_and_docker_links() -> None:
    svc = ServiceInfo("my-svc", "10.0.0.11", (ServicePort("http", 80, "TCP"),
                                              ServicePort("dns", 53, "UDP")))
    env = service_env([svc])
    assert env == {
        "MY_SVC_SERVICE_HOST": "10.0.0.11", "MY_SVC_SERVICE_PORT": "80",
        "MY_SVC_SERVICE_PORT_HTTP": "80", "MY_SVC_SERVICE_PORT_DNS": "53",
        "MY_SVC_PORT": "tcp://10.0.0.11:80",
        "MY_SVC_PORT_80_TCP": "tcp://10.0.0.11:80", "MY_SVC_PORT_80_TCP_PROTO": "tcp",
        "MY_SVC_PORT_80_TCP_PORT": "80", "MY_SVC_PORT_80_TCP_ADDR": "10.0.0.11",
        "MY_SVC_PORT_53_UDP": "udp://10.0.0.11:53", "MY_SVC_PORT_53_UDP_PROTO": "udp",
        "MY_SVC_PORT_53_UDP_PORT": "53", "MY_SVC_PORT_53_UDP_ADDR": "10.0.0.11"}
    v6 = service_env([ServiceInfo("s", "fd00::1", (ServicePort("", 443, "TCP"),))])
    assert v6["S_PORT"] == "tcp://[fd00::1]:443" and v6["S_SERVICE_HOST"] == "fd00::1"


def test_downward_values() -> None:
    pod = mkpod("p", labels={"b": 'say "hi"\n', "a": "1"}, serviceAccountName="sa")
    pod["metadata"]["annotations"] = {"k": "é"}
    assert field_value(pod, "metadata.labels", {}) == 'a="1"\nb="say \\"hi\\"\\n"'
    assert field_value(pod, "metadata.annotations", {}) == 'k="é"'
    assert field_value(pod, "metadata.labels['a']", {}) == "1"
    assert field_value(pod, "metadata.labels['none']", {}) == ""
    assert field_value(pod, "spec.serviceAccountName", {}) == "sa"
    assert field_value(pod, "status.podIP", {"status.podIP": "10.1.1.1"}) == "10.1.1.1"
    with pytest.raises(EnvError, match="unsupported fieldPath: status.nope"):
        field_value(pod, "status.nope", {})
    assert go_quote("a\tb\x01\u00a0") == '"a\\tb\\x01\\u00a0"'
    assert format_map({}) == ""


def test_resource_values_round_up_and_default_to_allocatable() -> None:
    c = {"name": "c", "resources": {"limits": {"cpu": "250m", "memory": "64Mi"},
                                    "requests": {"cpu": "100m"}}}
    pod = mkpod("p")

    def value(resource: str, divisor: str | None = None, container: Any = c) -> str:
        ref = {"resource": resource, **({"divisor": divisor} if divisor else {})}
        return resource_value(pod, container, ref, ALLOC)
    assert value("limits.cpu") == "1"  # 0.25 cores, rounded up
    assert value("limits.cpu", "1m") == "250"
    assert value("requests.cpu", "1m") == "100"
    assert value("limits.memory") == str(64 * 2**20)
    assert value("limits.memory", "1Mi") == "64"
    assert value("requests.memory") == "0"
    assert value("limits.ephemeral-storage", "1Gi") == "100"  # unset: node allocatable
    assert value("limits.cpu", container={"name": "x"}) == "4"
    with pytest.raises(EnvError, match="unsupported container resource : limits.gpu"):
        value("limits.gpu")


def _cm(name: str, data: dict[str, str], ns: str = "ns", **more: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns}, "data": data, **more}


def _secret(name: str, data: dict[str, str], ns: str = "ns") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


async def _resolver(kube: FakeKube, clock: FakeClock, pod: dict[str, Any]
                    ) -> tuple[EnvResolver, ObjectCache]:
    objects = ObjectCache(kube, clock)
    objects.track(pod["metadata"]["uid"], env_refs(pod))
    return EnvResolver(objects, ServiceCache(kube, clock), lambda node: ALLOC), objects


@aio
async def test_env_from_objects_and_services_in_the_kubelets_order() -> None:
    clock = FakeClock()
    kube = FakeKube()
    kube.put(CONFIG_MAPS, _cm("cfg", {"A": "from-cm", "B": "b"}, binaryData={"BIN": "AA=="}))
    kube.put(SECRETS, _secret("sec", {"PW": "hunter2"}))
    kube.put(SERVICES, {"metadata": {"name": "web", "namespace": "ns"},
                        "spec": {"clusterIP": "10.0.0.5", "ports": [{"port": 8080}]}})
    kube.put(SERVICES, {"metadata": {"name": "kubernetes", "namespace": "default"},
                        "spec": {"clusterIP": "10.0.0.1",
                                 "ports": [{"name": "https", "port": 443}]}})
    kube.put(SERVICES, {"metadata": {"name": "other", "namespace": "elsewhere"},
                        "spec": {"clusterIP": "10.0.0.9", "ports": [{"port": 1}]}})
    kube.put(SERVICES, {"metadata": {"name": "headless", "namespace": "ns"},
                        "spec": {"clusterIP": "None", "ports": [{"port": 1}]}})
    container = {"name": "c", "image": "i", "envFrom": [
        {"configMapRef": {"name": "cfg"}}, {"prefix": "S_", "secretRef": {"name": "sec"}},
        {"configMapRef": {"name": "absent", "optional": True}}], "env": [
        {"name": "A", "value": "mine-$(B)-$(WEB_SERVICE_HOST)-$(NOPE)"},
        {"name": "WEB_SERVICE_PORT", "value": "override"},
        {"name": "KEY", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "B"}}},
        {"name": "GONE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "x",
                                                           "optional": True}}},
        {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "PW"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory",
                                                           "divisor": "1Gi"}}}]}
    pod = mkpod("p", containers=[container])
    resolver, objects = await _resolver(kube, clock, pod)
    env = await resolver.resolve(pod, container, {"spec.nodeName": "n1"})
    got = dict(env)
    assert len(got) == len(env)  # each name once
    assert got["A"] == "mine-b-10.0.0.5-$(NOPE)"
    assert got["B"] == "b" and "BIN" not in got  # env reads data, not binaryData
    assert got["S_PW"] == "hunter2" and got["PW"] == "hunter2" and got["KEY"] == "b"
    assert "GONE" not in got
    assert got["NODE"] == "n1" and got["MEM"] == "8"
    assert got["WEB_SERVICE_PORT"] == "override"  # the container's own wins
    assert got["KUBERNETES_SERVICE_HOST"] == "10.0.0.1"
    assert got["KUBERNETES_SERVICE_PORT_HTTPS"] == "443"
    assert "OTHER_SERVICE_HOST" not in got and "HEADLESS_SERVICE_HOST" not in got
    # the container's own variables first, in order; then the services' sorted
    names = [k for k, _ in env]
    assert names.index("A") < names.index("PW") < names.index("KUBERNETES_PORT")
    # one watch per object, none per namespace: what the Node authorizer allows
    watches = kube.calls_of("watch configmaps") + kube.calls_of("watch secrets")
    assert sorted(c.query["fieldSelector"] for c in watches) == [
        "metadata.name=absent", "metadata.name=cfg", "metadata.name=sec"]
    assert all(c.namespace == "ns" for c in watches)
    # without service links: only the master service's variables
    pod["spec"]["enableServiceLinks"] = False
    got = dict(await resolver.resolve(pod, {"name": "c", "image": "i"}, {}))
    assert "WEB_SERVICE_HOST" not in got and got["KUBERNETES_SERVICE_HOST"] == "10.0.0.1"
    await objects.close()
    await resolver.services.close()  # type: ignore[union-attr]


@aio
async def test_missing_objects_and_keys_say_what_the_kubelet_says() -> None:
    clock = FakeClock()
    kube = FakeKube()
    kube.put(CONFIG_MAPS, _cm("cfg", {"A": "1"}))

    async def env_of(*env: dict[str, Any], env_from: Any = ()) -> list[tuple[str, str]]:
        c = {"name": "c", "image": "i", "env": list(env), "envFrom": list(env_from)}
        pod = mkpod("p", containers=[c])
        resolver, objects = await _resolver(kube, clock, pod)
        try:
            return await resolver.resolve(pod, c, {})
        finally:
            await objects.close()
            await resolver.services.close()  # type: ignore[union-attr]

    with pytest.raises(EnvError, match='configmap "nope" not found'):
        await env_of(env_from=[{"configMapRef": {"name": "nope"}}])
    with pytest.raises(EnvError, match='secret "s" not found'):
        await env_of({"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}})
    with pytest.raises(EnvError, match="couldn't find key B in ConfigMap ns/cfg"):
        await env_of({"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cfg",
                                                                     "key": "B"}}})
    assert await env_of({"name": "X", "valueFrom": {"secretKeyRef": {
        "name": "s", "key": "k", "optional": True}}}) == []
    # a node refused the object (not its pod's): said at once, not after a wait
    kube.fail("list configmaps", api_error(403, message="no relationship found"))
    with pytest.raises(EnvError, match="cannot read configmap \"cfg\": HTTP 403"):
        await env_of(env_from=[{"configMapRef": {"name": "cfg"}}])


@aio
async def test_services_unreadable_refuses_the_container() -> None:
    clock = FakeClock()
    kube = FakeKube()
    kube.fail("list services", api_error(403, message="forbidden"))
    services = ServiceCache(kube, clock)
    resolver = EnvResolver(None, services)
    pod = mkpod("p")
    with pytest.raises(EnvError, match="services have not yet been read at least once"):
        await resolver.resolve(pod, pod["spec"]["containers"][0], {})
    await services.close()


@aio
async def test_a_static_pod_does_not_wait_for_the_services() -> None:
    """As the kubelet: a static pod (a control-plane component, started before the API
    server answers) gets the Services read so far, none before the first list, at once;
    an API pod is still refused while the Services cannot be read."""
    clock = FakeClock()
    kube = FakeKube()
    kube.fail("list services", api_error(403, message="forbidden"))
    services = ServiceCache(kube, clock)
    resolver = EnvResolver(None, services)
    static = mkpod("kube-apiserver-n1")
    static["metadata"]["annotations"] = {"kubernetes.io/config.source": "file"}
    assert await resolver.resolve(static, static["spec"]["containers"][0], {}) == []
    pod = mkpod("p")
    with pytest.raises(EnvError, match="services have not yet been read at least once"):
        await resolver.resolve(pod, pod["spec"]["containers"][0], {})
    await services.close()


@aio
async def test_objects_watch_per_object_and_stop_with_the_last_pod() -> None:
    clock = FakeClock()
    kube = FakeKube()
    kube.put(CONFIG_MAPS, _cm("shared", {"k": "1"}))
    objects = ObjectCache(kube, clock)
    changed: list[set[str]] = []
    objects.on_change = changed.append
    ref = (CONFIG_MAPS, "ns", "shared")
    objects.track("u1", {ref})
    objects.track("u2", {ref})
    assert (await objects.get(ref) or {})["data"] == {"k": "1"}
    assert objects.watched == 1 and kube.count("list configmaps") == 1
    kube.touch(CONFIG_MAPS, "shared", "ns")  # same content: nobody syncs
    await settle()
    assert changed == []
    kube.put(CONFIG_MAPS, _cm("shared", {"k": "2"}))
    await settle()
    assert changed == [{"u1", "u2"}]
    assert (await objects.get(ref) or {})["data"] == {"k": "2"}
    objects.release("u1")
    assert objects.watched == 1
    objects.release("u2")
    await settle()
    assert objects.watched == 0 and kube.watches_open == 0
    await objects.close()
