"""Probe cost: the agent's prober manager running every probe of N pods, each container
with a liveness and a readiness probe every second, against the fake runtime (exec
probes answer in memory: the prober's own cost) and real servers on loopback in another
process (httpGet, tcpSocket, grpc: the agent's side of each dial).

    .venv/bin/python -m bench.probes --pods 110                     # all four kinds, 30 s each
    .venv/bin/python -m bench.probes --pods 110 --kinds http --seconds 60

For each kind: probes run per second, CPU seconds of the agent process per second of
wall time (its share of one core), and probes per CPU-second (probes per second per
core). The servers' CPU is not counted (they run in a child process). Prints figures
only; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeagent.api.clock import RealClock  # noqa: E402
from nodeagent.pods.handlers import Actions  # noqa: E402
from nodeagent.pods.pleg import PodCache  # noqa: E402
from nodeagent.pods.probes import ProbeManager  # noqa: E402
from nodeagent.runtime import ContainerConfig, SandboxConfig  # noqa: E402
from nodeagent.runtime.fake import FakeRuntime  # noqa: E402

KINDS = ("exec", "http", "tcp", "grpc")


def probe(kind: str, http_port: int, grpc_port: int) -> dict[str, Any]:
    actions: dict[str, dict[str, Any]] = {
        "exec": {"exec": {"command": ["cat", "/tmp/healthy"]}},
        "http": {"httpGet": {"path": "/healthz", "port": http_port}},
        "tcp": {"tcpSocket": {"port": http_port}},
        "grpc": {"grpc": {"port": grpc_port}},
    }
    return {**actions[kind], "periodSeconds": 1, "timeoutSeconds": 1}


def pod(i: int, kind: str, http_port: int, grpc_port: int) -> dict[str, Any]:
    return {"metadata": {"name": f"probe-{i}", "namespace": "bench", "uid": f"probe-uid-{i}"},
            "spec": {"hostNetwork": True,
                     "containers": [{"name": "c", "image": "bench:1",
                                     "command": ["sleep", "3600"],
                                     "livenessProbe": probe(kind, http_port, grpc_port),
                                     "readinessProbe": probe(kind, http_port, grpc_port)}]}}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(kind: str, pods: int, seconds: float, http_port: int,
                  grpc_port: int) -> tuple[float, float, float]:
    """(probes per second, agent CPU share of one core, probes per CPU-second)."""
    clock = RealClock()
    rt = FakeRuntime(clock, host_ip="127.0.0.1")
    rt.dial = True  # the probes reach the servers on loopback
    cache = PodCache()
    specs = [pod(i, kind, http_port, grpc_port) for i in range(pods)]
    for p in specs:
        sc = SandboxConfig.from_pod(p)
        sid = await rt.run_sandbox(sc)
        cid = await rt.create_container(sid, ContainerConfig.from_pod(
            p, p["spec"]["containers"][0]), sc)
        await rt.start_container(cid)
        await cache.store(sc.uid, await rt.pod_status(sc.uid), None, clock.monotonic())
    changes = [0]

    def changed(uid: str) -> None:
        changes[0] += 1
    manager = ProbeManager(Actions(rt), cache, clock, host_ip="127.0.0.1", on_change=changed)
    for p in specs:
        manager.update(p)
    await asyncio.sleep(2.0)  # the first probes are spread over one period
    probes0, cpu0, t0 = manager.probes_run, cpu_seconds(), time.monotonic()
    await asyncio.sleep(seconds)
    probes, cpu, wall = (manager.probes_run - probes0, cpu_seconds() - cpu0,
                         time.monotonic() - t0)
    await manager.close()
    return probes / wall, cpu / wall, probes / cpu if cpu else float("inf")


# --- the servers (a child process) -------------------------------------------------------

async def serve(http_port: int, grpc_port: int) -> None:
    import grpc
    import grpc.aio
    from aiohttp import web

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")
    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", http_port, backlog=1024).start()

    def check(request: bytes, context: Any) -> bytes:
        return b"\x08\x01"  # SERVING
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)})])
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    print("serving", flush=True)
    await asyncio.Event().wait()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--serve", nargs=2, type=int, metavar=("HTTP_PORT", "GRPC_PORT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(*args.serve))
        return
    http_port, grpc_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.probes", "--serve",
                               str(http_port), str(grpc_port)], stdout=subprocess.PIPE,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        assert server.stdout is not None
        server.stdout.readline()  # "serving"
        print(f"{args.pods} pods, one container each with a liveness and a readiness probe "
              f"every 1 s ({2 * args.pods} probes/s asked), {args.seconds:g} s per kind, "
              f"{os.cpu_count()} CPUs")
        print(f"{'kind':6} {'probes/s':>9} {'agent CPU':>10} {'probes/s per core':>18}")
        for kind in args.kinds.split(","):
            rate, share, per_core = asyncio.run(measure(kind, args.pods, args.seconds,
                                                        http_port, grpc_port))
            print(f"{kind:6} {rate:9.1f} {share * 100:9.1f}% {per_core:18.0f}")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"peak RSS of the agent process: {peak:.0f} MiB")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
