"""The handler actions probes and lifecycle hooks share: exec in the container, an HTTP
GET, a TCP connect, a gRPC health check, as the kubelet runs them.

`Actions.run(handler, target, timeout)` runs one handler (a probe's or a hook's JSON)
and returns an `Outcome`: success, warning (a success the user should hear about, e.g.
a redirect to another host that was not followed) or failure, with the output the
kubelet would put in its Event. A handler that cannot run at all (a named port the
container does not declare, no pod IP yet, a runtime error) raises `ActionError`: the
kubelet counts that as neither success nor failure.

exec goes through the runtime (CRI ExecSync); the network actions dial the pod's IP
from the agent, so they cost no runtime call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import struct
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from nodeagent.runtime.base import ContainerRuntimeError, Runtime, RuntimeTimeout

KUBE_VERSION = "1.35"  # the Kubernetes release whose kubelet these follow
MAX_OUTPUT = 10 * 1024  # bytes of exec output or response body kept (the kubelet's)
MAX_REDIRECTS = 10

SUCCESS, WARNING, FAILURE = "success", "warning", "failure"


@dataclass(frozen=True)
class Outcome:
    result: str       # SUCCESS, WARNING or FAILURE
    output: str = ""


class ActionError(Exception):
    """The handler could not be run (not a failure of the thing it checks)."""


@dataclass(frozen=True)
class Target:
    """What a handler acts on: a container (its spec and runtime id) and its pod's IP."""
    container: Mapping[str, Any]
    container_id: str
    pod_ip: str


def handler_kind(handler: Mapping[str, Any]) -> str:
    """The one action a handler names ("" when none it knows)."""
    for kind in ("exec", "httpGet", "tcpSocket", "grpc", "sleep"):
        if handler.get(kind) is not None:
            return kind
    return ""


def resolve_port(port: Any, container: Mapping[str, Any]) -> int:
    """A port by number, or by the name of one of the container's ports (a name that is
    all digits is taken as a number when no port has it, as the kubelet does)."""
    if isinstance(port, str):
        named = [p.get("containerPort") for p in container.get("ports") or []
                 if p.get("name") == port]
        if named:
            port = named[0]
        elif port.isdigit():
            port = int(port)
        else:
            raise ActionError(f"port {port} not found")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ActionError(f"invalid port number: {port}")
    return port


def expand(arg: str, env: Mapping[str, str]) -> str:
    """$(VAR) replaced by the container's env value when VAR is defined, $$(VAR) kept as
    the literal $(VAR), anything else untouched (the kubelet's expansion)."""
    out: list[str] = []
    i = 0
    while i < len(arg):
        if arg.startswith("$$", i):
            out.append("$")
            i += 2
        elif arg.startswith("$(", i) and (end := arg.find(")", i + 2)) != -1:
            name = arg[i + 2:end]
            out.append(env[name] if name in env else arg[i:end + 1])
            i = end + 1
        else:
            out.append(arg[i])
            i += 1
    return "".join(out)


def static_env(container: Mapping[str, Any]) -> dict[str, str]:
    """The container's env entries with a plain value (what probe commands may use)."""
    return {str(e["name"]): str(e.get("value") or "") for e in container.get("env") or []
            if "valueFrom" not in e}


def _linger(family: int, type_: int, proto: int) -> socket.socket:
    """Probe sockets close with a 1 s linger, so thousands of probes do not leave
    thousands of sockets in TIME-WAIT (the kubelet's probe dialer does the same)."""
    s = socket.socket(family, type_, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 1))
    return s


def _dial_error(host: str, port: int, e: BaseException | None) -> str:
    """A failed connect worded as the kubelet's (Go's) dialer words it."""
    where = f"dial tcp {_join(host, port)}"
    if isinstance(e, TimeoutError):
        return f"{where}: i/o timeout"
    if isinstance(e, OSError) and e.errno:
        return f"{where}: connect: {os.strerror(e.errno).lower()}"
    return f"{where}: {e}"


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _health_request(service: str) -> bytes:
    """grpc.health.v1.HealthCheckRequest{service}: field 1, a length-delimited string
    (hand-encoded: two fields do not need generated code)."""
    raw = service.encode()
    if not raw:
        return b""
    size, n = bytearray(), len(raw)
    while n > 0x7F:
        size.append(n & 0x7F | 0x80)
        n >>= 7
    size.append(n)
    return b"\x0a" + bytes(size) + raw


