"""Probes on the fake runtime and FakeClock: readiness drives Ready, liveness restarts,
startup gates both, thresholds and delays count; readiness gates come from the API's
status. The network actions (httpGet, tcpSocket, grpc) are tested against servers on
loopback, in real time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
import pytest
from aiohttp import web

from nodeagent.api.clock import FakeClock
from nodeagent.api.kube import PODS
from nodeagent.pods.handlers import FAILURE, SUCCESS, WARNING, ActionError, Actions, Target
from nodeagent.pods.podupdate import Op
from nodeagent.runtime import ExecResult, RuntimeTimeout
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import LoopRig, aio, free_port, mkpod, started


def probed(name: str = "c", **probes: Any) -> dict[str, Any]:
    """A container running sleep with the given probes (readinessProbe=..., ...)."""
    return {"name": name, "image": "localhost/busybox:1", "command": ["sleep", "3600"],
            **probes}


def exec_probe(*cmd: str, **kw: Any) -> dict[str, Any]:
    return {"exec": {"command": list(cmd)}, "periodSeconds": 1, **kw}


def failing(*commands: str) -> Callable[[list[str]], ExecResult]:
    """An exec answer: the commands named fail (exit 1, "nope"), others succeed."""
    def answer(cmd: list[str]) -> ExecResult:
        return ExecResult(1, b"nope\n") if cmd[0] in commands else ExecResult(0)
    return answer


def cond(a: LoopRig, uid: str, ctype: str) -> str:
    return str(a.condition(uid, ctype)["status"])


@aio
async def test_failing_readiness_probe_keeps_the_pod_not_ready() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.rt.exec_results["c"] = failing("false")
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(readinessProbe=exec_probe("false"))]))
    await a.run_for(20)
    assert a.status("u1")["phase"] == "Running"
    assert cond(a, "u1", "Ready") == "False" and cond(a, "u1", "ContainersReady") == "False"
    assert a.condition("u1", "Ready")["message"] == "containers with unready status: [c]"
    cs = a.cstatus("u1")
    assert cs["ready"] is False and cs["started"] is True and cs["restartCount"] == 0
    assert ("c", ["false"]) in a.rt.execs
    assert "Readiness probe failed: nope\n" in a.events_of("Unhealthy")
    assert len(a.rt.find("u1", "c")) == 1  # readiness never restarts
    failed = probe_results(a, "Readiness", "failure")
    assert failed == a.loop.probes.probes_run > 0  # every run counted, each a failure
    assert probe_results(a, "Readiness", "success") == 0
    await a.loops.stop()


def probe_results(a: LoopRig, kind: str, result: str) -> float:
    """nodepulse_probe_results_total of the rig's node, for one kind and result."""
    return a.registry.get_sample_value("nodepulse_probe_results_total",
                                       {"node": "n1", "probe_type": kind,
                                        "result": result}) or 0.0


@aio
async def test_readiness_follows_the_probe_both_ways() -> None:
    clock = FakeClock()
    a = await started(clock)
    healthy = [True]
    a.rt.exec_results["c"] = lambda cmd: ExecResult(0 if healthy[0] else 1)
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(
        readinessProbe=exec_probe("check", initialDelaySeconds=5, failureThreshold=2,
                                  successThreshold=2))]))
    await a.run_for(4)
    assert cond(a, "u1", "Ready") == "False"  # before the initial delay: not probed yet
    assert a.rt.execs == []
    await a.run_for(5)
    assert cond(a, "u1", "Ready") == "True"
    healthy[0] = False
    await a.run_for(1)
    assert cond(a, "u1", "Ready") == "True"  # one failure is below failureThreshold 2
    await a.run_for(2)
    assert cond(a, "u1", "Ready") == "False"
    healthy[0] = True
    await a.run_for(1)
    assert cond(a, "u1", "Ready") == "False"  # one success is below successThreshold 2
    await a.run_for(2)
    assert cond(a, "u1", "Ready") == "True"
    succeeded, failed = (probe_results(a, "Readiness", r) for r in ("success", "failure"))
    assert failed >= 2 and succeeded >= 4
    assert succeeded + failed == a.loop.probes.probes_run
    await a.loops.stop()


