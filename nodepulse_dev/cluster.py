"""A real Kubernetes control plane on loopback, or an existing cluster's kubeconfig."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from nodeagent.api.client import new_api_client
from nodepulse_dev import build, pki
from nodepulse_dev.ports import free_port

SERVICE_CIDR = "10.96.0.0/16"
KUBELET_CLIENT = "kube-apiserver-kubelet-client"
FRONT_PROXY_CLIENT = "front-proxy-client"
# nodes are reached at their InternalIP (e2e agents say --node-ip=127.0.0.1)
KUBELET_ADDRESS_TYPES = "InternalIP,Hostname,InternalDNS,ExternalDNS,ExternalIP"
SERVICE_IP = "10.96.0.1"
# By default the operator takes the node lifecycle controller's role (conditions,
# taints) in exclusive mode, so the controller manager must not fight it. Taint-based
# eviction stays on: it is a separate controller and carries out the NoExecute taints.
CONTROLLERS = "*,-node-lifecycle-controller"
# The second configuration (LocalCluster(node_grace=...)) runs every default controller,
# the node-lifecycle one with a short grace, for the operator's coexist mode.
ALL_CONTROLLERS = "*"
# The HorizontalPodAutoscaler acts within seconds here (defaults: every 15 s, and 5 min
# of stabilization before a scale-down), so trying one, or testing one on virtual nodes
# whose pods say what they use, takes a minute or two.
HPA_TIMING = ["--horizontal-pod-autoscaler-sync-period=5s",
              "--horizontal-pod-autoscaler-downscale-stabilization=20s"]
# The API server's metrics count requests, not who made them. Its audit log names the
# user, so tests can tell a node agent's requests from the scheduler's or the controller
# manager's. Only LISTs of pods and nodes and writes to pods are logged: not the Lease
# and Node status traffic the heartbeat benchmarks measure.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "verbs": ["list"],
               "resources": [{"group": "", "resources": ["pods", "nodes"]}]},
              {"level": "Metadata", "verbs": ["create", "update", "patch", "delete"],
               "resources": [{"group": "", "resources": ["pods", "pods/status"]}]},
              {"level": "None"}]}
# With the node-lifecycle controller on, every write to a Node is logged too, with the
# Node as it was written (RequestResponse): who changed which taint or condition when.
NODE_WRITES_RULE = {"level": "RequestResponse",
                    "verbs": ["create", "update", "patch", "delete"],
                    "resources": [{"group": "", "resources": ["nodes", "nodes/status"]}]}


class PortTaken(RuntimeError):
    """A process of the control plane could not bind its port."""


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path | bytes,
                     key: Path | bytes, user: str) -> Path:
    def b64(x: Path | bytes) -> str:
        return base64.b64encode(x.read_bytes() if isinstance(x, Path) else x).decode()

    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": user,
           "clusters": [{"name": "nodepulse", "cluster": {
               "server": server, "certificate-authority-data": b64(ca)}}],
           "users": [{"name": user, "user": {"client-certificate-data": b64(cert),
                                             "client-key-data": b64(key)}}],
           "contexts": [{"name": user, "context": {"cluster": "nodepulse", "user": user}}]}
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    return path


def approve_csr(certs: client.CertificatesV1Api, name: str) -> None:
    """Approve a CertificateSigningRequest as an admin would."""
    approved = client.V1CertificateSigningRequestCondition(
        type="Approved", status="True", reason="NodepulseE2E", message="approved by e2e")
    for _ in range(10):  # the controller manager may approve or sign it meanwhile
        body = certs.read_certificate_signing_request(name)
        conditions = body.status.conditions or []
        if any(c.type == "Approved" for c in conditions):
            return
        body.status.conditions = [*conditions, approved]
        try:
            certs.replace_certificate_signing_request_approval(name, body)
            return
        except client.ApiException as e:
            if e.status != 409:
                raise


class Cluster:
    """A cluster reached through an admin kubeconfig. What tests rely on is here;
    LocalCluster adds the control over processes that only a local cluster allows."""

    def __init__(self, kubeconfig: Path, workdir: Path) -> None:
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.log_dir = workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def server(self) -> str:
        cfg = yaml.safe_load(self.kubeconfig.read_text())
        ctx = next(c for c in cfg["contexts"] if c["name"] == cfg["current-context"])
        return str(next(c for c in cfg["clusters"]
                        if c["name"] == ctx["context"]["cluster"])["cluster"]["server"])

    def api_client(self) -> client.ApiClient:
        return new_api_client(self.kubeconfig, component="e2e")

    def binary(self, name: str) -> Path:
        return build.ensure([name], log=lambda _: None)[name]

    def apiserver_metrics(self) -> str:
        with self.api_client() as api:
            method, url, headers, body, post = api.param_serialize(
                "GET", "/metrics", auth_settings=["BearerToken"])
            resp = api.call_api(method, url, headers, body, post, _request_timeout=30)
            resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET /metrics of the API server: HTTP {resp.status}")
            return str(resp.data.decode())

    def etcd_metrics(self) -> str:
        raise RuntimeError(f"etcd metrics are not reachable for the cluster behind "
                           f"{self.kubeconfig} (only the local control plane exposes them)")

    def node_kubeconfig(self, name: str) -> Path:
        """Credentials of the node `name` (CN system:node:<name>, O system:nodes), got
        from the cluster's kubelet client signer through a CertificateSigningRequest."""
        path = self.workdir / f"node-{name}.kubeconfig"
        if path.exists():
            return path
        csr, key = pki.csr_pem(f"system:node:{name}", ("system:nodes",))
        certs = client.CertificatesV1Api(self.api_client())
        csr_name = f"nodepulse-e2e-{name}-{int(time.time())}"
        certs.create_certificate_signing_request(client.V1CertificateSigningRequest(
            metadata=client.V1ObjectMeta(name=csr_name),
            spec=client.V1CertificateSigningRequestSpec(
                request=base64.b64encode(csr).decode(),
                signer_name="kubernetes.io/kube-apiserver-client-kubelet",
                usages=["digital signature", "client auth"])))
        approve_csr(certs, csr_name)  # its approver grants node client certs on its own too
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            cert = certs.read_certificate_signing_request(csr_name).status.certificate
            if cert:
                ca = self.workdir / "cluster-ca.crt"
                cfg = yaml.safe_load(self.kubeconfig.read_text())
                ca.write_bytes(base64.b64decode(cfg["clusters"][0]["cluster"]
                                                ["certificate-authority-data"]))
                return write_kubeconfig(path, self.server, ca, base64.b64decode(cert), key,
                                        f"system:node:{name}")
            time.sleep(0.5)
        raise TimeoutError(f"CertificateSigningRequest {csr_name} was approved but not "
                           "signed within 60 s (is the cluster's signer running?)")

    def node_serving_cert(self, name: str, addresses: tuple[str, ...] = ("127.0.0.1",)
                          ) -> tuple[Path, Path]:
        """(certificate, key) files for the node's kubelet API, from the cluster's
        kubelet-serving signer through an approved CertificateSigningRequest."""
        crt, key_path = self.workdir / f"node-{name}-serving.crt", \
            self.workdir / f"node-{name}-serving.key"
        if crt.exists():
            return crt, key_path
        csr, key = pki.csr_pem(f"system:node:{name}", ("system:nodes",), names=(*addresses, name))
        cert = self._signed(csr, f"nodepulse-e2e-serving-{name}", "kubernetes.io/kubelet-serving",
                            ["digital signature", "server auth"])
        crt.write_bytes(cert)
        key_path.write_bytes(key)
        key_path.chmod(0o600)
        return crt, key_path

    def ca_file(self) -> Path:
        """The cluster CA (what nodes' serving certificates chain to)."""
        ca = self.workdir / "cluster-ca.crt"
        cfg = yaml.safe_load(self.kubeconfig.read_text())
        ca.write_bytes(base64.b64decode(cfg["clusters"][0]["cluster"]
                                        ["certificate-authority-data"]))
        return ca

    def _signed(self, csr: bytes, prefix: str, signer: str, usages: list[str]) -> bytes:
        """Create, approve and wait for a CertificateSigningRequest; its certificate."""
        certs = client.CertificatesV1Api(self.api_client())
        csr_name = f"{prefix}-{int(time.time())}"
        certs.create_certificate_signing_request(client.V1CertificateSigningRequest(
            metadata=client.V1ObjectMeta(name=csr_name),
            spec=client.V1CertificateSigningRequestSpec(
                request=base64.b64encode(csr).decode(), signer_name=signer, usages=usages)))
        approve_csr(certs, csr_name)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            cert = certs.read_certificate_signing_request(csr_name).status.certificate
            if cert:
                return base64.b64decode(cert)
            time.sleep(0.5)
        raise TimeoutError(f"CertificateSigningRequest {csr_name} was approved but not "
                           "signed within 60 s (is the cluster's signer running?)")

    def restart_apiserver(self) -> None:
        raise RuntimeError("restarting the API server needs the local control plane")

    # ---- fault injection: only a local control plane lets tests stop its processes
    def _local_only(self, what: str) -> RuntimeError:
        return RuntimeError(f"{what} needs the local control plane (the cluster behind "
                            f"{self.kubeconfig} is not ours to stop or compact)")

    def stop_apiserver(self) -> None:
        raise self._local_only("stopping the API server")

    def start_apiserver(self) -> None:
        raise self._local_only("starting the API server")

    def kill_apiserver(self) -> None:
        raise self._local_only("killing the API server")

    def pause_apiserver(self) -> None:
        raise self._local_only("pausing the API server")

    def resume_apiserver(self) -> None:
        raise self._local_only("resuming the API server")

    def stop_etcd(self) -> None:
        raise self._local_only("stopping etcd")

    def start_etcd(self, wait_apiserver: bool = True) -> None:
        raise self._local_only("starting etcd")

    def ensure_running(self) -> None:
        raise self._local_only("restarting stopped control-plane processes")

    def etcd_revision(self) -> int:
        raise self._local_only("reading etcd's revision")

    def compact_etcd(self, revision: int) -> None:
        raise self._local_only("compacting etcd")

    def audit_events(self) -> list[dict[str, Any]]:
        raise RuntimeError(f"the audit log of the cluster behind {self.kubeconfig} is not "
                           "readable here (only the local control plane writes one)")

    def component_logs(self) -> dict[str, Path]:
        return {p.stem: p for p in sorted(self.log_dir.glob("*.log"))}

    def node_lifecycle_args(self) -> list[str]:
        """The operator's flags for this cluster's controller manager: exclusive when
        its node-lifecycle controller is off, else coexist with its grace period. An
        existing cluster says which in NODEPULSE_E2E_NODE_LIFECYCLE (exclusive, as
        e2e/kind/kind-config.yaml sets it up, or coexist) and, for coexist,
        NODEPULSE_E2E_NODE_GRACE (seconds; default the controller manager's)."""
        mode = os.environ.get("NODEPULSE_E2E_NODE_LIFECYCLE", "exclusive")
        args = [f"--node-lifecycle={mode}"]
        grace = os.environ.get("NODEPULSE_E2E_NODE_GRACE")
        if mode == "coexist" and grace:
            args.append(f"--node-monitor-grace-period={grace}s")
        return args


