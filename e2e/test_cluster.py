"""The control plane is real: objects round-trip through etcd, and node identities
are held to their own objects by the Node authorizer and NodeRestriction."""

from __future__ import annotations

import datetime as dt
import types
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from e2e.harness.promtext import samples
from nodeagent.api.client import new_api_client
from nodepulse_dev import Cluster


def test_namespace_and_configmap_round_trip(cluster: Cluster) -> None:
    core = client.CoreV1Api(cluster.api_client())
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    try:
        core.create_namespaced_config_map(ns, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="greeting"), data={"hello": "world"}))
        assert core.read_namespaced_config_map("greeting", ns).data == {"hello": "world"}
        assert ns in [n.metadata.name for n in core.list_namespace().items]
    finally:
        core.delete_namespace(ns)


def _lease(name: str) -> client.V1Lease:
    now = dt.datetime.now(dt.UTC)
    return client.V1Lease(
        metadata=client.V1ObjectMeta(name=name, namespace="kube-node-lease"),
        spec=client.V1LeaseSpec(holder_identity=name, lease_duration_seconds=40,
                                renew_time=now, acquire_time=now))


def _node(name: str) -> client.V1Node:
    return client.V1Node(metadata=client.V1ObjectMeta(name=name))


def test_a_node_may_renew_only_its_own_lease_and_node(cluster: Cluster) -> None:
    suffix = uuid.uuid4().hex[:6]
    a, b = f"node-a-{suffix}", f"node-b-{suffix}"
    as_a = new_api_client(cluster.node_kubeconfig(a))
    as_b = new_api_client(cluster.node_kubeconfig(b))

    # each node registers itself and creates its own Lease
    for api, name in ((as_a, a), (as_b, b)):
        client.CoreV1Api(api).create_node(_node(name))
        client.CoordinationV1Api(api).create_namespaced_lease("kube-node-lease", _lease(name))

    leases_a = client.CoordinationV1Api(as_a)
    lease = leases_a.read_namespaced_lease(a, "kube-node-lease")
    lease.spec.renew_time = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    renewed = leases_a.replace_namespaced_lease(a, "kube-node-lease", lease)
    assert renewed.metadata.resource_version != lease.metadata.resource_version

    with pytest.raises(client.ApiException) as refused:
        leases_a.read_namespaced_lease(b, "kube-node-lease")
    assert refused.value.status == 403
    other = client.CoordinationV1Api(cluster.api_client()).read_namespaced_lease(
        b, "kube-node-lease")
    other.spec.holder_identity = a
    with pytest.raises(client.ApiException) as refused:
        leases_a.replace_namespaced_lease(b, "kube-node-lease", other)
    assert refused.value.status == 403

    with pytest.raises(client.ApiException) as refused:
        client.CoreV1Api(as_a).patch_node(b, {"metadata": {"labels": {"stolen-by": a}}})
    assert refused.value.status == 403
    assert "stolen-by" not in (client.CoreV1Api(cluster.api_client()).read_node(b)
                               .metadata.labels or {})

    # a node cannot read Secrets it has no pod for
    with pytest.raises(client.ApiException) as refused:
        client.CoreV1Api(as_a).list_namespaced_secret("default")
    assert refused.value.status == 403


def test_api_server_metrics_count_requests(cluster: Cluster) -> None:
    core = client.CoreV1Api(cluster.api_client())
    before = samples(cluster.apiserver_metrics(), "apiserver_request_total",
                     resource="namespaces", verb="LIST")
    core.list_namespace()
    after = samples(cluster.apiserver_metrics(), "apiserver_request_total",
                    resource="namespaces", verb="LIST")
    assert after >= before + 1


def test_node_identity_through_a_certificate_signing_request(
        cluster: Cluster, tmp_path: Path) -> None:
    """The way node credentials are got from an existing cluster (kind, say)."""
    name = f"csr-node-{uuid.uuid4().hex[:6]}"
    through_csr = Cluster(cluster.kubeconfig, tmp_path)
    as_node = client.CoreV1Api(new_api_client(through_csr.node_kubeconfig(name)))
    as_node.create_node(_node(name))
    admin = client.CoreV1Api(cluster.api_client())
    assert admin.read_node(name).metadata.name == name
    admin.delete_node(name)


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port may come up again once it is closed; free_port skips it."""
    from nodepulse_dev import ports as ports_mod

    offered = iter([20001, 20001, 20002])

    class Offering:
        def __enter__(self) -> Offering:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            pass

    monkeypatch.setattr(ports_mod, "_handed_out", set())
    monkeypatch.setattr(ports_mod, "_rng", types.SimpleNamespace(
        randrange=lambda low, high: next(offered)))
    # only this module's name for socket: other threads keep the real one
    monkeypatch.setattr(ports_mod, "socket", types.SimpleNamespace(socket=Offering))
    assert [ports_mod.free_port(), ports_mod.free_port()] == [20001, 20002]


def test_a_port_taken_before_it_is_bound_starts_again_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port's port can be taken (by another program's outgoing connection, say)
    before kube-apiserver binds it: the control plane then starts on other ports."""
    import socket

    from nodepulse_dev import cluster as cluster_mod
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([cluster_mod.free_port(), cluster_mod.free_port(), taken.getsockname()[1]])
    real = cluster_mod.free_port
    monkeypatch.setattr(cluster_mod, "free_port", lambda: next(ports, None) or real())
    lines: list[str] = []
    (tmp_path / "c").mkdir()
    local = cluster_mod.LocalCluster(tmp_path / "c")
    try:
        local.up(log=lines.append)
        assert local.ports["kube-apiserver"] != taken.getsockname()[1]
        assert any("address already in use" in line for line in lines), lines
        core = client.CoreV1Api(local.api_client())
        assert core.read_namespace("default").metadata.name == "default"
    finally:
        local.remove()
        taken.close()
