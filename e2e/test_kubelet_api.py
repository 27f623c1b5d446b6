"""The kubelet API on the real control plane and containerd: `kubectl logs` (-f, --tail,
--previous), `exec` (stdin, and a terminal through a pty), `attach`, `port-forward`
with real bytes, `top pod` through metrics-server, the webhook authentication and
authorization (401, 403, 200), bad requests, memory under a huge log, a slow client,
and 100 follow streams at once.

The agent and its containerd are started by e2e/kubeletagent.py (node credentials, a
serving certificate the API server verifies, the cluster CA as its client CA).
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.kubeletagent import AGENT, TAINT_KEY, Node, admin_cert, kubelet_node
from e2e.harness.namespaces import create_namespace
from e2e.harness.ports import free_port, listening
from e2e.harness.waits import eventually
from nodepulse_dev import Cluster
from nodepulse_dev.devcluster import METRICS_API, metrics_server_argv, register_metrics_api

# some CPU, not a whole core of this shared machine: count a while, rest a while
WORK = ["sh", "-c", "while true; do i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done; "
                    "sleep 0.3; done"]


@pytest.fixture(scope="module")
def node(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    name = f"kapi-{os.getpid() % 10000}"
    with kubelet_node(cluster, tmp_path_factory.mktemp(name), name) as n:
        yield n


# -- logs --

def test_logs_tail_and_follow(node: Node) -> None:
    node.pod("chatty", ["sh", "-c", "i=0; while true; do i=$((i+1)); echo line-$i; "
                                    "echo err-$i >&2; sleep 0.2; done"])
    node.wait_running("chatty")
    eventually(lambda: b"line-3" in node.run_kubectl("logs", "chatty").stdout, "3 lines")
    out = node.run_kubectl("logs", "chatty").stdout.decode()
    assert "line-1\n" in out and "err-1\n" in out, out
    tail = node.run_kubectl("logs", "chatty", "--tail=2").stdout.decode().splitlines()
    assert len(tail) == 2, tail
    stamped = node.run_kubectl("logs", "chatty", "--tail=1", "--timestamps").stdout.decode()
    assert stamped.split(" ", 1)[0].endswith("Z") and "-" in stamped.split(" ", 1)[1], stamped
    # -f: new lines arrive while the container writes them
    proc = subprocess.Popen([node.kubectl, f"--kubeconfig={node.cluster.kubeconfig}", "-n",
                             node.namespace, "logs", "-f", "--tail=1", "chatty"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        seen: list[int] = []
        deadline = time.monotonic() + 30
        while len(seen) < 10 and time.monotonic() < deadline:
            line = proc.stdout.readline().decode().strip()
            if line.startswith("line-"):
                seen.append(int(line.split("-")[1]))
        assert len(seen) == 10 and seen == sorted(seen), seen
    finally:
        proc.kill()
        proc.wait()


def test_logs_previous_after_a_crash(node: Node) -> None:
    node.pod("crasher", ["sh", "-c", "echo run-$(cat /proc/sys/kernel/random/uuid); sleep 2; "
                                     "exit 3"])
    node.wait_running("crasher", restarts=1)
    previous = node.run_kubectl("logs", "crasher", "--previous")
    assert previous.returncode == 0, previous.stderr
    current = node.run_kubectl("logs", "crasher")
    assert previous.stdout.startswith(b"run-") and current.stdout.startswith(b"run-")
    assert previous.stdout != current.stdout, (previous.stdout, current.stdout)


def test_unknown_pod_or_container_is_404_naming_it(node: Node) -> None:
    cert = admin_cert(node.cluster)
    status, body = node.get(f"/containerLogs/{node.namespace}/no-such-pod/main", cert=cert)
    assert status == 404 and b"no-such-pod" in body, (status, body)
    node.pod("quiet", ["sleep", "3600"])
    node.wait_running("quiet")
    status, body = node.get(f"/containerLogs/{node.namespace}/quiet/nope", cert=cert)
    assert status == 404 and b"'nope'" in body, (status, body)
    status, body = node.get(f"/containerLogs/{node.namespace}/quiet/main?tailLines=-1",
                            cert=cert)
    assert status == 422 and b"tailLines" in body, (status, body)


# -- authentication and authorization --

def _token(node: Node, sa: str) -> str:
    node.core.create_namespaced_service_account(node.namespace, {"metadata": {"name": sa}})
    req = node.core.create_namespaced_service_account_token(
        sa, node.namespace, {"spec": {"expirationSeconds": 600}})
    return str(req.status.token)


def test_webhook_authn_and_authz(node: Node) -> None:
    node.pod("authz", ["sh", "-c", "echo secret-words; sleep 3600"])
    node.wait_running("authz")
    path = f"/containerLogs/{node.namespace}/authz/main"
    status, _ = node.get(path)
    assert status == 401
    status, _ = node.get(path, token="not-a-token")
    assert status == 401
    denied = _token(node, "no-rights")
    status, body = node.get(path, token=denied)
    assert status == 403 and b"subresource(s)=[proxy]" in body, (status, body)
    rbac = client.RbacAuthorizationV1Api(node.core.api_client)
    role = f"{node.namespace}-node-proxy"
    rbac.create_cluster_role({"metadata": {"name": role}, "rules": [
        {"apiGroups": [""], "resources": ["nodes/proxy"], "verbs": ["get"]}]})
    try:
        rbac.create_cluster_role_binding({
            "metadata": {"name": role}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                    "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": "proxy-user",
                          "namespace": node.namespace}]})
        allowed = _token(node, "proxy-user")
        status, body = node.get(path, token=allowed)
        assert status == 200 and b"secret-words" in body, (status, body)
        # nodes/proxy is not nodes/stats
        status, _ = node.get("/stats/summary", token=allowed)
        assert status == 403
    finally:
        with contextlib.suppress(ApiException):
            rbac.delete_cluster_role_binding(role)
        with contextlib.suppress(ApiException):
            rbac.delete_cluster_role(role)


# -- exec, attach, port-forward --

def test_exec_with_stdin(node: Node) -> None:
    node.pod("shell", ["sleep", "3600"])
    node.wait_running("shell")
    r = node.run_kubectl("exec", "-i", "shell", "--", "sh", "-c", "read x; echo got:$x",
                         input=b"hello\n")
    assert r.returncode == 0, (r.stderr, node.log_tail())
    assert r.stdout == b"got:hello\n", r.stdout
    r = node.run_kubectl("exec", "shell", "--", "sh", "-c", "exit 7")
    assert r.returncode == 7, r


def test_exec_with_a_terminal(node: Node) -> None:
    node.pod("tty", ["sleep", "3600"])
    node.wait_running("tty")
    pid, fd = pty.fork()
    if pid == 0:  # kubectl with a terminal of its own
        os.execv(node.kubectl, [node.kubectl, f"--kubeconfig={node.cluster.kubeconfig}",
                                "-n", node.namespace, "exec", "-it", "tty", "--", "sh"])
    out = b""
    try:
        os.write(fd, b"echo tty-$((6*7)); tty; exit\n")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)
    assert b"tty-42" in out and b"/dev/pts/" in out, out


def test_attach(node: Node) -> None:
    node.pod("echoer", ["sh", "-c", "while read l; do echo attached:$l; done"], stdin=True)
    node.wait_running("echoer")
    proc = subprocess.Popen([node.kubectl, f"--kubeconfig={node.cluster.kubeconfig}", "-n",
                             node.namespace, "attach", "-i", "echoer"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        got = b""
        deadline = time.monotonic() + 30
        while b"attached:ping" not in got and time.monotonic() < deadline:
            proc.stdin.write(b"ping\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], 1)
            if ready:
                got += os.read(proc.stdout.fileno(), 4096)
        assert b"attached:ping" in got, got
    finally:
        proc.kill()
        proc.wait()


def test_port_forward(node: Node) -> None:
    node.pod("server", ["nc", "-ll", "-p", "8080", "-e", "cat"])  # -ll: keeps listening
    node.wait_running("server")
    local = free_port()
    proc = subprocess.Popen([node.kubectl, f"--kubeconfig={node.cluster.kubeconfig}", "-n",
                             node.namespace, "port-forward", "pod/server", f"{local}:8080"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert b"Forwarding" in first, (first, proc.stderr and proc.stderr.read())
        payload = os.urandom(256 * 1024)
        with socket.create_connection(("127.0.0.1", local), timeout=30) as s:
            got = bytearray()

            def reader() -> None:
                while len(got) < len(payload):
                    chunk = s.recv(65536)
                    if not chunk:
                        return
                    got.extend(chunk)
            t = threading.Thread(target=reader)
            t.start()
            s.sendall(payload)
            t.join(30)
        assert bytes(got) == payload, f"{len(got)} of {len(payload)} bytes came back"
    finally:
        proc.kill()
        proc.wait()


# -- memory, slow clients, many streams --

FLOOD = 6_000_000  # bytes of output: a ~12 MB log file, under the 16Mi rotation size


def test_huge_tail_does_not_grow_memory(node: Node) -> None:
    # (the echo ends the last line: a partial line stays in containerd until it ends)
    node.pod("flood", ["sh", "-c", f"yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c {FLOOD}; "
                                   "echo; sleep 3600"])
    node.wait_running("flood")
    cert = admin_cert(node.cluster)
    path = f"/containerLogs/{node.namespace}/flood/main"
    eventually(lambda: len(node.get(path, cert=cert)[1]) >= FLOOD, "the flood logged")
    _, peak_before, _ = node.rss_and_cpu()
    for _ in range(5):
        status, body = node.get(path + "?tailLines=100000000", cert=cert)
        assert status == 200 and len(body) >= FLOOD
    _, peak_after, _ = node.rss_and_cpu()
    # 5 reads of the whole 12 MB file; one 64 KiB block is held at a time
    assert peak_after - peak_before < 8 * 1024 * 1024, (peak_before, peak_after)


def test_slow_client_does_not_block_others(node: Node) -> None:
    node.pod("fast", ["sh", "-c", f"yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c {FLOOD}; "
                                  "echo; sleep 3600"])
    node.wait_running("fast")
    cert = admin_cert(node.cluster)
    eventually(lambda: len(node.get(f"/containerLogs/{node.namespace}/fast/main", cert=cert)[1])
               > FLOOD, "the flood logged")
    # a follower that never reads: its socket buffers fill and the agent must wait on it
    raw = socket.create_connection(("127.0.0.1", node.port))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck = node.tls(cert).wrap_socket(raw, server_hostname="127.0.0.1")
    stuck.sendall(f"GET /containerLogs/{node.namespace}/fast/main?follow=true HTTP/1.1\r\n"
                  f"Host: x\r\n\r\n".encode())
    try:
        for _ in range(5):
            status, body = node.get("/healthz", cert=cert, timeout=10)
            assert status == 200 and body == b"ok"
            status, body = node.get(f"/containerLogs/{node.namespace}/fast/main?tailLines=3",
                                    cert=cert, timeout=10)
            assert status == 200 and len(body.splitlines()) == 3, body
    finally:
        stuck.close()


def test_hundred_follow_streams(node: Node) -> None:
    node.pod("ticker", ["sh", "-c", "i=0; while true; do i=$((i+1)); echo tick-$i; sleep 0.5; "
                                    "done"])
    node.wait_running("ticker")
    cert = admin_cert(node.cluster)
    path = f"/containerLogs/{node.namespace}/ticker/main?follow=true&tailLines=0"
    ctx = node.tls(cert)
    socks = []
    for _ in range(100):
        s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", node.port), timeout=30),
                            server_hostname="127.0.0.1")
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        socks.append(s)
    try:
        rss0, _, cpu0 = node.rss_and_cpu()
        t0 = time.monotonic()
        got = [b""] * len(socks)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(g.count(b"tick-") >= 10 for g in got):
            for i, s in enumerate(socks):
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError, ssl.SSLWantReadError):
                    got[i] += s.recv(65536)
            time.sleep(0.1)
        rss1, peak, cpu1 = node.rss_and_cpu()
        elapsed = time.monotonic() - t0
        served = sum(1 for g in got if g.count(b"tick-") >= 10)
        print(f"\n100 follow streams: {served} got 10+ lines in {elapsed:.1f} s; agent RSS "
              f"{rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB (peak {peak / 2**20:.1f}), CPU "
              f"{(cpu1 - cpu0) / elapsed * 100:.1f} % of a core while they ran")
        assert served == 100
    finally:
        for s in socks:
            s.close()


def test_metrics_and_stats(node: Node) -> None:
    node.pod("busy", WORK)
    node.wait_running("busy")
    cert = admin_cert(node.cluster)
    status, body = node.get("/metrics/resource", cert=cert)
    assert status == 200
    text = body.decode()
    assert 'container_cpu_usage_seconds_total{container="main",namespace="' in text, text
    assert "node_memory_working_set_bytes " in text and "resource_scrape_error 0" in text
    status, body = node.get("/stats/summary", cert=cert)
    summary = json.loads(body)
    pods = {p["podRef"]["name"]: p for p in summary["pods"]}
    assert summary["node"]["nodeName"] == node.name
    assert pods["busy"]["containers"][0]["cpu"]["usageCoreNanoSeconds"] > 0
    node.core.delete_namespaced_pod("busy", node.namespace)


def test_log_rotation(node: Node) -> None:
    """Past --container-log-max-size (16Mi here) the log is rotated through containerd's
    ReopenContainerLog; the container goes on writing to a fresh file that logs read."""
    node.pod("rotor", ["sh", "-c", "yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c 12000000;"
                                   " while true; do echo after; sleep 0.5; done"])
    pod = node.wait_running("rotor")
    logs = node.root / "logs" / "pods" / f"{node.namespace}_rotor_{pod.metadata.uid}" / "main"
    rotated = eventually(lambda: [p for p in logs.glob("0.log.*") if not p.name.endswith(".tmp")],
                         "the log rotated", 60)
    assert (logs / "0.log").stat().st_size < 16 * 2**20, rotated
    eventually(lambda: node.run_kubectl("logs", "rotor", "--tail=1").stdout == b"after\n",
               "logs read from the new file")


def test_kubectl_top_through_metrics_server(node: Node, tmp_path: Path) -> None:
    """metrics-server (built from its Go module) runs as a process behind the API
    server's aggregation layer, scrapes the agent's /metrics/resource (verifying its
    serving certificate), and `kubectl top pod` shows the pod's usage."""
    if not hasattr(node.cluster, "pki_dir"):
        pytest.skip("runs metrics-server against the local control plane only")
    node.pod("burner", WORK)
    node.wait_running("burner")
    port = free_port()
    argv = metrics_server_argv(node.cluster, port, tmp_path)
    log = open(tmp_path / "metrics-server.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    api = client.ApiregistrationV1Api(node.core.api_client)
    try:
        register_metrics_api(node.core.api_client, port)

        def top() -> str | None:
            r = node.run_kubectl("top", "pod", "burner", "--no-headers")
            out = r.stdout.decode().split()
            return r.stdout.decode() if r.returncode == 0 and out and out[0] == "burner" \
                else None
        try:
            line = eventually(top, "kubectl top pod shows the pod", 120)
        except AssertionError:
            print((tmp_path / "metrics-server.log").read_text(errors="replace")[-4000:])
            raise
        name, cpu, mem = line.split()[:3]
        assert cpu.endswith("m") and int(cpu[:-1]) > 0, line
        assert mem.endswith("Mi"), line
    finally:
        with contextlib.suppress(ApiException):
            node.core.delete_namespaced_pod("burner", node.namespace)
        with contextlib.suppress(ApiException):
            api.delete_api_service(METRICS_API)
        with contextlib.suppress(ApiException):
            node.core.delete_namespaced_service("metrics-server", "kube-system")
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_rotated_serving_certificate_and_process_runtime_logs(
        cluster: Cluster, tmp_path: Path) -> None:
    """--rotate-server-certificates: the agent asks for its serving certificate through a
    CSR (signer kubernetes.io/kubelet-serving); once an admin approves it the agent
    serves it, the API server verifies it, and `kubectl logs` works - here on the process
    runtime, whose raw logs refuse what they cannot answer."""
    from nodepulse_dev.cluster import approve_csr
    name = f"kapi-rot-{os.getpid() % 10000}"
    kubeconfig = cluster.node_kubeconfig(name)
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    certs = client.CertificatesV1Api(admin)
    argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={tmp_path}", "--healthz-bind-address=", "--runtime=process",
            "--node-ip=127.0.0.1", "--port=0", "--rotate-server-certificates",
            f"--client-ca-file={cluster.ca_file()}",
            f"--register-with-taints={TAINT_KEY}={name}:NoSchedule"]
    log = open(tmp_path / "agent.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    n = Node(name, tmp_path, proc, core, name, cluster, str(cluster.binary("kubectl")), None)
    try:
        def csr() -> str | None:
            for c in certs.list_certificate_signing_request().items:
                if c.spec.signer_name == "kubernetes.io/kubelet-serving" and \
                        c.spec.username == f"system:node:{name}":
                    return str(c.metadata.name)
            return None
        csr_name = eventually(csr, "the agent's serving CSR", 60)
        approve_csr(certs, csr_name)

        def verified() -> bool:
            try:
                port = n.port
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s, \
                        n.tls().wrap_socket(s, server_hostname="127.0.0.1"):
                    return True
            except (OSError, ssl.SSLError, AttributeError):
                return False
            except ApiException as e:  # the CSR can come before the Node's registration
                if e.status != 404:
                    raise
                return False
        eventually(verified, "the signed certificate served", 60)
        create_namespace(core, name)
        n.pod("talker", ["sh", "-c", "echo from-a-process; sleep 3600"])
        n.wait_running("talker")
        eventually(lambda: n.run_kubectl("logs", "talker").stdout == b"from-a-process\n",
                   "kubectl logs through the rotated certificate")
        r = n.run_kubectl("logs", "talker", "--timestamps")
        assert r.returncode != 0 and b"process runtime" in r.stderr, r
        # exec beside the process, through its runtime's own streaming server
        r = n.run_kubectl("exec", "-i", "talker", "--", "sh", "-c", "read x; echo got:$x; "
                          "exit 4", input=b"over-spdy\n")
        assert r.stdout == b"got:over-spdy\n" and r.returncode == 4, (r, n.log_tail())
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)
        if proc.poll() is None:
            with contextlib.suppress(AssertionError):
                eventually(lambda: not list((tmp_path / "process" / "containers").glob("*.pid"))
                           or not core.list_namespaced_pod(name).items, "pods gone", 30)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        with contextlib.suppress(ApiException):
            core.delete_node(name)
        admin.close()