@aio
async def test_liveness_failure_restarts_the_container_with_the_kubelets_events() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.rt.exec_results["c"] = failing("cat")
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(
        livenessProbe=exec_probe("cat", "/tmp/health", failureThreshold=3))]))
    await a.run_for(4)  # started at 1 s, failed at 2, 3 and 4: killed, restarted at once
    attempts = a.rt.find("u1", "c")
    assert len(attempts) == 2 and attempts[1].state == "RUNNING"
    assert attempts[0].exit_code == 143
    await a.run_for(1)
    cs = a.cstatus("u1")
    assert cs["restartCount"] == 1 and "running" in cs["state"]
    assert cs["lastState"]["terminated"]["exitCode"] == 143
    assert "Container c failed liveness probe, will be restarted" in a.events_of("Killing")
    assert "Liveness probe failed: nope\n" in a.events_of("Unhealthy")
    await a.loops.stop()


@aio
async def test_liveness_with_restart_policy_never_kills_without_restart() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.rt.exec_results["c"] = failing("false")
    a.send(Op.ADD, mkpod("web", "u1", policy="Never", containers=[probed(
        livenessProbe=exec_probe("false", failureThreshold=1))]))
    await a.run_for(10)
    assert len(a.rt.find("u1", "c")) == 1
    assert a.status("u1")["phase"] == "Failed"
    assert "Container c failed liveness probe" in a.events_of("Killing")
    await a.loops.stop()


@aio
async def test_startup_probe_gates_liveness_and_readiness() -> None:
    clock = FakeClock()
    a = await started(clock)
    up = [False]
    a.rt.exec_results["c"] = lambda cmd: ExecResult(
        0 if cmd[0] == "ready" or (cmd[0] == "started" and up[0]) else 1)
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(
        startupProbe=exec_probe("started", failureThreshold=30),
        livenessProbe=exec_probe("alive", failureThreshold=3),
        readinessProbe=exec_probe("ready"))]))
    await a.run_for(10)
    # liveness would fail at once, but it does not run before startup has passed
    assert {cmd[0] for _, cmd in a.rt.execs} == {"started"}
    cs = a.cstatus("u1")
    assert cs["started"] is False and cs["ready"] is False
    up[0] = True
    await a.run_for(2)
    cs = a.cstatus("u1")
    assert cs["started"] is True and cs["ready"] is True
    # now liveness runs and fails: killed and restarted, which starts over at startup
    await a.run_for(4)
    assert len(a.rt.find("u1", "c")) == 2
    assert "Container c failed liveness probe, will be restarted" in a.events_of("Killing")
    await a.loops.stop()


@aio
async def test_startup_failure_kills_with_its_own_reason() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.rt.exec_results["c"] = failing("started")
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(
        startupProbe=exec_probe("started", failureThreshold=3))]))
    await a.run_for(4)
    assert len(a.rt.find("u1", "c")) == 2
    assert "Container c failed startup probe, will be restarted" in a.events_of("Killing")
    await a.loops.stop()


@aio
async def test_exec_probe_timeout_is_a_failure() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.rt.exec_results["c"] = RuntimeTimeout('command "sleep 10" timed out')
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(
        readinessProbe=exec_probe("sleep", "10", timeoutSeconds=1))]))
    await a.run_for(5)
    assert cond(a, "u1", "Ready") == "False"
    assert 'Readiness probe failed: command "sleep 10" timed out' in a.events_of("Unhealthy")
    await a.loops.stop()


@aio
async def test_probe_that_cannot_run_counts_as_nothing() -> None:
    """A named port the container does not declare: the probe errors, the result stays
    what it was (liveness: success, so no restart), with a Warning saying why."""
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(
        livenessProbe={"tcpSocket": {"port": "nope"}, "periodSeconds": 1,
                       "failureThreshold": 1})]))
    await a.run_for(6)
    assert len(a.rt.find("u1", "c")) == 1
    assert any("Liveness probe errored" in m and "port nope not found" in m
               for m in a.events_of("Unhealthy"))
    assert probe_results(a, "Liveness", "unknown") == a.loop.probes.probes_run > 0
    assert probe_results(a, "Liveness", "failure") == 0
    await a.loops.stop()


