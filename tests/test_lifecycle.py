"""Container lifecycle on the fake runtime and FakeClock: postStart and preStop hooks,
termination messages (file and log fallback), activeDeadlineSeconds, sidecar init
containers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nodeagent.api.clock import FakeClock
from nodeagent.api.kube import PODS
from nodeagent.pods.podupdate import Op
from nodeagent.runtime import ExecResult
from tests.conftest import aio, free_port, mkpod, started


def box(name: str = "c", **spec: Any) -> dict[str, Any]:
    return {"name": name, "image": "localhost/busybox:1", "command": ["sleep", "3600"],
            **spec}


def hooks(**handlers: list[str]) -> dict[str, Any]:
    return {"lifecycle": {k: {"exec": {"command": v}} for k, v in handlers.items()}}


@aio
async def test_post_start_runs_after_the_start() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("web", "u1", containers=[box(**hooks(postStart=["touch", "/x"]))]))
    await a.run_for(3)
    assert ("c", ["touch", "/x"]) in a.rt.execs
    assert a.status("u1")["phase"] == "Running"
    assert a.events_of("FailedPostStartHook") == []
    await a.loops.stop()


@aio
async def test_failed_post_start_kills_the_container() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.rt.exec_results["c"] = ExecResult(1, b"secret output")
    a.send(Op.ADD, mkpod("web", "u1", containers=[box(**hooks(postStart=["false"]))]))
    await a.run_for(3)
    first = a.rt.find("u1", "c")[0]
    assert first.state == "EXITED"
    assert a.events_of("FailedPostStartHook") == ["PostStartHook failed"]  # no output
    assert "FailedPostStartHook" in a.events_of("Killing")
    cs = a.cstatus("u1")
    assert cs["state"]["waiting"]["reason"] in ("PostStartHookError", "CrashLoopBackOff")
    await a.run_for(15)  # restarted after the back-off (and failed again)
    assert a.rt.find("u1", "c")[-1].restart_count >= 1
    await a.loops.stop()


@aio
async def test_pre_stop_runs_within_the_grace_period_before_the_stop() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("web", "u1", terminationGracePeriodSeconds=10,
                         containers=[box(lifecycle={"preStop": {"sleep": {"seconds": 4}}}),
                                     box("d", **hooks(preStop=["sh", "-c", "bye"]))]))
    await a.run_for(3)
    t0 = clock.monotonic()
    pod = a.kube.obj(PODS, "web", "ns")
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:10Z"
    pod["metadata"]["deletionGracePeriodSeconds"] = 10
    a.send(Op.UPDATE, pod)
    await a.run_for(3)
    assert ("d", ["sh", "-c", "bye"]) in a.rt.execs
    c = a.rt.find("u1", "c")[0]
    assert c.state == "RUNNING"  # its preStop sleep (4 s) is still under way
    await a.run_for(3)
    assert c.state == "EXITED" and clock.monotonic() - t0 >= 4
    assert "Stopping container c" in a.events_of("Killing")
    await a.loops.stop()


@aio
async def test_pre_stop_that_outlasts_the_grace_is_cut_short() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("web", "u1", terminationGracePeriodSeconds=3,
                         containers=[box(lifecycle={"preStop": {"sleep": {"seconds": 600}}})]))
    await a.run_for(3)
    pod = a.kube.obj(PODS, "web", "ns")
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:10Z"
    pod["metadata"]["deletionGracePeriodSeconds"] = 3
    a.send(Op.UPDATE, pod)
    await a.run_for(8)  # 3 s of hook, then the 2 s every container gets to stop
    assert a.rt.find("u1", "c")[0].state == "EXITED"
    await a.loops.stop()


@aio
async def test_termination_message_from_the_file(tmp_path: Path) -> None:
    clock = FakeClock()
    a = await started(clock, pods_dir=str(tmp_path))
    a.send(Op.ADD, mkpod("web", "u1", policy="Never", containers=[
        box(terminationMessagePath="/dev/termination-log")]))
    await a.run_for(3)
    cid = a.rt.running("u1")[0].id
    [mount] = [m for m in a.rt.configs[cid].mounts
               if m.container_path == "/dev/termination-log"]
    assert not mount.read_only
    assert os.stat(mount.host_path).st_mode & 0o777 == 0o666
    Path(mount.host_path).write_text("x" * 5000 + "the end")
    a.rt.exit_container(cid, 0)
    await a.run_for(3)
    term = a.cstatus("u1")["state"]["terminated"]
    assert len(term["message"]) == 4096 and term["message"].endswith("the end")
    a.send(Op.REMOVE, a.kube.obj(PODS, "web", "ns"))
    await a.run_for(5)
    assert not (tmp_path / "u1").exists()  # the pod's files go with it
    await a.loops.stop()


@aio
async def test_termination_message_falls_back_to_the_log_on_error(tmp_path: Path) -> None:
    clock = FakeClock()
    logs = tmp_path / "logs"
    a = await started(clock, pods_dir=str(tmp_path / "pods"), log_root=str(logs))
    spec = {"terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "FallbackToLogsOnError"}
    a.send(Op.ADD, mkpod("bad", "u1", policy="Never", containers=[box(**spec)]),
           mkpod("good", "u2", policy="Never", containers=[box(**spec)]))
    await a.run_for(3)
    bad, good = a.rt.running("u1")[0], a.rt.running("u2")[0]
    a.rt.write_log(bad.id, "\n".join(f"line {i}" for i in range(100)) + "\n")
    a.rt.write_log(good.id, "all fine\n")
    a.rt.exit_container(bad.id, 2)
    a.rt.exit_container(good.id, 0)
    await a.run_for(3)
    msg = a.cstatus("u1")["state"]["terminated"]["message"]
    # the end of the log: at most 80 lines, 2048 bytes; the fake runtime's exit line last
    assert msg.endswith("exited with code 2 (Error)\n") and "line 99\n" in msg
    assert "line 19\n" not in msg and len(msg.encode()) <= 2048
    assert "message" not in a.cstatus("u2")["state"]["terminated"]  # exit 0: no fallback
    await a.loops.stop()


@aio
async def test_active_deadline_fails_the_pod_and_follows_updates() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1")
    a.send(Op.ADD, pod)
    await a.run_for(10)
    assert a.status("u1")["phase"] == "Running"
    pod = dict(pod, spec=dict(pod["spec"], activeDeadlineSeconds=15))
    a.send(Op.UPDATE, pod)
    await a.run_for(3)
    assert a.status("u1")["phase"] == "Running"
    await a.run_for(5)
    st = a.status("u1")
    assert st["phase"] == "Failed" and st["reason"] == "DeadlineExceeded"
    assert st["message"] == "Pod was active on the node longer than the specified deadline"
    assert a.rt.running("u1") == []
    assert {c["type"]: c.get("reason") for c in st["conditions"]}["Ready"] == "PodFailed"
    await a.loops.stop()


def sidecar(name: str = "side", **spec: Any) -> dict[str, Any]:
    return box(name, restartPolicy="Always", **spec)


@aio
async def test_sidecar_starts_first_and_gates_the_app_on_its_startup_probe() -> None:
    clock = FakeClock()
    a = await started(clock)
    up = [False]
    a.rt.exec_results["side"] = lambda cmd: ExecResult(0 if up[0] else 1)
    a.send(Op.ADD, mkpod("web", "u1", initContainers=[
        sidecar(startupProbe={"exec": {"command": ["up"]}, "periodSeconds": 1,
                              "failureThreshold": 100}),
        box("after", command=["true"])], containers=[box("app")]))
    await a.run_for(5)
    assert [c.name for c in a.rt.running("u1")] == ["side"]
    st = a.status("u1")
    assert st["phase"] == "Pending"
    assert st["initContainerStatuses"][0]["started"] is False
    up[0] = True
    await a.run_for(3)
    after = a.rt.find("u1", "after")
    assert len(after) == 1  # the next init container once the sidecar started
    a.rt.exit_container(after[0].id, 0)
    await a.run_for(3)
    assert sorted(c.name for c in a.rt.running("u1")) == ["app", "side"]
    st = a.status("u1")
    assert st["phase"] == "Running"
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"
    side = st["initContainerStatuses"][0]
    assert side["started"] is True and side["ready"] is True and "running" in side["state"]
    await a.loops.stop()


@aio
async def test_sidecar_restarts_under_never_and_stops_after_the_app() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("job", "u1", policy="Never", initContainers=[sidecar()],
                         containers=[box("app")]))
    await a.run_for(3)
    side = a.rt.find("u1", "side")[0]
    a.rt.exit_container(side.id, 1)
    await a.run_for(3)
    assert len(a.rt.find("u1", "side")) == 2  # restarted although the pod says Never
    app = a.rt.find("u1", "app")[0]
    a.rt.exit_container(app.id, 0)
    await a.run_for(4)
    st = a.status("u1")
    assert st["phase"] == "Succeeded"  # the sidecar's kill is not the pod's outcome
    assert a.rt.running("u1") == []
    await a.loops.stop()


@aio
async def test_https_hook_to_a_plain_http_server_falls_back_to_http() -> None:
    from aiohttp import web

    from nodeagent.pods.handlers import Actions, Target
    from nodeagent.pods.hooks import Hooks
    from nodeagent.runtime.fake import FakeRuntime
    hits: list[str] = []

    async def echo(r: web.Request) -> web.Response:
        hits.append(r.query.get("msg", ""))
        return web.Response(status=404)  # a hook does not care about the status
    app = web.Application()
    app.router.add_get("/echo", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    rt = FakeRuntime()
    rt.dial = True
    clock = FakeClock()
    hooks = Hooks(Actions(rt), clock)
    pod = mkpod("web", "u1")
    try:
        failed = await hooks.run(pod, box(), {"httpGet": {
            "path": "/echo?msg=poststart", "port": port, "scheme": "HTTPS"}},
            Target(box(), "cid", "127.0.0.1"))
        assert failed is None and hits == ["poststart"]
        refused = await hooks.run(pod, box(), {"httpGet": {"path": "/", "port": free_port()}},
                                  Target(box(), "cid", "127.0.0.1"))
        assert refused is not None and "connection refused" in refused
        assert refused.startswith('HTTP lifecycle hook (/) for Container "c" in Pod '
                                  '"web_ns(u1)" failed - error: ')
    finally:
        await hooks.actions.close()
        await runner.cleanup()


@aio
async def test_what_is_not_done_is_refused_naming_the_field() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("sig", "u1", containers=[box(lifecycle={"stopSignal": "SIGUSR1"})]),
           mkpod("rules", "u2", containers=[box(restartPolicy="OnFailure")]))
    await a.run_for(3)
    assert a.rt.running() == []
    for uid, field in (("u1", "lifecycle.stopSignal"), ("u2", "restartPolicy OnFailure")):
        waiting = a.cstatus(uid)["state"]["waiting"]
        assert waiting["reason"] == "CreateContainerConfigError" and field in waiting["message"]
    messages = [w["message"] for w in a.warnings() if w["reason"] == "Failed"]
    assert any("lifecycle.stopSignal" in m for m in messages)
    await a.loops.stop()