class LocalCluster(Cluster):
    """etcd, kube-apiserver, kube-scheduler and kube-controller-manager on loopback,
    with their own PKI and state under `workdir`.

    `node_grace`: None (the default configuration) runs the controller manager without
    its node-lifecycle controller, for the operator's exclusive mode. Seconds: the
    second configuration, for coexist mode: that controller runs, with this
    --node-monitor-grace-period, and the audit log also has every Node write (unless
    `audit_node_writes` is False: benchmarks, where the log would cost the API server)."""

    ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")

    def __init__(self, workdir: Path | None = None, *, node_grace: float | None = None,
                 audit_node_writes: bool = True) -> None:
        workdir = workdir or Path(tempfile.mkdtemp(prefix="nodepulse-cluster-"))
        super().__init__(workdir / "admin.kubeconfig", workdir)
        self.pki_dir = workdir / "pki"
        self.state_file = workdir / "state.json"
        self.pids: dict[str, int] = {}
        self.ports: dict[str, int] = {}
        self._args: dict[str, list[str]] = {}
        self.node_grace = node_grace
        self.audit_node_writes = audit_node_writes
        if self.state_file.exists():  # a cluster started by an earlier process
            state = json.loads(self.state_file.read_text())
            self.pids, self.ports, self._args = state["pids"], state["ports"], state["args"]
            self.node_grace = state.get("node_grace")

    # ---- lifecycle
    def up(self, log=print) -> LocalCluster:
        bins = build.ensure(list(self.ORDER), log=log)
        started = time.monotonic()
        for attempt in range(3):
            self.ports = {"etcd": free_port(), "etcd-peer": free_port(),
                          "kube-apiserver": free_port()}
            try:
                self._start_all(bins)
                break
            except BaseException as e:
                self.down()  # leave nothing running behind a failed start
                if not isinstance(e, PortTaken) or attempt == 2:
                    raise
                # a free port was taken (by another program's connection, say) before
                # it was bound: start again on new ports, with a fresh etcd
                log(f"{e.args[0].split(' exited')[0]}: address already in use; starting "
                    "again on other ports")
                shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
        log(f"control plane up in {time.monotonic() - started:.1f} s: {self.server}")
        return self

    def _start_all(self, bins: dict[str, Path]) -> None:
        self._pki()
        self._start("etcd", self._etcd_args(bins["etcd"]))
        self._wait(f"http://127.0.0.1:{self.ports['etcd']}/health", "etcd")
        self._start("kube-apiserver", self._apiserver_args(bins["kube-apiserver"]))
        self._wait(f"{self.server}/readyz", "kube-apiserver")
        for name in ("kube-controller-manager", "kube-scheduler"):
            self._start(name, [str(bins[name]),
                               f"--kubeconfig={self.workdir / (name + '.kubeconfig')}",
                               "--leader-elect=false", "--secure-port=0", "-v=1",
                               *self._extra_args(name)])
        self._wait_for_service_account()

    def down(self) -> None:
        for name in reversed(self.ORDER):
            self._stop(name)
        self.state_file.unlink(missing_ok=True)

    def remove(self) -> None:
        """Stop everything and delete the state folder."""
        self.down()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def restart_apiserver(self) -> None:
        self._stop("kube-apiserver")
        self._start("kube-apiserver", self._args["kube-apiserver"])
        self._wait(f"{self.server}/readyz", "kube-apiserver")

    # ---- fault injection (e2e/test_faults_control_plane.py)
    def stop_apiserver(self) -> None:
        """Stop kube-apiserver (SIGTERM, by PID); start_apiserver() brings it back on
        the same port and data."""
        self._stop("kube-apiserver")

    def kill_apiserver(self) -> None:
        """SIGKILL kube-apiserver by PID, as a crash does (start_apiserver() brings it
        back); a paused one dies too."""
        pid = self.pids.pop("kube-apiserver", None)
        if pid is not None and _process_runs(pid, self._args["kube-apiserver"][0]):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, self._args["kube-apiserver"][0], 10)
        self._save()

    def pause_apiserver(self) -> None:
        """SIGSTOP kube-apiserver: its connections stay open and nothing answers, as
        when the machine under it stalls; resume_apiserver() sends SIGCONT."""
        os.kill(self.pids["kube-apiserver"], signal.SIGSTOP)

    def resume_apiserver(self) -> None:
        pid = self.pids.get("kube-apiserver")
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def start_apiserver(self) -> None:
        """Start kube-apiserver if it is stopped; returns when /readyz is ok."""
        if not self._running("kube-apiserver"):
            self._start("kube-apiserver", self._args["kube-apiserver"])
        self._wait(f"{self.server}/readyz", "kube-apiserver")

    def stop_etcd(self) -> None:
        """Stop etcd (SIGTERM, by PID); the API server keeps running and fails its
        requests until start_etcd()."""
        self._stop("etcd")

    def start_etcd(self, wait_apiserver: bool = True) -> None:
        """Start etcd if it is stopped (same data and ports); returns when etcd is
        healthy and (unless told not to wait for it) the API server, which reconnects
        by itself, is ready again."""
        if not self._running("etcd"):
            self._start("etcd", self._args["etcd"])
        self._wait(f"http://127.0.0.1:{self.ports['etcd']}/health", "etcd")
        if wait_apiserver and self._running("kube-apiserver"):
            self._wait(f"{self.server}/readyz", "kube-apiserver")

    def ensure_running(self) -> None:
        """Whatever a fault test stopped is started again, and the controller manager acts
        again (tests call it in `finally`: later test modules share this control plane)."""
        self.resume_apiserver()
        self.start_etcd()
        self.start_apiserver()
        # the scheduler's informers may be waiting out back-offs after the outage (or a
        # compaction) and schedule nothing meanwhile: a new one lists at once
        args = self._args["kube-scheduler"]
        self._stop("kube-scheduler")
        self._start("kube-scheduler", args)
        self._wait_for_controller_manager()

    def etcd_revision(self) -> int:
        """etcd's current revision (the header of a range request, through etcd's
        HTTP/JSON gateway)."""
        key = base64.b64encode(b"/registry/nodepulse-e2e-revision").decode()
        header = self._etcd_call("/v3/kv/range", {"key": key, "count_only": True})["header"]
        return int(header["revision"])

    def compact_etcd(self, revision: int) -> None:
        """Compact etcd's history up to `revision` (physically, before returning): a
        watch from an older resourceVersion can no longer be served from etcd."""
        self._etcd_call("/v3/kv/compaction", {"revision": str(revision), "physical": True})

    def _etcd_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.ports['etcd']}{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"etcd {path}: HTTP {e.code}: "
                               f"{e.read().decode(errors='replace')}") from None

    def _running(self, name: str) -> bool:
        pid = self.pids.get(name)
        return pid is not None and _process_runs(pid, self._args[name][0])

    def node_lifecycle_args(self) -> list[str]:
        if self.node_grace is None:
            return ["--node-lifecycle=exclusive"]
        return ["--node-lifecycle=coexist", f"--node-monitor-grace-period={self.node_grace:g}s"]

    def audit_events(self) -> list[dict[str, Any]]:
        """The API server's audit events so far, each with the user who made the
        request: LISTs of pods and nodes, writes to pods (see AUDIT_POLICY), and with
        the node-lifecycle controller on, every write to a Node with its body."""
        path = self.workdir / "audit.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def etcd_metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['etcd']}/metrics",
                                    timeout=10) as r:
            return str(r.read().decode())

    def node_kubeconfig(self, name: str) -> Path:
        path = self.workdir / f"node-{name}.kubeconfig"
        if not path.exists():
            crt, key = self._ca().issue(f"node-{name}", f"system:node:{name}", ("system:nodes",))
            write_kubeconfig(path, self.server, self._ca().cert_path, crt, key,
                             f"system:node:{name}")
        return path

    def node_serving_cert(self, name: str, addresses: tuple[str, ...] = ("127.0.0.1",)
                          ) -> tuple[Path, Path]:
        crt = self.pki_dir / f"node-{name}-serving.crt"
        if crt.exists():
            return crt, crt.with_suffix(".key")
        return self._ca().issue(f"node-{name}-serving", f"system:node:{name}",
                                ("system:nodes",), server_names=(*addresses, name))

    def ca_file(self) -> Path:
        return self._ca().cert_path

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    # ---- pieces
    def _ca(self) -> pki.CertificateAuthority:
        return pki.CertificateAuthority(self.pki_dir)

    def _pki(self) -> None:
        policy = AUDIT_POLICY
        if self.node_grace is not None and self.audit_node_writes:
            rules = AUDIT_POLICY["rules"]
            policy = {**AUDIT_POLICY, "rules": [NODE_WRITES_RULE, *rules]}
        (self.workdir / "audit-policy.yaml").write_text(yaml.safe_dump(policy))
        ca = self._ca()
        ca.issue("apiserver", "kube-apiserver", server_names=(
            "127.0.0.1", "localhost", SERVICE_IP, "kubernetes", "kubernetes.default",
            "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"))
        pki.service_account_keys(self.pki_dir)
        # the API server's identity toward nodes' kubelet APIs (logs, exec, ...)
        ca.issue("apiserver-kubelet-client", KUBELET_CLIENT, ("system:masters",))
        # the aggregation layer (metrics-server): a CA of its own for the front proxy
        front = pki.CertificateAuthority(self.pki_dir / "front-proxy")
        front.issue("front-proxy-client", FRONT_PROXY_CLIENT)
        for stem, cn, orgs in [("admin", "nodepulse-admin", ("system:masters",)),
                               ("kube-controller-manager", "system:kube-controller-manager", ()),
                               ("kube-scheduler", "system:kube-scheduler", ())]:
            crt, key = ca.issue(stem, cn, orgs)
            write_kubeconfig(self.workdir / f"{stem}.kubeconfig", self.server, ca.cert_path,
                             crt, key, cn)

    def _etcd_args(self, binary: Path) -> list[str]:
        client_url = f"http://127.0.0.1:{self.ports['etcd']}"
        peer_url = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        return [str(binary), "--name=default", f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}", "--log-level=warn",
                # a throwaway test store: fsync buys nothing and costs seconds per test
                "--unsafe-no-fsync"]

    def _apiserver_args(self, binary: Path) -> list[str]:
        p = self.pki_dir
        return [str(binary),
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={self.ports['kube-apiserver']}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={p / 'apiserver.crt'}",
                f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={p / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                # bootstrap tokens (Secrets in kube-system), as kubeadm's clusters take
                # them: agents join with one and get their client certificate by a CSR
                "--enable-bootstrap-token-auth=true",
                "--allow-privileged=true", "--profiling=false", "-v=1",
                f"--audit-policy-file={self.workdir / 'audit-policy.yaml'}",
                f"--audit-log-path={self.workdir / 'audit.log'}", "--audit-log-format=json",
                # The API server listens on loopback only, and Endpoints may not hold a
                # loopback address; nothing here reaches it through the Service IP.
                "--endpoint-reconciler-type=none",
                # nodes' kubelet APIs: the API server's client certificate, and the CA
                # their serving certificates must chain to
                f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
                f"--kubelet-certificate-authority={p / 'ca.crt'}",
                f"--kubelet-preferred-address-types={KUBELET_ADDRESS_TYPES}",
                # the aggregation layer, for metrics-server's metrics.k8s.io
                f"--requestheader-client-ca-file={p / 'front-proxy' / 'ca.crt'}",
                f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={p / 'front-proxy' / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={p / 'front-proxy' / 'front-proxy-client.key'}"]

    def _extra_args(self, name: str) -> list[str]:
        if name != "kube-controller-manager":
            return []
        p = self.pki_dir
        lifecycle = [] if self.node_grace is None else [
            f"--node-monitor-grace-period={self.node_grace:g}s"]
        return [f"--controllers={CONTROLLERS if self.node_grace is None else ALL_CONTROLLERS}",
                *lifecycle, *HPA_TIMING,
                f"--service-account-private-key-file={p / 'sa.key'}",
                f"--root-ca-file={p / 'ca.crt'}",
                f"--cluster-signing-cert-file={p / 'ca.crt'}",
                f"--cluster-signing-key-file={p / 'ca.key'}",
                "--use-service-account-credentials=true"]

    # ---- processes
    def _start(self, name: str, args: list[str]) -> None:
        self._args[name] = args
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.pids[name] = proc.pid
        self._save()

    def _save(self) -> None:
        self.state_file.write_text(json.dumps(
            {"pids": self.pids, "ports": self.ports, "args": self._args,
             "node_grace": self.node_grace}, indent=1))

    def _stop(self, name: str) -> None:
        pid = self.pids.pop(name, None)
        if pid is None:
            return
        binary = self._args[name][0]
        if _process_runs(pid, binary):
            os.kill(pid, signal.SIGTERM)
            # kube-apiserver stops listening at once but then lingers for up to a minute
            # (it keeps no state of its own); etcd and the controllers get a real grace
            if not _wait_gone(pid, binary, 3 if name == "kube-apiserver" else 15):
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, binary, 5)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it when it is our own child
        self._save()

    def _wait(self, url: str, name: str, timeout: float = 60) -> None:
        ctx = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        ctx.load_cert_chain(self.pki_dir / "admin.crt", self.pki_dir / "admin.key")
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if not _process_runs(self.pids[name], self._args[name][0]):
                tail = self._tail(name)
                error = PortTaken if "address already in use" in tail else RuntimeError
                raise error(f"{name} exited while starting; see "
                            f"{self.log_dir / (name + '.log')}:\n{tail}")
            try:
                with urllib.request.urlopen(url, timeout=5,
                                            context=ctx if url.startswith("https") else None) as r:
                    if r.status == 200:
                        return
            except OSError as e:
                last = str(e)
            time.sleep(0.2)
        raise TimeoutError(f"{name} not ready at {url} within {timeout:.0f} s ({last}):\n"
                           f"{self._tail(name)}")

    def _wait_for_service_account(self, namespace: str = "default", timeout: float = 60
                                  ) -> None:
        """The controller manager works once it has made the namespace's default
        ServiceAccount, which pods need before they can be created."""
        core = client.CoreV1Api(self.api_client())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                core.read_namespaced_service_account("default", namespace)
                return
            except client.ApiException as e:
                if e.status != 404:
                    raise
            time.sleep(0.2)
        raise TimeoutError(f"kube-controller-manager made no default ServiceAccount in "
                           f"namespace {namespace} in {timeout:.0f} s:\n"
                           f"{self._tail('kube-controller-manager')}")

    def _wait_for_controller_manager(self, timeout: float = 180) -> None:
        """A new namespace gets its default ServiceAccount. After an outage of the API
        server the controller manager's informers wait out their back-off (up to twice
        30 s after each failed watch; a watch refused while the new API server's
        authorizer warms up counts too), and the next test's namespace would wait with
        them."""
        core = client.CoreV1Api(self.api_client())
        probe = f"nodepulse-e2e-probe-{os.urandom(3).hex()}"
        core.create_namespace({"metadata": {"name": probe}})
        try:
            self._wait_for_service_account(probe, timeout)
        finally:
            with contextlib.suppress(client.ApiException):
                core.delete_namespace(probe)

    def _tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _process_runs(pid: int, binary: str) -> bool:
    """True while `pid` is alive and still runs `binary` (a reused PID is not ours)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # a binary rebuilt while it runs shows as "<path> (deleted)"
    return exe.startswith(os.path.realpath(binary)) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, binary: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not _process_runs(pid, binary):
            return True
        time.sleep(0.05)
    return False
