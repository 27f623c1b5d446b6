"""Image pulls end to end: a nodepulse agent (node credentials) on containerd pulls from
the loopback registry fixture (TLS with its own CA, basic auth) what its pods need.

The image is pushed by crane under a name that exists only in the registry, so a pod
that runs it ran what the agent pulled. Credentials come from pull Secrets the agent
reads under the Node authorizer: named by the pod, or by its service account.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.namespaces import create_namespace
from e2e.harness.ports import free_port
from e2e.harness.waits import eventually, node_registered
from nodepulse_dev import Cluster, images
from nodepulse_dev.containerd import Containerd, start_containerd
from nodepulse_dev.processes import stop_process
from nodepulse_dev.registry import Registry, docker_config

AGENT = Path(sys.executable).parent / "nodepulse-agent"
NS = "image-pulls"


@dataclass
class Node:
    name: str
    core: client.CoreV1Api
    ctd: Containerd
    image: str        # only in the registry
    log: Path

    def pod(self, name: str, image: str | None = None, policy: str = "IfNotPresent",
            **spec: Any) -> client.V1Pod:
        body = {"metadata": {"name": name, "namespace": NS},
                "spec": {"nodeName": self.name, "hostNetwork": True,
                         "automountServiceAccountToken": False,
                         "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "c", "image": image or self.image,
                                         "imagePullPolicy": policy,
                                         "command": ["sleep", "3600"]}], **spec}}
        return self.core.create_namespaced_pod(NS, body)

    def state(self, name: str) -> tuple[str, str, str]:
        """(phase, the container's state or waiting reason, its message)."""
        p = self.core.read_namespaced_pod(name, NS)
        for cs in p.status.container_statuses or []:
            if cs.state.running:
                return p.status.phase, "running", ""
            if cs.state.waiting:
                return p.status.phase, cs.state.waiting.reason or "", \
                    cs.state.waiting.message or ""
        return p.status.phase, "", ""

    def events(self, pod: str) -> list[tuple[str, str, str]]:
        items = self.core.list_namespaced_event(
            NS, field_selector=f"involvedObject.name={pod}").items
        return [(e.type, e.reason, e.message) for e in items]

    def image_present(self, image: str) -> bool:
        from nodeagent.runtime.cri.gen import api_pb2 as pb
        from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
        with self.ctd.channel() as ch:
            r = pb_grpc.ImageServiceStub(ch).ImageStatus(
                pb.ImageStatusRequest(image=pb.ImageSpec(image=image)), timeout=10)
        return r.HasField("image")


def pull_secret(name: str, host: str, user: str, password: str) -> dict[str, Any]:
    config = json.dumps(docker_config(host, user, password)).encode()
    return {"metadata": {"name": name, "namespace": NS},
            "type": "kubernetes.io/dockerconfigjson",
            "data": {".dockerconfigjson": base64.b64encode(config).decode()}}


@pytest.fixture(scope="module")
def node(cluster: Cluster, registry: Registry, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Node]:
    name = "pulls-ctd"
    root = tmp_path_factory.mktemp(name)
    kubeconfig = cluster.node_kubeconfig(name)
    image = f"{registry.host}/e2e/pulls/busybox:1"
    registry.push(images.build_busybox_tar(), "e2e/pulls/busybox:1")
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    ctd = start_containerd(cni=False)
    ctd.trust_registry(registry.host, registry.ca)
    log = open(root / "agent.log", "ab")  # noqa: SIM115 - closed below
    proc = None
    try:
        proc = subprocess.Popen(
            [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
             f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
             *ctd.agent_flags],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        create_namespace(core, NS)
        node_registered(core, name, lambda: proc is not None and proc.poll() is None)
        user, password = registry.auth
        core.create_namespaced_secret(NS, pull_secret("regcred", registry.host, user,
                                                      password))
        core.create_namespaced_secret(NS, pull_secret("wrongcred", registry.host, user,
                                                      "not-the-password"))
        yield Node(name, core, ctd, image, root / "agent.log")
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespace(NS)
        with contextlib.suppress(AssertionError):
            eventually(lambda: not core.list_namespaced_pod(NS).items, "pods gone", 60)
        if proc is not None:
            stop_process(proc)
        ctd.stop()
        log.close()
        with contextlib.suppress(ApiException):
            core.delete_node(name)
        admin.close()


def reasons_until(n: Node, pods: list[str], want: str,
                  timeout: float = 60) -> dict[str, list[str]]:
    """The waiting reasons (or "running") each pod's container shows, in order, until
    every pod shows `want`. The pods are watched together: pods made at the same time
    go through their states at the same time (CI at e10247c: the second pod of two,
    looked at only after the first reached ImagePullBackOff, was past ErrImagePull)."""
    seen: dict[str, list[str]] = {pod: [] for pod in pods}

    def look() -> bool:
        for pod, reasons in seen.items():
            _, reason, _ = n.state(pod)
            if reason and (not reasons or reasons[-1] != reason):
                reasons.append(reason)
        return all(reasons and reasons[-1] == want for reasons in seen.values())
    eventually(look, f"pods {pods} {want} (seen {seen})", timeout, every=0.2)
    return seen


def events_with(n: Node, pod: str, reasons: set[str]) -> list[tuple[str, str, str]] | None:
    got = n.events(pod)
    return got if reasons <= {e[1] for e in got} else None


def test_without_or_with_a_wrong_secret_err_image_pull_then_back_off(node: Node) -> None:
    n = node
    n.pod("no-secret", policy="Always")
    n.pod("wrong-secret", policy="Always", imagePullSecrets=[{"name": "wrongcred"}])
    seen = reasons_until(n, ["no-secret", "wrong-secret"], "ImagePullBackOff")
    for pod in ("no-secret", "wrong-secret"):
        assert "ErrImagePull" in seen[pod] and "running" not in seen[pod], seen
        phase, _, message = n.state(pod)
        assert phase == "Pending"
        assert message.startswith(f'Back-off pulling image "{n.image}": ErrImagePull: ')
        assert "401 Unauthorized" in message
        got = eventually(lambda: events_with(n, pod, {"Pulling", "Failed", "BackOff"}),  # noqa: B023 (called at once)
                         f"{pod}'s events")
        assert ("Normal", "Pulling", f'Pulling image "{n.image}"') in got
        assert ("Normal", "BackOff", f'Back-off pulling image "{n.image}"') in got
        assert any(t == "Warning" and r == "Failed" and
                   m.startswith(f'Failed to pull image "{n.image}": ') and "401" in m
                   for t, r, m in got), got
        assert ("Warning", "Failed", "Error: ErrImagePull") in got
        assert ("Warning", "Failed", "Error: ImagePullBackOff") in got
    assert not n.image_present(n.image)


def test_with_the_secret_in_the_pod_it_pulls_and_runs(node: Node) -> None:
    n = node
    n.pod("with-secret", imagePullSecrets=[{"name": "regcred"}])
    eventually(lambda: n.state("with-secret")[:2] == ("Running", "running"),
               "the pod running", 90)
    got = n.events("with-secret")
    assert ("Normal", "Pulling", f'Pulling image "{n.image}"') in got
    pulled = [m for _, r, m in got if r == "Pulled"]
    assert len(pulled) == 1 and pulled[0].startswith(f'Successfully pulled image "{n.image}" in ')
    assert "Image size: " in pulled[0] and not pulled[0].endswith("Image size: 0 bytes.")
    assert n.image_present(n.image)


def test_if_not_present_does_not_pull_again(node: Node) -> None:
    n = node
    eventually(lambda: n.image_present(n.image), "the image pulled by the test before")
    n.pod("present")  # no secret: a pull would be refused
    eventually(lambda: n.state("present")[:2] == ("Running", "running"), "the pod running")
    got = n.events("present")
    assert ("Normal", "Pulled", f'Container image "{n.image}" already present on machine') \
        in got
    assert not [e for e in got if e[1] == "Pulling"]


def test_the_service_accounts_secret_is_used(node: Node) -> None:
    n = node
    n.core.create_namespaced_service_account(NS, {
        "metadata": {"name": "puller", "namespace": NS},
        "imagePullSecrets": [{"name": "regcred"}]})
    # admission copies the account's secrets into a pod that names none; a pod naming
    # its own (here a wrong one) keeps them, and the agent adds the account's
    n.pod("by-account", policy="Always", serviceAccountName="puller")
    n.pod("own-and-account", policy="Always", serviceAccountName="puller",
          imagePullSecrets=[{"name": "wrongcred"}])
    assert [s.name for s in n.core.read_namespaced_pod("own-and-account", NS)
            .spec.image_pull_secrets] == ["wrongcred"]
    for pod in ("by-account", "own-and-account"):
        eventually(lambda: n.state(pod)[:2] == ("Running", "running"),  # noqa: B023
                   f"{pod} running", 90)
        eventually(lambda: [e for e in n.events(pod)  # noqa: B023
                            if e[1] == "Pulled" and "Successfully" in e[2]],
                   f"{pod}'s Pulled Event")


def test_never_with_a_missing_image(node: Node) -> None:
    n = node
    missing = n.image.rpartition(":")[0] + ":never-pushed"  # the tag, not the port's ":1"
    n.pod("never", image=missing, policy="Never")
    seen = reasons_until(n, ["never"], "ErrImageNeverPull")["never"]
    assert "running" not in seen
    assert n.state("never")[2] == (f'Container image "{missing}" is not present with pull '
                                   "policy of Never")
    got = eventually(lambda: [e for e in n.events("never") if e[1] == "ErrImageNeverPull"],
                     "the ErrImageNeverPull event")
    assert got[0][0] == "Warning"