def test_virtual_nodes_share_one_server(cluster: Cluster, tmp_path: Path) -> None:
    """One agent process for 3 virtual nodes: one server, listening on the shared port
    and on a port of each node's own, which its Node's daemonEndpoints name; `kubectl
    logs` of a pod on any of them shows what the fake runtime recorded."""
    prefix = f"kapi-vn-{os.getpid() % 10000}"
    names = [f"{prefix}-{i}" for i in range(3)]
    crt, key = cluster.node_serving_cert(prefix)
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    argv = [str(AGENT), f"--kubeconfig={cluster.kubeconfig}", "--virtual-nodes=3",
            f"--node-name-prefix={prefix}", f"--root-dir={tmp_path}",
            "--healthz-bind-address=", "--runtime=fake", "--node-ip=127.0.0.1", "--port=0",
            f"--tls-cert-file={crt}", f"--tls-private-key-file={key}",
            f"--client-ca-file={cluster.ca_file()}"]
    log = open(tmp_path / "agent.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    ns = prefix
    try:
        def ports() -> set[int] | None:
            got = set()
            for n in names:
                found = core.list_node(field_selector=f"metadata.name={n}").items
                ep = found[0].status.daemon_endpoints if found else None
                if not ep or not ep.kubelet_endpoint.port:
                    return None
                got.add(int(ep.kubelet_endpoint.port))
            return got
        own = eventually(ports, "3 virtual nodes advertising their kubelet port", 60)
        assert len(own) == 3
        listened = {p for h, p in listening(proc.pid) if h == "0.0.0.0"}
        assert own < listened and len(listened - own) == 1, (own, listened)
        create_namespace(core, ns)
        core.create_namespaced_pod(ns, {"metadata": {"name": "ghost"}, "spec": {
            "nodeName": names[1], "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "main", "image": "anything:1"}]}})
        kubectl = [str(cluster.binary("kubectl")), f"--kubeconfig={cluster.kubeconfig}",
                   "-n", ns, "logs", "ghost"]
        out = eventually(lambda: (r := subprocess.run(kubectl, capture_output=True)).returncode
                         == 0 and b"fake runtime: container main started" in r.stdout,
                         "kubectl logs of a pod on a virtual node", 60)
        assert out
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespace(ns)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for n in names:
            with contextlib.suppress(ApiException):
                core.delete_node(n)
        admin.close()
