"""The kubelet API under attack: one agent (e2e/kubeletagent.py, on containerd) and one
victim pod, and what a hostile client sends straight to the agent's port: credentials
the agent must not accept, path traversal, huge heads and bodies, slowloris, a
thousand upgrade requests that never finish, malformed SPDY and WebSocket frames on
exec/attach/portForward, port-forwards to what the pod does not own.

Each attack gets a 4xx or a closed connection within a bound, and reads nothing of the
victim. After each, the agent's open fds, client connections and streams go back to
where they were, its memory stays near it, and its Lease goes on being renewed (an
autouse fixture checks that around every test). The agent runs with short idle
timeouts (5 s for connections, 4 s for streams) so the bounds are seconds here.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import datetime as dt
import json
import os
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.kubeletagent import Node, admin_cert, kubelet_node
from e2e.harness.ports import free_port
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodepulse_dev import Cluster
from nodepulse_dev.pki import CertificateAuthority

CONNECTION_IDLE = 5.0  # --connection-idle-timeout
STREAM_IDLE = 4.0      # --streaming-connection-idle-timeout
BOUND = 15.0           # seconds within which the agent must have closed on an attacker
SECRET = "victim-secret-words"


@pytest.fixture(scope="module")
def node(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    if not hasattr(cluster, "pki_dir"):
        pytest.skip("needs the local control plane's certificates")
    name = f"kapi-hostile-{os.getpid() % 10000}"
    with kubelet_node(cluster, tmp_path_factory.mktemp(name), name, [
            f"--connection-idle-timeout={CONNECTION_IDLE:g}s",
            f"--streaming-connection-idle-timeout={STREAM_IDLE:g}s",
            "--node-lease-renew-interval=2s"]) as n:
        n.pod("victim", ["sh", "-c", f"echo {SECRET}; exec nc -ll -p 8080 -e cat"])
        n.wait_running("victim")
        yield n


@dataclass
class Figures:
    fds: int
    rss: int
    connections: float
    streams: float
    tasks: float


def metrics(node: Node) -> str:
    status, body = node.get("/metrics", cert=admin_cert(node.cluster))
    assert status == 200, body
    return body.decode()


def figures(node: Node) -> Figures:
    text = metrics(node)
    return Figures(len(os.listdir(f"/proc/{node.proc.pid}/fd")), node.rss_and_cpu()[0],
                   samples(text, "nodepulse_kubelet_api_connections"),
                   samples(text, "nodepulse_kubelet_api_streams"),
                   samples(text, "nodepulse_asyncio_tasks"))


def renew_time(node: Node) -> dt.datetime:
    lease = client.CoordinationV1Api(node.core.api_client).read_namespaced_lease(
        node.name, "kube-node-lease")
    return lease.spec.renew_time


@pytest.fixture(autouse=True)
def back_to_baseline(node: Node, request: pytest.FixtureRequest) -> Iterator[None]:
    """Around each attack: fds, connections, streams and asyncio tasks return to what
    they were (tasks: within the agent's own coming and going), memory stays within
    32 MiB of it, and the Lease is still renewed."""
    before = figures(node)
    renewed = renew_time(node)
    yield
    assert node.proc.poll() is None, node.log_tail()

    def settled() -> Figures | None:
        now = figures(node)
        # the figures' own /metrics request is one open connection
        ok = now.fds <= before.fds + 2 and now.connections <= max(before.connections, 1) \
            and now.streams == 0 and now.tasks <= before.tasks + 10
        return now if ok else None
    try:
        after = eventually(settled, "the agent's fds, connections and streams back to "
                                    "where they were", 30)
    except AssertionError:
        print(f"before {before}, now {figures(node)}\n{node.log_tail()}")
        raise
    print(f"\n{request.node.name}: fds {before.fds} -> {after.fds}, asyncio tasks "
          f"{before.tasks:.0f} -> {after.tasks:.0f}, RSS {before.rss / 2**20:.1f} -> "
          f"{after.rss / 2**20:.1f} MiB")
    assert after.rss - before.rss < 32 * 2**20, (before, after)
    eventually(lambda: renew_time(node) > renewed, "the Lease renewed after the attack", 15)


# -- plain sockets to the agent's port --

def tls_context(node: Node, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    return node.tls(cert)


def connect(node: Node, cert: tuple[Path, Path] | None = None,
            timeout: float = BOUND) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", node.port), timeout=timeout)
    return tls_context(node, cert).wrap_socket(raw, server_hostname="127.0.0.1")


def read_all(s: socket.socket, limit: int = 1 << 20) -> bytes:
    """What the agent sends until it closes (or `limit` bytes, or the socket's timeout)."""
    got = bytearray()
    with contextlib.suppress(TimeoutError, ConnectionError, ssl.SSLError):
        while len(got) < limit:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return bytes(got)


def status_of(answer: bytes) -> int:
    line = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


def raw_request(node: Node, head: str, cert: tuple[Path, Path] | None = None,
                body: bytes = b"") -> bytes:
    with connect(node, cert) as s:
        s.sendall(head.encode("latin-1") + body)
        return read_all(s)


# -- credentials --

def _sa_token(node: Node, name: str, audiences: list[str] | None = None) -> str:
    with contextlib.suppress(ApiException):
        node.core.create_namespaced_service_account(node.namespace, {"metadata": {"name": name}})
    spec: dict[str, object] = {"expirationSeconds": 600}
    if audiences:
        spec["audiences"] = audiences
    req = node.core.create_namespaced_service_account_token(name, node.namespace,
                                                            {"spec": spec})
    return str(req.status.token)


def _forged_token() -> str:
    """A JWT-shaped token that expired long ago and is signed by no one we know."""
    def part(obj: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")
    return ".".join([part({"alg": "RS256", "kid": "x"}),
                     part({"iss": "https://kubernetes.default.svc", "sub": "system:admin",
                           "exp": 1000000000}), "c2lnbmF0dXJl"])


def test_credentials_the_agent_must_not_accept(node: Node, tmp_path: Path) -> None:
    path = f"/containerLogs/{node.namespace}/victim/main"
    # a token of a ServiceAccount since deleted (what an expired one gets), one for
    # another audience, a forged one
    stale = _sa_token(node, "gone")
    node.core.delete_namespaced_service_account("gone", node.namespace)
    foreign = _sa_token(node, "elsewhere", audiences=["https://not-this-cluster.example"])
    for token in ("", "not-a-token", stale, foreign, _forged_token()):
        status, body = node.get(path, token=token)
        assert status == 401 and SECRET.encode() not in body, (token[:20], status, body)
    # a client certificate from another CA, naming an admin: the handshake is refused
    other = CertificateAuthority(tmp_path / "other-ca")
    forged = other.issue("mallory", "kube-apiserver-kubelet-client", ("system:masters",))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        node.get(path, cert=forged)
    # a node's own certificate: nodes/proxy is not a node's to use (the Node authorizer
    # gives nodes no subresource of nodes), neither another node's pods nor its own
    ca = CertificateAuthority(node.cluster.pki_dir)  # type: ignore[attr-defined]
    for who in (f"{node.name}-other", node.name):
        cert = ca.issue(f"hostile-{who}", f"system:node:{who}", ("system:nodes",))
        for p in (path, f"/exec/{node.namespace}/victim/main?command=id&output=1",
                  f"/portForward/{node.namespace}/victim?port=8080", "/pods",
                  "/stats/summary"):
            status, body = node.get(p, cert=cert)
            assert status == 403 and SECRET.encode() not in body, (who, p, status, body)


# -- paths --

TRAVERSALS = [
    "/containerLogs/{ns}/victim/..%2F..%2F..%2F..%2Fetc%2Fpasswd",
    "/containerLogs/{ns}/victim/../../../../etc/passwd",
    "/containerLogs/{ns}/victim/main/../../../../../etc/passwd",
    "/containerLogs/{ns}/%2e%2e/%2e%2e/etc%2fpasswd",
    "/containerLogs/..%2f..%2f..%2fetc/passwd/x",
    "/containerLogs/{ns}/victim/%2Fetc%2Fpasswd",
    "/containerLogs/{ns}/victim//etc/passwd",
    "/containerLogs/{ns}/victim/main%00.log",
    "/containerLogs/{ns}/victim/main?sinceTime=../../etc/passwd",
    "/logs/", "/logs/../../../etc/passwd", "/logs/%2e%2e/%2e%2e/etc/passwd",
    "/logs/pods/", "//etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/..\\..\\etc\\passwd",
    "/exec/{ns}/victim/../../../main?command=cat&command=/etc/passwd&output=1",
]


def test_path_traversal_reads_nothing_outside_the_container_log(node: Node) -> None:
    cert = admin_cert(node.cluster)
    for template in TRAVERSALS:
        path = template.format(ns=node.namespace)
        answer = raw_request(node, f"GET {path} HTTP/1.1\r\nHost: x\r\n"
                                   "Connection: close\r\n\r\n", cert)
        status = status_of(answer)
        assert 400 <= status < 500 and b"root:x:0:0" not in answer, (path, answer[:300])
    # the log itself is what the container wrote, and nothing else
    status, body = node.get(f"/containerLogs/{node.namespace}/victim/main", cert=cert)
    assert status == 200 and body == f"{SECRET}\n".encode(), body


# -- heads and bodies --

def test_huge_heads_and_bodies(node: Node) -> None:
    cert = admin_cert(node.cluster)
    # one header of 100 KiB; 200 headers; a request line of 100 KiB
    for head in ("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + "a" * 100_000 + "\r\n\r\n",
                 "GET /healthz HTTP/1.1\r\nHost: x\r\n"
                 + "".join(f"X-{i}: {'b' * 100}\r\n" for i in range(200)) + "\r\n",
                 "GET /" + "c" * 100_000 + " HTTP/1.1\r\nHost: x\r\n\r\n"):
        answer = raw_request(node, head, cert)
        assert status_of(answer) in (400, 413, 431) or answer == b"", answer[:200]
    # a body of a GiB announced: answered before it is read, unauthenticated or not
    for who in (None, cert):
        with connect(node, who) as s:
            s.sendall(b"POST /exec/ns/victim/main?command=sh&input=1 HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 1073741824\r\n\r\n" + b"\0" * 2**20)
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = s.recv(4096)
                assert chunk, answer
                answer += chunk
        assert status_of(answer) == (401 if who is None else 404), answer[:200]


# -- slow and silent clients --

def test_slowloris_and_silent_connections_are_closed_within_a_bound(node: Node) -> None:
    """20 clients sending their request head a byte a second, 20 that finish the TLS
    handshake and send nothing, 20 that never start it: all closed by the agent within
    the bound, while others are served."""
    cert = admin_cert(node.cluster)
    slow = [connect(node, cert) for _ in range(20)]
    silent = [connect(node, cert) for _ in range(20)]
    bare = [socket.create_connection(("127.0.0.1", node.port)) for _ in range(20)]
    head = f"GET /containerLogs/{node.namespace}/victim/main HTTP/1.1\r\nHost: x\r\nX-Pad: " \
        + "p" * 60
    closed: dict[int, float] = {}
    start = time.monotonic()
    everyone: list[socket.socket] = [*slow, *silent, *bare]
    for s in everyone:
        s.setblocking(False)
    try:
        i = 0
        while len(closed) < len(everyone) and time.monotonic() - start < BOUND + 5:
            for s in slow:
                if id(s) not in closed and i < len(head):
                    with contextlib.suppress(BlockingIOError, ssl.SSLWantWriteError,
                                             ConnectionError, ssl.SSLError):
                        s.send(head[i].encode())
            i += 1
            served, _ = node.get("/healthz", cert=cert, timeout=5)
            assert served == 200
            deadline = time.monotonic() + 1
            while time.monotonic() < deadline:
                for s in everyone:
                    if id(s) in closed:
                        continue
                    try:
                        data = s.recv(4096)
                    except (BlockingIOError, ssl.SSLWantReadError):
                        continue
                    except (ConnectionError, ssl.SSLError, OSError):
                        data = b""
                    if not data:
                        closed[id(s)] = time.monotonic() - start
                time.sleep(0.1)
    finally:
        for s in everyone:
            s.close()
    assert len(closed) == len(everyone), f"{len(everyone) - len(closed)} still open"
    assert max(closed.values()) < BOUND, sorted(closed.values())
    # the slow ones had sent part of their head, not all of it
    assert i < len(head)


async def _hold_upgrades(node: Node, count: int, cert: tuple[Path, Path] | None,
                         head: bytes) -> list[float | None]:
    """`count` connections at once, each sending `head` and then nothing; how long each
    stayed open (the agent closing it, or BOUND); None for one whose handshake the
    agent cut short (busy past the idle timeout)."""
    ctx = tls_context(node, cert)
    port = node.port
    handshakes = asyncio.Semaphore(100)  # at once; the connections all stay open together
    start = time.monotonic()

    async def one() -> float | None:
        async with handshakes:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
                writer.write(head)
                await writer.drain()
            except (ConnectionError, ssl.SSLError):
                return None
        try:
            with contextlib.suppress(TimeoutError, ConnectionError, ssl.SSLError):
                await asyncio.wait_for(reader.read(), BOUND + 5)
            return time.monotonic() - start
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    return list(await asyncio.gather(*(one() for _ in range(count))))


def test_a_thousand_upgrade_requests_that_never_finish(node: Node) -> None:
    """1000 exec upgrade requests whose head never ends are closed within the bound;
    meanwhile the agent serves others."""
    head = (f"POST /exec/{node.namespace}/victim/main?command=sh&input=1&output=1 HTTP/1.1\r\n"
            "Host: x\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
            "X-Stream-Protocol-Version: v4.channel.k8s.io\r\n").encode()  # no blank line
    cert = admin_cert(node.cluster)
    times = asyncio.run(_hold_upgrades(node, 1000, cert, head))
    held = [t for t in times if t is not None]
    assert len(held) >= 900, f"only {len(held)} of 1000 got through the handshake"
    assert max(held) < BOUND + 5, sorted(held)[-5:]
    status, _ = node.get("/healthz", cert=cert, timeout=10)
    assert status == 200


def _upgrade_head(kind: str, node: Node, websocket: bool = False) -> bytes:
    ns = node.namespace
    path = {"exec": f"/exec/{ns}/victim/main?command=cat&input=1&output=1",
            "attach": f"/attach/{ns}/victim/main?output=1",
            "portForward": f"/portForward/{ns}/victim?port=8080"}[kind]
    if websocket:
        key = base64.b64encode(os.urandom(16)).decode()
        proto = "v4.channel.k8s.io" if kind != "portForward" else "portforward.k8s.io"
        upgrade = (f"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Protocol: {proto}\r\n")
    else:
        proto = "v4.channel.k8s.io" if kind != "portForward" else "portforward.k8s.io"
        upgrade = ("Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
                   f"X-Stream-Protocol-Version: {proto}\r\n")
    method = "GET" if websocket else "POST"
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{upgrade}\r\n".encode()


def test_upgraded_connections_that_never_speak_are_closed(node: Node) -> None:
    """100 exec, attach and port-forward upgrades that get their 101 and then send
    nothing: closed by the streaming idle timeout."""
    cert = admin_cert(node.cluster)
    heads = [_upgrade_head(k, node) for k in ("exec", "attach", "portForward")]
    ctx = tls_context(node, cert)
    socks = []
    for i in range(100):
        s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", node.port), timeout=BOUND),
                            server_hostname="127.0.0.1")
        s.sendall(heads[i % 3])
        socks.append(s)
    start = time.monotonic()
    try:
        answers = [read_all(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 101") for a in answers), \
        {a[:40] for a in answers}
    assert time.monotonic() - start < BOUND + 5


# -- malformed frames after the upgrade --

GARBAGE = [
    os.urandom(4096),
    struct.pack(">HHI", 0x8002, 1, 10) + b"x" * 10,          # SPDY version 2
    struct.pack(">HHI", 0x8003, 1, 0xFFFFFF),                 # 16 MiB announced, none sent
    struct.pack(">HHI", 0x8003, 1, 12) + struct.pack(">III", 1, 0, 0),  # no header block
    struct.pack(">II", 99, 0x01000004) + b"abcd",             # data on a stream never opened
    b"\x80\x03\x00\x01\x00\x00\x00\x0e" + b"\x00\x00\x00\x01" * 2 + b"\x78\x9c\xff\xff\xff",
]
WS_GARBAGE = [
    b"\x82\x7f" + struct.pack(">Q", 2**63 - 1),               # 8 EiB binary frame, unmasked
    b"\x8f\x80\x00\x00\x00\x00",                             # reserved opcode
    b"\x02\x85abcd" + b"x" * 5,                              # continuation of nothing
    os.urandom(1024),
]


def _send_garbage(node: Node, kind: str, websocket: bool, garbage: bytes) -> str:
    """Upgrade, send `garbage`, read until the far side closes: "" when all went as it
    must, else what did not."""
    start = time.monotonic()
    with connect(node, admin_cert(node.cluster)) as s:
        s.sendall(_upgrade_head(kind, node, websocket))
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        if not head.startswith(b"HTTP/1.1 101"):
            # refused before any frame (a protocol the runtime does not speak)
            return "" if 400 <= status_of(head) < 600 else f"answered {head[:80]!r}"
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            s.sendall(garbage)
        read_all(s)
    took = time.monotonic() - start
    return "" if took < BOUND else f"open {took:.0f} s"


def test_malformed_spdy_and_websocket_frames(node: Node) -> None:
    """Garbage after a successful upgrade: the runtime's streaming server closes, or the
    idle timeout does; the agent holds nothing afterwards and the victim still serves."""
    cases = [(k, False, g) for k in ("exec", "attach", "portForward") for g in GARBAGE] + \
        [(k, True, g) for k in ("exec", "attach", "portForward") for g in WS_GARBAGE]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        outcomes = list(pool.map(lambda c: _send_garbage(node, *c), cases))
    wrong = [(k, ws, g[:12], o) for (k, ws, g), o in zip(cases, outcomes, strict=True) if o]
    assert not wrong, wrong
    r = node.run_kubectl("exec", "victim", "--", "echo", "still-here")
    assert r.returncode == 0 and r.stdout == b"still-here\n", r


# -- port-forward --

def test_port_forward_to_what_the_pod_does_not_own(node: Node) -> None:
    cert = admin_cert(node.cluster)
    ns = node.namespace
    for query in ("port=0", "port=65536", "port=-1", "port=abc", "port=80,x", "port=%2022",
                  "port=99999999999999999999"):
        answer = raw_request(node, f"POST /portForward/{ns}/victim?{query} HTTP/1.1\r\n"
                                   "Host: x\r\nConnection: Upgrade, close\r\n"
                                   "Upgrade: SPDY/3.1\r\n"
                                   "X-Stream-Protocol-Version: portforward.k8s.io\r\n\r\n",
                             cert)
        assert status_of(answer) == 400 and b"port" in answer, (query, answer[:200])
    # another pod's uid is not this pod
    answer = raw_request(node, f"POST /portForward/{ns}/victim/{'0' * 8}-0000-0000-0000-"
                               f"{'0' * 12}?port=8080 HTTP/1.1\r\nHost: x\r\nConnection: "
                               "Upgrade, close\r\nUpgrade: SPDY/3.1\r\n\r\n", cert)
    assert status_of(answer) == 404, answer[:200]
    # a port of the host (the API server's) seen from the pod: its own network
    # namespace, where nothing listens there
    host_port = int(node.cluster.server.rsplit(":", 1)[1])
    local = free_port()
    proc = subprocess.Popen([node.kubectl, f"--kubeconfig={node.cluster.kubeconfig}", "-n",
                             ns, "port-forward", "pod/victim", f"{local}:{host_port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert b"Forwarding" in proc.stdout.readline()
        with socket.create_connection(("127.0.0.1", local), timeout=5) as s:
            s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            got = read_all(s)
        assert got == b"", got[:200]
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert b"refused" in err, err