@aio
async def test_probes_cost_no_runtime_calls_of_their_own() -> None:
    """Steady state: an exec probe is one ExecSync per period and nothing else; the
    probe reads the container from the PLEG cache (no pod_status, no extra relist), and
    with the event stream up the PLEG does not relist within its 60 s period."""
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(
        readinessProbe=exec_probe("true"), livenessProbe=exec_probe("true"))]))
    await a.run_for(10)
    before = dict(a.rt.calls)
    await a.run_for(30)
    spent = {k: v - before.get(k, 0) for k, v in a.rt.calls.items() if v != before.get(k, 0)}
    assert spent == {"exec_sync": 60}
    await a.loops.stop()


@aio
async def test_readiness_gates_come_from_the_api_and_are_never_written() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1", readinessGates=[{"conditionType": "example.com/lb"}])
    a.send(Op.ADD, pod)
    await a.run_for(3)
    ready = a.condition("u1", "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ReadinessGatesNotReady"
    assert 'readiness gate "example.com/lb" does not exist' in ready["message"]
    assert cond(a, "u1", "ContainersReady") == "True"
    # someone else sets the gate's condition in the API: the agent follows it
    gated = a.kube.obj(PODS, "web", "ns")
    gated["status"]["conditions"].append({"type": "example.com/lb", "status": "True"})
    a.send(Op.RECONCILE, gated)
    await a.run_for(3)
    assert cond(a, "u1", "Ready") == "True"
    for _, st in a.patches():  # the agent never writes a condition it does not own
        assert {c["type"] for c in st["conditions"]} == {
            "PodReadyToStartContainers", "PodScheduled", "Initialized", "ContainersReady",
            "Ready"}
    await a.loops.stop()


@aio
async def test_conditions_carry_the_observed_generation() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1")
    pod["metadata"]["generation"] = 3
    a.send(Op.ADD, pod)
    await a.run_for(3)
    st = a.status("u1")
    assert st["observedGeneration"] == 3
    assert {c["observedGeneration"] for c in st["conditions"]} == {3}
    assert cond(a, "u1", "PodReadyToStartContainers") == "True"
    await a.loops.stop()


@aio
async def test_fake_containers_answer_network_probes_as_scripted() -> None:
    """Nothing listens in a fake container: the fake runtime answers httpGet, tcpSocket
    and grpc probes (success unless a test scripts otherwise) and records them."""
    clock = FakeClock()
    a = await started(clock)
    a.rt.network_results["c"] = ExecResult(1, b"HTTP probe failed with statuscode: 503")
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(
        readinessProbe={"httpGet": {"path": "/", "port": 80}, "periodSeconds": 1},
        livenessProbe={"tcpSocket": {"port": 80}, "periodSeconds": 1})]))
    await a.run_for(5)
    assert cond(a, "u1", "Ready") == "False"
    assert {("c", "httpGet"), ("c", "tcpSocket")} <= set(a.rt.network_probes)
    assert "Readiness probe failed: HTTP probe failed with statuscode: 503" in \
        a.events_of("Unhealthy")
    del a.rt.network_results["c"]
    await a.run_for(3)
    assert cond(a, "u1", "Ready") == "True"
    await a.loops.stop()


# --- the network actions, against servers on loopback ----------------------------------