def _health_status(body: bytes) -> int:
    """The `status` (field 1, a varint) of a grpc.health.v1.HealthCheckResponse."""
    i = 0
    while i < len(body):
        tag = body[i]
        i += 1
        value = shift = 0
        while i < len(body):
            b = body[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if tag == 0x08:
            return value
        if tag & 7 == 2:  # another length-delimited field: skip it
            i += value
    return 0


_SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


class Actions:
    """Runs handlers. One per node loop; its HTTP client is shared by every probe (no
    keep-alive: each probe is a fresh connection, as the kubelet's)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def run(self, handler: Mapping[str, Any], target: Target, timeout: float, *,
                  purpose: str = "probe") -> Outcome:
        kind = handler_kind(handler)
        if kind == "exec":
            cmd = [str(x) for x in (handler["exec"] or {}).get("command") or []]
            env = static_env(target.container)
            return await self.exec([expand(a, env) for a in cmd], target, timeout)
        if kind == "httpGet":
            return await self.http_get(handler["httpGet"], target, timeout, purpose=purpose)
        if kind == "tcpSocket":
            return await self.tcp(handler["tcpSocket"], target, timeout)
        if kind == "grpc":
            return await self.grpc_health(handler["grpc"], target, timeout)
        raise ActionError("missing probe handler" if not handler else
                          f"no handler this agent runs in {sorted(handler)}")

    async def exec(self, cmd: list[str], target: Target, timeout: float) -> Outcome:
        if not cmd:
            raise ActionError("exec: the command is empty")
        try:
            r = await self.runtime.exec_sync(target.container_id, cmd, timeout)
        except RuntimeTimeout as e:
            return Outcome(FAILURE, str(e))
        except ContainerRuntimeError as e:
            raise ActionError(str(e)) from e
        out = (r.stdout + r.stderr)[:MAX_OUTPUT].decode(errors="replace")
        return Outcome(SUCCESS if r.exit_code == 0 else FAILURE, out)

    def _host(self, action: Mapping[str, Any], target: Target) -> str:
        host = str(action.get("host") or target.pod_ip)
        if not host:
            raise ActionError("the pod has no IP address yet")
        return host

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            connector = aiohttp.TCPConnector(force_close=True, limit=0, ssl=False,
                                             socket_factory=lambda a: _linger(*a[:3]))
            self._http = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                               cookie_jar=aiohttp.DummyCookieJar())
        return self._http

    def http_url(self, action: Mapping[str, Any], target: Target) -> URL:
        scheme = str(action.get("scheme") or "HTTP").lower()
        port = resolve_port(action.get("port"), target.container)
        parts = urllib.parse.urlsplit(str(action.get("path") or ""))
        path = parts.path if parts.path.startswith("/") else "/" + parts.path
        return URL.build(scheme=scheme, host=self._host(action, target), port=port,
                         path=path, query_string=parts.query, encoded=False)

    def _simulated(self, target: Target, action: str) -> Outcome | None:
        """The runtime's own answer, when its containers run nothing (fake)."""
        r = self.runtime.simulated_network(target.container_id, action)
        if r is None:
            return None
        return Outcome(SUCCESS if r.exit_code == 0 else FAILURE, r.stdout.decode())

    async def http_get(self, action: Mapping[str, Any], target: Target, timeout: float, *,
                       purpose: str = "probe", any_status: bool = False) -> Outcome:
        """GET the URL; 2xx and 3xx succeed (`any_status`: any answer does, as for a
        lifecycle hook). Redirects within the same host are followed (at most 10); one
        to another host is not, and succeeds with a warning."""
        url = self.http_url(action, target)
        if (simulated := self._simulated(target, "httpGet")) is not None:
            return simulated
        headers: CIMultiDict[str] = CIMultiDict()
        for h in action.get("httpHeaders") or []:
            headers.add(str(h.get("name")), str(h.get("value") or ""))
        skip = {"Accept-Encoding"}
        headers.setdefault("User-Agent", f"kube-{purpose}/{KUBE_VERSION}")
        if "Accept" not in headers:
            headers["Accept"] = "*/*"
        elif not headers["Accept"]:
            del headers["Accept"]
            skip.add("Accept")
        first = url
        try:
            async with asyncio.timeout(timeout or None):
                for _ in range(MAX_REDIRECTS + 1):
                    status, location, body = await self._get(url, headers, skip)
                    if 300 <= status < 400 and location:
                        nxt = url.join(URL(location))
                        if nxt.host != first.host:
                            return Outcome(WARNING, "Probe terminated redirects, "
                                                    f"Response body: {body}")
                        url = nxt
                        continue
                    break
                else:
                    return Outcome(FAILURE, f'Get "{url}": stopped after 10 redirects')
        except TimeoutError:
            return Outcome(FAILURE, f'Get "{url}": context deadline exceeded '
                                    "(Client.Timeout exceeded while awaiting headers)")
        except aiohttp.ClientConnectorError as e:
            if isinstance(e.os_error, ssl.SSLError):  # e.g. a plain HTTP server
                return Outcome(FAILURE, f'Get "{url}": {e.os_error}')
            return Outcome(FAILURE, f'Get "{url}": '
                                    f"{_dial_error(str(url.host), url.port or 0, e.os_error)}")
        except (aiohttp.ClientError, OSError, ValueError) as e:
            return Outcome(FAILURE, f'Get "{url}": {e}')
        if 200 <= status < 300 or any_status:
            return Outcome(SUCCESS, body)
        if 300 <= status < 400:
            return Outcome(WARNING, f"Probe terminated redirects, Response body: {body}")
        return Outcome(FAILURE, f"HTTP probe failed with statuscode: {status}")

    async def _get(self, url: URL, headers: CIMultiDict[str],
                   skip: set[str]) -> tuple[int, str, str]:
        async with self._session().get(url, headers=headers, allow_redirects=False,
                                       skip_auto_headers=skip) as resp:
            body = b""
            while len(body) < MAX_OUTPUT:
                chunk = await resp.content.read(MAX_OUTPUT - len(body))
                if not chunk:
                    break
                body += chunk
            return resp.status, resp.headers.get("Location", ""), body.decode(errors="replace")

    async def tcp(self, action: Mapping[str, Any], target: Target, timeout: float) -> Outcome:
        host = self._host(action, target)
        port = resolve_port(action.get("port"), target.container)
        if (simulated := self._simulated(target, "tcpSocket")) is not None:
            return simulated
        try:
            async with asyncio.timeout(timeout or None):
                sock = _linger(socket.AF_INET6 if ":" in host else socket.AF_INET,
                               socket.SOCK_STREAM, 0)
                sock.setblocking(False)
                try:
                    await asyncio.get_running_loop().sock_connect(sock, (host, port))
                finally:
                    sock.close()
        except (TimeoutError, OSError) as e:
            return Outcome(FAILURE, _dial_error(host, port, e))
        return Outcome(SUCCESS)

    async def grpc_health(self, action: Mapping[str, Any], target: Target,
                          timeout: float) -> Outcome:
        """grpc.health.v1.Health/Check on the pod's IP (plain text, as the kubelet)."""
        host = target.pod_ip
        if not host:
            raise ActionError("the pod has no IP address yet")
        port = resolve_port(action.get("port"), target.container)
        if (simulated := self._simulated(target, "grpc")) is not None:
            return simulated
        # grpc costs 8.5 MB of memory once imported: only when a grpc probe or hook runs
        # (a process of virtual nodes, whose probes are simulated, never imports it)
        import grpc
        import grpc.aio

        service = str(action.get("service") or "")
        addr = _join(host, port)
        channel = grpc.aio.insecure_channel(addr, options=[
            ("grpc.primary_user_agent", f"kube-probe/{KUBE_VERSION}"),
            ("grpc.enable_retries", 0)])
        try:
            try:
                async with asyncio.timeout(timeout or None):
                    await channel.channel_ready()
            except TimeoutError:
                return Outcome(FAILURE, f'timeout: failed to connect service "{addr}" within '
                                        f"{timeout:g}s: context deadline exceeded")
            check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                        request_serializer=None, response_deserializer=None)
            try:
                body = await check(_health_request(service), timeout=timeout or None)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return Outcome(FAILURE, "error: this server does not implement the grpc "
                                            "health protocol (grpc.health.v1.Health): "
                                            f"{e.details()}")
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return Outcome(FAILURE, "timeout: health rpc did not complete within "
                                            f"{timeout:g}s")
                return Outcome(FAILURE, f"error: health rpc probe failed: {e.details()}")
            status = _health_status(body)
            if status != 1:
                name = _SERVING_STATUS.get(status, str(status))
                return Outcome(FAILURE, f'service unhealthy (responded with "{name}")')
            return Outcome(SUCCESS, "service healthy")
        finally:
            with contextlib.suppress(Exception):
                await channel.close()
