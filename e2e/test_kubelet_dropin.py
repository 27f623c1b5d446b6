"""nodepulse-agent started as kubeadm starts the kubelet: a bootstrap kubeconfig with a
bootstrap token (a Secret in kube-system, bound to the roles kubeadm binds for
system:bootstrappers), no --kubeconfig yet, and a KubeletConfiguration. The agent asks
for its client certificate through a CSR, which the controller manager's csrapproving
approves and csrsigning signs, writes the certificate and --kubeconfig, registers its
Node as system:node:<name> (under the Node authorizer and NodeRestriction) and renews
its Lease; restarted, it uses what it wrote and asks for nothing."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import os
import secrets
import string
import subprocess
import sys
import uuid
from pathlib import Path

import yaml
from kubernetes import client
from kubernetes.client import ApiException

from e2e.harness.processes import marked
from e2e.harness.waits import eventually, node_registered
from nodepulse_dev import Cluster
from nodepulse_dev.cluster import free_port
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
BOOTSTRAPPERS = "system:bootstrappers:kubeadm:default-node-token"
CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
# the roles kubeadm binds for joining nodes: send node client CSRs, have them approved
# (and a node's own renewals approved)
BINDINGS = {"kubelet-bootstrap": ("system:node-bootstrapper", BOOTSTRAPPERS),
            "node-autoapprove-bootstrap": (
                "system:certificates.k8s.io:certificatesigningrequests:nodeclient",
                BOOTSTRAPPERS),
            "node-autoapprove-certificate-rotation": (
                "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient",
                "system:nodes")}


def token_part(n: int) -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(n))


def bootstrap_token(core: client.CoreV1Api) -> tuple[str, str]:
    """A bootstrap token Secret as `kubeadm token create` makes it: (id, the token)."""
    token_id, secret = token_part(6), token_part(16)
    expires = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    core.create_namespaced_secret("kube-system", client.V1Secret(
        metadata=client.V1ObjectMeta(name=f"bootstrap-token-{token_id}"),
        type="bootstrap.kubernetes.io/token",
        string_data={"token-id": token_id, "token-secret": secret, "expiration": expires,
                     "usage-bootstrap-authentication": "true",
                     "usage-bootstrap-signing": "true", "auth-extra-groups": BOOTSTRAPPERS}))
    return token_id, f"{token_id}.{secret}"


def test_the_agent_joins_from_a_bootstrap_kubeconfig(cluster: Cluster, tmp_path: Path) -> None:
    name = f"dropin-{uuid.uuid4().hex[:6]}"
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    rbac = client.RbacAuthorizationV1Api(admin)
    certs = client.CertificatesV1Api(admin)
    coordination = client.CoordinationV1Api(admin)
    token_id, token = bootstrap_token(core)
    for binding, (role, group) in BINDINGS.items():
        rbac.create_cluster_role_binding(client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=f"{name}:{binding}"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io",
                                      kind="ClusterRole", name=role),
            subjects=[client.RbacV1Subject(kind="Group", name=group,
                                           api_group="rbac.authorization.k8s.io")]))
    etc = tmp_path / "etc-kubernetes"
    etc.mkdir()
    ca = base64.b64encode(cluster.ca_file().read_bytes()).decode()
    boot = etc / "bootstrap-kubelet.conf"
    boot.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "tls-bootstrap",
        "clusters": [{"name": "c", "cluster": {"server": cluster.server,
                                               "certificate-authority-data": ca}}],
        "users": [{"name": "tls-bootstrap-token-user", "user": {"token": token}}],
        "contexts": [{"name": "tls-bootstrap", "context": {
            "cluster": "c", "user": "tls-bootstrap-token-user"}}]}))
    kubeconfig = etc / "kubelet.conf"
    root = tmp_path / "var-lib-kubelet"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True,
                                                                         "cacheTTL": "0s"},
                           "x509": {"clientCAFile": str(cluster.ca_file())}},
        "authorization": {"mode": "Webhook"}, "cgroupDriver": "systemd",
        "cpuManagerPolicy": "static",
        "clusterDNS": ["10.96.0.10"], "clusterDomain": "cluster.local",
        "healthzBindAddress": "127.0.0.1", "healthzPort": free_port(),
        "rotateCertificates": True, "syncFrequency": "0s", "failSwapOn": False,
        "failCgroupV1": False,  # this machine may mount cgroup v1
        "registerWithTaints": [{"key": f"nodepulse.dev/{name}", "effect": "NoSchedule"}]}))
    # the kubelet unit's command line: 10-kubeadm.conf's arguments, then the flags
    # kubeadm writes to kubeadm-flags.env (with a kubeletExtraArgs of kind's)
    argv = [str(AGENT), f"--bootstrap-kubeconfig={boot}", f"--kubeconfig={kubeconfig}",
            f"--config={config}", f"--hostname-override={name}", "--node-ip=127.0.0.1",
            f"--provider-id=nodepulse://e2e/{name}", "--node-labels=",
            "--pod-infra-container-image=registry.k8s.io/pause:3.10",
            f"--root-dir={root}", "--runtime=process"]
    marker = f"dropin-{name}"
    env = {**os.environ, "NP_E2E": marker}
    logs = open(tmp_path / "agent.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=logs, stderr=subprocess.STDOUT, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail() -> str:
        return (tmp_path / "agent.log").read_text(errors="replace")[-3000:]

    def our_csrs() -> list[client.V1CertificateSigningRequest]:
        return [c for c in certs.list_certificate_signing_request().items
                if c.spec.username == f"system:bootstrap:{token_id}"]
    try:
        csr = eventually(lambda: next((c for c in our_csrs() if c.status.certificate), None),
                         "the agent's client CSR approved and signed", 90)
        assert csr.spec.signer_name == CLIENT_SIGNER
        assert sorted(csr.spec.usages) == ["client auth", "digital signature"]
        assert BOOTSTRAPPERS in csr.spec.groups
        assert [c.reason for c in csr.status.conditions if c.type == "Approved"] == \
            ["AutoApproved"]  # csrapproving, through the bootstrappers' binding
        node_registered(core, name, lambda: proc.poll() is None)
        pem = root / "pki" / "kubelet-client-current.pem"
        assert pem.is_symlink() and pem.resolve().name.startswith("kubelet-client-2")
        assert (pem.stat().st_mode & 0o777) == 0o600
        written = yaml.safe_load(kubeconfig.read_text())
        assert written["users"][0]["user"] == {"client-certificate": str(pem),
                                               "client-key": str(pem)}
        assert written["clusters"][0]["cluster"]["server"] == cluster.server
        node = core.read_node(name)
        assert node.spec.provider_id == f"nodepulse://e2e/{name}"
        assert f"nodepulse.dev/{name}" in [t.key for t in node.spec.taints or []]

        def renewed_after(before: dt.datetime | None) -> dt.datetime | None:
            lease = coordination.read_namespaced_lease(name, "kube-node-lease")
            at = lease.spec.renew_time
            return at if at is not None and (before is None or at > before) else None
        first = eventually(lambda: renewed_after(None), f"the Lease of {name}", 60,
                           tolerate=(ApiException,))
        eventually(lambda: renewed_after(first), f"a renewal of {name}'s Lease", 60)
        stop_process(proc)
        assert proc.returncode == 0, log_tail()
        text = log_tail()
        # kubeadm's systemd driver is taken (the process runtime makes no pod cgroups)
        assert "cgroupDriver" not in text
        assert "cpuManagerPolicy: 'static' is not supported, ignored" in text
        assert "--pod-infra-container-image: not supported, ignored" in text

        # restarted: the kubeconfig it wrote is good, nothing is asked for again
        proc = subprocess.Popen(argv, stdout=logs, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        renewed = renewed_after(None)
        eventually(lambda: proc.poll() is None and renewed_after(renewed),
                   f"{name}'s Lease renewed after the restart", 60)
        assert len(our_csrs()) == 1, log_tail()
    finally:
        stop_process(proc)
        logs.close()
        with contextlib.suppress(ApiException):
            core.delete_node(name)
        for c in our_csrs():
            with contextlib.suppress(ApiException):
                certs.delete_certificate_signing_request(c.metadata.name)
        for binding in BINDINGS:
            with contextlib.suppress(ApiException):
                rbac.delete_cluster_role_binding(f"{name}:{binding}")
        with contextlib.suppress(ApiException):
            core.delete_namespaced_secret(f"bootstrap-token-{token_id}", "kube-system")
        admin.close()
    assert marked(marker) == []