async def http_server(routes: dict[str, Callable[[web.Request], web.Response]]
                      ) -> tuple[web.AppRunner, int]:
    app = web.Application()
    for path, handler in routes.items():
        async def handle(r: web.Request, handler: Any = handler) -> Any:
            return handler(r)
        app.router.add_get(path, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def dialing() -> FakeRuntime:
    """A fake runtime that lets network actions dial for real (servers on loopback)."""
    rt = FakeRuntime()
    rt.dial = True
    return rt


def target(port: int | None = None, ip: str = "127.0.0.1") -> Target:
    ports = [{"name": "http", "containerPort": port}] if port else []
    return Target({"name": "c", "ports": ports}, "cid", ip)


@aio
async def test_http_get_statuses_redirects_and_headers() -> None:
    seen: dict[str, str] = {}

    def ok(r: web.Request) -> web.Response:
        seen.update(r.headers)
        return web.Response(text="fine")

    def moved(r: web.Request) -> web.Response:
        raise web.HTTPFound("/ok")

    def away(r: web.Request) -> web.Response:
        raise web.HTTPFound("http://example.invalid/elsewhere")

    def loop(r: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    def broken(r: web.Request) -> web.Response:
        return web.Response(status=500)

    runner, port = await http_server({"/ok": ok, "/moved": moved, "/away": away,
                                      "/loop": loop, "/broken": broken})
    act = Actions(dialing())
    try:
        got = await act.http_get({"port": "http", "path": "/ok", "httpHeaders": [
            {"name": "X-Probe", "value": "1"}]}, target(port), 1)
        assert got.result == SUCCESS and got.output == "fine"
        assert seen["User-Agent"] == "kube-probe/1.35" and seen["X-Probe"] == "1"
        assert seen["Accept"] == "*/*" and "Accept-Encoding" not in seen
        assert (await act.http_get({"port": port, "path": "/moved"}, target(), 1)).result \
            == SUCCESS
        away_got = await act.http_get({"port": port, "path": "/away"}, target(), 1)
        assert away_got.result == WARNING
        assert away_got.output.startswith("Probe terminated redirects")
        looped = await act.http_get({"port": port, "path": "/loop"}, target(), 1)
        assert looped.result == FAILURE and "stopped after 10 redirects" in looped.output
        assert await act.http_get({"port": port, "path": "/broken"}, target(), 1) == \
            type(got)(FAILURE, "HTTP probe failed with statuscode: 500")
        closed = await act.http_get({"port": free_port(), "path": "/"}, target(), 1)
        assert closed.result == FAILURE and "connection refused" in closed.output
        with pytest.raises(ActionError, match="port nope not found"):
            await act.http_get({"port": "nope"}, target(port), 1)
    finally:
        await act.close()
        await runner.cleanup()


@aio
async def test_tcp_socket() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    act = Actions(dialing())
    try:
        assert (await act.tcp({"port": port}, target(), 1)).result == SUCCESS
        refused = await act.tcp({"port": free_port()}, target(), 1)
        assert refused.result == FAILURE
        assert refused.output.endswith("connect: connection refused")
    finally:
        server.close()
        await server.wait_closed()


@aio
async def test_grpc_health_check() -> None:
    state = {"": 1, "sick": 2}  # SERVING, NOT_SERVING

    def check(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        service = request[2:].decode() if request else ""
        return bytes([0x08, state.get(service, 3)])

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    act = Actions(dialing())
    try:
        assert (await act.grpc_health({"port": port}, target(), 2)).result == SUCCESS
        sick = await act.grpc_health({"port": port, "service": "sick"}, target(), 2)
        assert sick == type(sick)(FAILURE, 'service unhealthy (responded with "NOT_SERVING")')
        down = await act.grpc_health({"port": free_port()}, target(), 1)
        assert down.result == FAILURE and down.output.startswith("timeout: failed to connect")
    finally:
        await server.stop(0)


@aio
async def test_a_restarted_agent_keeps_the_readiness_it_adopts() -> None:
    """Containers that ran before the agent started keep the readiness the API last
    heard until their probe says otherwise: an agent restart does not flap Ready."""
    clock = FakeClock()
    rt = FakeRuntime(clock)
    a = await started(clock, rt)
    pod = mkpod("web", "u1", containers=[probed(readinessProbe=exec_probe(
        "check", periodSeconds=10))])
    a.send(Op.ADD, pod)
    await a.run_for(30)
    assert cond(a, "u1", "Ready") == "True"
    await a.loops.stop()
    rt.exec_results["c"] = failing("check")  # from now on the probe fails
    b = await started(clock, rt)  # a new agent on the same runtime
    b.send(Op.ADD, dict(pod, status=a.status("u1")))
    await b.run_for(2)
    assert b.patches() == [] or cond(b, "u1", "Ready") == "True"
    await b.run_for(40)  # the probe runs and fails: now it is not ready
    assert cond(b, "u1", "Ready") == "False"
    await b.loops.stop()


class SlowExec(FakeRuntime):
    """Each exec takes 0.6 s of (fake) time."""

    async def exec_sync(self, container_id: str, cmd: list[str], timeout: float) -> ExecResult:
        await self.clock.sleep(0.6)
        return await super().exec_sync(container_id, cmd, timeout)


@aio
async def test_probes_tick_every_period_however_long_they_take() -> None:
    clock = FakeClock()
    a = await started(clock, SlowExec(clock))
    a.send(Op.ADD, mkpod("web", "u1", containers=[probed(livenessProbe=exec_probe("true"))]))
    await a.run_for(5)
    before = len(a.rt.execs)
    await a.run_for(20)
    assert len(a.rt.execs) - before in (19, 20, 21)  # not 20 / 1.6
    await a.loops.stop()
