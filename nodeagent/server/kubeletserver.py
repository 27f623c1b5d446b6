"""The kubelet API on --address:--port over TLS (aiohttp): what the API server calls
for `kubectl logs`, `exec`, `attach`, `port-forward` and what metrics-server scrapes.

    /containerLogs/{ns}/{pod}/{container}   logs (containerlogs.py)
    /exec|/attach/{ns}/{pod}[/{uid}]/{container}, /portForward/{ns}/{pod}[/{uid}]
                                            proxied to the runtime (streaming.py)
    /pods                                   the pods bound here (a PodList)
    /stats/summary, /metrics/resource       usage (stats.py)
    /metrics, /healthz                      the agent's own

Every request is authenticated and authorized first (auth.py). One server serves every
Node of the process, and a request naming a pod is checked against the Node that pod is
bound to. With virtual nodes (`per_node_ports`) each Node also has a port of its own
(a free one, in its daemonEndpoints), where the server answers as that node alone: its
pods, its usage; so metrics-server and `kubectl get --raw /api/v1/nodes/N/proxy/...`
see each virtual node as a kubelet of its own. The shared port answers for all of them.

Hostile clients (docs/kubelet-api.md): a connection must finish its TLS handshake, and
send a whole request head, within the connection idle timeout of connecting or of its
last response, else it is closed; a request head is at most 128 lines of 8 KiB;
bodies are never read (a request that sends one is answered, then its connection
closed); a malformed request is a 400 and a line in the debug log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from nodeagent.api.clock import Clock
from nodeagent.metrics import per_registry
from nodeagent.runtime.base import (
    Container,
    ContainerRuntimeError,
    ContainerState,
    NotFound,
    PodRuntimeStatus,
    SandboxState,
    StreamRequest,
    Unsupported,
)
from nodeagent.server import containerlogs, stats, streaming
from nodeagent.server.auth import AuthorizationError, Forbidden, KubeletAuth, Unauthorized
from nodeagent.server.podhost import Pod, PodHost
from nodeagent.server.tls import ServingCert

log = logging.getLogger(__name__)

# the kubelet's http.Server IdleTimeout; here it also bounds the TLS handshake and the
# wait for a request head (a slow client's half-sent head counts as idle)
CONNECTION_IDLE_TIMEOUT = 90.0
STREAMING_CONNECTION_IDLE_TIMEOUT = 4 * 3600.0  # the kubelet's default

HealthCheck = Callable[[], str | None]
DEBUGGING = ("containerLogs", "exec", "attach", "portForward")  # the debugging handlers


@dataclass
class ServerMetrics:
    requests: Counter
    streams: Gauge
    connections: Gauge
    tasks: Gauge


@per_registry
def server_metrics(registry: CollectorRegistry) -> ServerMetrics:
    return ServerMetrics(
        requests=Counter("nodepulse_kubelet_api_requests_total",
                         "Requests to the kubelet API by endpoint and HTTP status.",
                         ["endpoint", "code"], registry=registry),
        streams=Gauge("nodepulse_kubelet_api_streams",
                      "Log streams and exec/attach/port-forward sessions open now.",
                      ["endpoint"], registry=registry),
        connections=Gauge("nodepulse_kubelet_api_connections",
                          "Client connections to the kubelet API open now, the upgraded "
                          "ones of exec/attach/port-forward included.", registry=registry),
        tasks=Gauge("nodepulse_asyncio_tasks",
                    "asyncio tasks of the agent's event loop now (a figure to see leaks by).",
                    registry=registry))


class _BadRequestLog(logging.LoggerAdapter):
    """aiohttp's server log: a client's malformed request is its problem, one debug
    line (a hostile client must not fill the log with tracebacks)."""

    def exception(self, msg: object, *args: object, exc_info: object = True,
                  **kwargs: object) -> None:
        self.debug("kubelet API: " + str(msg) + ": %s", *args, exc_info)


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _spec_containers(pod: Pod) -> list[str]:
    spec = pod.get("spec") or {}
    return [str(c.get("name")) for kind in ("initContainers", "containers",
                                            "ephemeralContainers")
            for c in spec.get(kind) or []]


def _restarts(pod: Pod, c: Container) -> bool:
    """Whether the agent will start this exited container again (then `--previous`
    means it, as the kubelet's lastState does). An ephemeral container never is."""
    spec = pod.get("spec") or {}
    if any(e.get("name") == c.name for e in spec.get("ephemeralContainers") or []):
        return False
    policy = spec.get("restartPolicy") or "Always"
    return policy == "Always" or (policy == "OnFailure" and (c.exit_code or 0) != 0)


def pick_container(pod: Pod, rs: PodRuntimeStatus, name: str, previous: bool) -> Container:
    """The container instance a logs request means (the kubelet's rules)."""
    meta = pod.get("metadata") or {}
    where = f"container {name!r} in pod {meta.get('name')!r}"
    if name not in _spec_containers(pod):
        raise RequestError(404, f"container {name!r} not found in pod {meta.get('name')!r}")
    tries = sorted((c for c in rs.containers if c.name == name), key=lambda c: c.attempt,
                   reverse=True)
    if not tries:
        raise RequestError(400, f"{where} is waiting to start: no container has been "
                                "created yet")
    latest = tries[0]
    if not previous:
        return latest
    if latest.state == ContainerState.EXITED and _restarts(pod, latest):
        return latest
    older = [c for c in tries[1:] if c.state == ContainerState.EXITED]
    if not older:
        raise RequestError(400, f"previous terminated container {name!r} in pod "
                                f"{meta.get('name')!r} not found")
    return older[0]


@dataclass(frozen=True)
class ServerSettings:
    """Where the kubelet API listens and what it serves (the kubelet's flags)."""

    address: str = "0.0.0.0"
    port: int = 10250  # 0: a free one
    # containerLogs, exec, attach, portForward (the kubelet's enableDebuggingHandlers)
    debugging_handlers: bool = True
    connection_idle_timeout: float = CONNECTION_IDLE_TIMEOUT
    streaming_idle_timeout: float = STREAMING_CONNECTION_IDLE_TIMEOUT
    per_node_ports: bool = False  # each Node on a port of its own too (virtual nodes)


class KubeletServer:
    def __init__(self, host: PodHost, auth: KubeletAuth, cert: ServingCert,
                 usage: stats.StatsProvider, *, node_names: Sequence[str], clock: Clock,
                 registry: CollectorRegistry, settings: ServerSettings = ServerSettings(),
                 health_checks: Mapping[str, HealthCheck] | None = None) -> None:
        self.host = host
        self.runtime = host.runtime
        self.auth = auth
        self.cert = cert
        self.stats = usage
        self.node_names = list(node_names)
        self.clock = clock
        self.registry = registry
        self.address = settings.address
        self.port = settings.port
        self.health_checks = dict(health_checks or {})
        self.debugging_handlers = settings.debugging_handlers
        self.connection_idle_timeout = settings.connection_idle_timeout
        self.streaming_idle_timeout = settings.streaming_idle_timeout
        self.per_node_ports = settings.per_node_ports
        self.watch = containerlogs.FileWatch()
        self.metrics = server_metrics(registry)
        self.node_ports: dict[str, int] = {}  # node -> its own port (per_node_ports)
        self._node_by_port: dict[int, str] = {}
        self._runner: web.AppRunner | None = None
        self._listeners: list[asyncio.Server] = []  # the shared port, then the nodes'
        self._trimmer: asyncio.Task[None] | None = None

    # -- lifecycle --
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024 * 1024)
        app.router.add_route("*", "/{path:.*}", self._dispatch)
        return app

    async def start(self) -> int:
        """Listen; returns the port (a free one when --port is 0)."""
        self._runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False, shutdown_timeout=1.0,
            keepalive_timeout=self.connection_idle_timeout,
            lingering_time=0,  # no endpoint takes a body: close rather than drain one
            logger=_BadRequestLog(logging.getLogger("aiohttp.server")))
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        self.metrics.connections.set_function(lambda: len(server.connections))
        loop = asyncio.get_running_loop()
        self.metrics.tasks.set_function(lambda: len(asyncio.all_tasks(loop)))
        self._trimmer = loop.create_task(_trim_after_bursts(lambda: len(server.connections)))

        async def listen(port: int) -> int:
            # our own listener, not a TCPSite: it has no bound on the TLS handshake
            listener = await loop.create_server(
                server, self.address, port, ssl=self.cert.context, reuse_address=True,
                ssl_handshake_timeout=self.connection_idle_timeout)
            self._listeners.append(listener)
            return int(listener.sockets[0].getsockname()[1])
        self.port = await listen(self.port)
        log.info("kubelet API: serving on https://%s:%d for %d node(s)", self.address,
                 self.port, len(self.node_names))
        if self.per_node_ports:
            _allow_open_files(len(self.node_names) + 1024)
            for name in self.node_names:
                port = await listen(0)
                self.node_ports[name] = port
                self._node_by_port[port] = name
            log.info("kubelet API: each node on a port of its own as well (%d ports)",
                     len(self.node_ports))
        return self.port

    async def stop(self) -> None:
        if self._trimmer is not None:
            self._trimmer.cancel()
            self._trimmer = None
        for listener in self._listeners:
            listener.close()
        self._listeners = []
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.watch.close()

    # -- request handling --
    def _node_of(self, parts: list[str], own: str | None
                 ) -> tuple[str, tuple[str, Pod] | None]:
        """The Node a request is about: the one its pod is bound to, the one whose own
        port it came in on, or the only one. "" (every Node) when the path names no pod
        and the process has several."""
        found = None
        if parts and parts[0] in ("containerLogs", "exec", "attach", "portForward",
                                  "run") and len(parts) >= 3:
            found = self.host.find_pod(parts[1], parts[2])
        if found is not None:
            return found[0], found
        if own is not None:
            return own, None
        return (self.node_names[0] if len(self.node_names) == 1 else ""), None

    def _own_node(self, request: web.Request) -> str | None:
        """The node whose own port the request came in on (None: the shared port)."""
        if not self._node_by_port or request.transport is None:
            return None
        sockname = request.transport.get_extra_info("sockname")
        return self._node_by_port.get(sockname[1]) if sockname else None

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        endpoint = parts[0] if parts else ""
        code = 500
        try:
            peercert = None
            if request.transport is not None:
                peercert = request.transport.get_extra_info("peercert")
            user = await self.auth.authenticate(request.headers.get("Authorization"),
                                                peercert)
            own = self._own_node(request)
            node, found = self._node_of(parts, own)
            # the path as routed (empty segments dropped): "//stats" is /stats, and
            # needs nodes/stats as /stats does
            await self.auth.authorize(user, request.method, "/" + "/".join(parts), node,
                                      every_node_first=len(self.node_names) > 1)
            resp = await self._route(request, endpoint, parts, found, own)
            code = resp.status
            return resp
        except Unauthorized:
            code = 401
            return web.Response(status=401, text="Unauthorized\n")
        except Forbidden as e:
            code = 403
            return web.Response(status=403, text=f"{e}\n")
        except AuthorizationError as e:
            code = 500
            return web.Response(status=500, text=f"{e}\n")
        except (RequestError, containerlogs.LogRequestError) as e:
            code = e.status
            return web.Response(status=e.status, text=f"{e}\n")
        except Unsupported as e:
            code = 501
            return web.Response(status=501, text=f"{e}\n")
        except NotFound as e:
            code = 404
            return web.Response(status=404, text=f"{e}\n")
        except ContainerRuntimeError as e:
            code = 500
            return web.Response(status=500, text=f"container runtime: {e}\n")
        except (ConnectionError, asyncio.CancelledError):
            code = 499  # the client went away
            raise
        except Exception:
            log.exception("kubelet API: %s %s failed", request.method, request.path)
            return web.Response(status=500, text="internal error\n")
        finally:
            self.metrics.requests.labels(endpoint=endpoint or "/", code=str(code)).inc()

    async def _route(self, request: web.Request, endpoint: str, parts: list[str],
                     found: tuple[str, Pod] | None, own: str | None) -> web.StreamResponse:
        """`own`: the node whose own port the request came in on; its pods only."""
        method = request.method
        if endpoint == "healthz" and method == "GET":
            return self._healthz()
        if endpoint == "pods" and len(parts) == 1 and method == "GET":
            pods = [p for p in self.host.all_pods()
                    if own is None or (p.get("spec") or {}).get("nodeName") == own]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {}, "items": pods})
        if endpoint == "metrics" and method == "GET":
            if len(parts) == 1:
                return web.Response(body=generate_latest(self.registry),
                                    headers={"Content-Type": CONTENT_TYPE_LATEST})
            if parts[1:] == ["resource"]:
                text = await self.stats.resource_metrics(own)
                return web.Response(text=text, content_type="text/plain",
                                    charset="utf-8")
        if endpoint == "stats" and parts[1:] in ([], ["summary"]) and method == "GET":
            only_cpu_mem = request.query.get("only_cpu_and_memory") in ("true", "1")
            summary = await self.stats.summary(self.node_names, only_cpu_mem, own)
            return web.json_response(summary)
        if endpoint in DEBUGGING and not self.debugging_handlers:
            raise RequestError(404, f"{method} {request.path}: not served "
                                    "(enableDebuggingHandlers is false)")
        if endpoint == "containerLogs" and len(parts) == 4 and method == "GET":
            return await self._logs(request, parts, found)
        if endpoint in ("exec", "attach") and len(parts) in (4, 5) and method in ("GET", "POST"):
            return await self._exec(request, endpoint, parts, found)
        if endpoint == "portForward" and len(parts) in (3, 4) and method in ("GET", "POST"):
            return await self._port_forward(request, parts, found)
        raise RequestError(404, f"{method} {request.path}: no such endpoint")

    def _healthz(self) -> web.Response:
        failures = [f"{name}: {msg}" for name, check in self.health_checks.items()
                    if (msg := check()) is not None]
        if failures:
            return web.Response(status=500, text="\n".join(failures) + "\n")
        return web.Response(text="ok")

    @staticmethod
    def _pod(parts: list[str], found: tuple[str, Pod] | None, uid: str = "") -> Pod:
        if found is None:
            raise RequestError(404, f"pod {parts[1]}/{parts[2]} does not exist on this node")
        pod = found[1]
        if uid and (pod.get("metadata") or {}).get("uid") != uid:
            raise RequestError(404, f"pod {parts[1]}/{parts[2]} with uid {uid} does not "
                                    "exist on this node")
        return pod

    # -- logs --
    async def _logs(self, request: web.Request, parts: list[str],
                    found: tuple[str, Pod] | None) -> web.StreamResponse:
        opts = containerlogs.parse_options(request.query, self.clock.now())
        pod = self._pod(parts, found)
        uid = pod["metadata"]["uid"]
        c = pick_container(pod, self.host.runtime_pod(uid), parts[3], opts.previous)
        if not c.log_path:
            raise RequestError(400, f"container {parts[3]!r} in pod {parts[2]!r}: the "
                                    f"{self.runtime.scheme} runtime keeps no log file for it")
        containerlogs.check_format(self.runtime.log_format, opts, self.runtime.scheme)

        def running() -> bool:
            now = self.host.runtime_pod(uid)
            return any(x.id == c.id and x.state == ContainerState.RUNNING
                       for x in now.containers)

        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        started = False

        async def write(data: bytes) -> None:
            nonlocal started
            if not started:
                started = True
                await resp.prepare(request)
            await resp.write(data)

        gauge = self.metrics.streams.labels(endpoint="containerLogs")
        gauge.inc()
        try:
            await containerlogs.stream_log(c.log_path, self.runtime.log_format, opts, write,
                                  running=running if opts.follow else None,
                                  watch=self.watch)
        finally:
            gauge.dec()
        if not started:
            await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    # -- exec, attach, port-forward --
    async def _exec(self, request: web.Request, endpoint: str, parts: list[str],
                    found: tuple[str, Pod] | None) -> web.StreamResponse:
        q = request.query
        # the API server's names for them (k8s.io/api core/v1 Exec*Param)
        flag = {k: q.get(param) == "1" for k, param in (
            ("stdin", "input"), ("stdout", "output"), ("stderr", "error"), ("tty", "tty"))}
        if flag["tty"]:
            flag["stderr"] = False  # a terminal has one output stream
        if not (flag["stdin"] or flag["stdout"] or flag["stderr"]):
            raise RequestError(400, "you must specify at least 1 of stdin, stdout, stderr")
        uid = parts[3] if len(parts) == 5 else ""
        pod = self._pod(parts, found, uid)
        name = parts[-1]
        if name not in _spec_containers(pod):
            raise RequestError(404, f"container {name!r} not found in pod {parts[2]!r}")
        rs = self.host.runtime_pod(pod["metadata"]["uid"])
        running = [c for c in rs.containers
                   if c.name == name and c.state == ContainerState.RUNNING]
        if not running:
            raise RequestError(400, f"container {name!r} in pod {parts[2]!r} is not running")
        c = max(running, key=lambda x: x.attempt)
        req = StreamRequest(**flag)
        if endpoint == "exec":
            cmd = q.getall("command", [])
            if not cmd:
                raise RequestError(400, "exec: no command given (query parameter command)")
            url = await self.runtime.exec_url(c.id, list(cmd), req)
        else:
            url = await self.runtime.attach_url(c.id, req)
        return await self._proxy(request, endpoint, url)

    async def _port_forward(self, request: web.Request, parts: list[str],
                            found: tuple[str, Pod] | None) -> web.StreamResponse:
        pod = self._pod(parts, found, parts[3] if len(parts) == 4 else "")
        ports = []
        for p in (p for v in request.query.getall("port", []) for p in v.split(",") if p):
            if not p.isdigit() or not 0 < int(p) < 65536:
                raise RequestError(400, f"port {p!r} is not a port number")
            ports.append(int(p))
        rs = self.host.runtime_pod(pod["metadata"]["uid"])
        ready = [s for s in rs.sandboxes if s.state == SandboxState.READY]
        if not ready:
            raise RequestError(400, f"pod {parts[1]}/{parts[2]} has no running sandbox")
        url = await self.runtime.port_forward_url(ready[0].id, ports)
        return await self._proxy(request, "portForward", url)

    async def _proxy(self, request: web.Request, endpoint: str, url: str) -> web.StreamResponse:
        gauge = self.metrics.streams.labels(endpoint=endpoint)
        gauge.inc()
        try:
            return await streaming.proxy(request, url, self.clock,
                                         self.streaming_idle_timeout)
        finally:
            gauge.dec()


# a burst of this many TLS connections leaves enough freed heap to hand back
BURST = 100


def _malloc_trim() -> Callable[[int], object] | None:
    """glibc's malloc_trim(0), or None on another C library."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


async def _trim_after_bursts(connections: Callable[[], int]) -> None:
    """Hands the heap a burst of connections freed back to the OS once it has passed.
    Each TLS connection's buffers are allocated and freed on the event loop's heap, and
    glibc keeps what a burst freed in pieces it seldom reuses for the next one: without
    this, each flood of connections to the kubelet API raises the agent's memory for
    good, though nothing of it is still held."""
    trim = _malloc_trim()
    if trim is None:
        return
    peak = 0
    while True:
        await asyncio.sleep(1)
        now = connections()
        peak = max(peak, now)
        if peak - now >= BURST:
            trim(0)
            peak = now


def _allow_open_files(wanted: int) -> None:
    """Raise the soft limit on open files toward `wanted` (within the hard limit): a
    port per virtual node is a socket each."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
