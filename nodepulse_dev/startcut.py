"""What containerd leaves of a container whose start its own restart cut short.

    python -m nodepulse_dev.startcut [--trials 30] [--build debian|built]

On a private containerd: each trial makes a sandbox and a container (`sleep 1`), calls
StartContainer and, 0-80 ms into the call, stops containerd (SIGTERM, as a restart
does), starts it again, and reads the container's state; one left created is then
started a second time and read again. Prints each trial and a tally. The agent's rule
for a container created and never started (docs/pods.md, Lifecycle) rests on it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nodeagent.runtime import (
    ContainerConfig,
    ContainerRuntimeError,
    ContainerState,
    SandboxConfig,
    Unavailable,
    make_runtime,
)
from nodeagent.runtime.base import Runtime
from nodepulse_dev.containerd import BUILDS, Containerd, start_containerd
from nodepulse_dev.images import BUSYBOX_IMAGE

T = TypeVar("T")


def _pod(i: int) -> dict[str, Any]:
    return {"metadata": {"name": f"cut-{i}", "namespace": "startcut", "uid": f"uid-cut-{i}"},
            "spec": {"hostNetwork": True, "containers": [
                {"name": "main", "image": BUSYBOX_IMAGE, "command": ["sleep", "1"]}]}}


async def _when_up(call: Callable[[], Awaitable[T]]) -> T:
    for _ in range(300):
        try:
            return await call()
        except Unavailable:
            await asyncio.sleep(0.1)
    raise RuntimeError("containerd did not answer again within 30 s")


async def _state(rt: Runtime, uid: str, cid: str) -> str:
    st = await _when_up(lambda: rt.pod_status(uid))
    c = next((c for c in st.containers if c.id == cid), None)
    if c is None:
        return "gone"
    if c.state == ContainerState.EXITED:
        return f"exited {c.exit_code} {c.reason}"
    return c.state.name.lower()


async def _trial(rt: Runtime, ctd: Containerd, i: int) -> str:
    pod = _pod(i)
    sc = SandboxConfig.from_pod(pod, log_root=str(ctd.base / "pod-logs"))
    sid = await _when_up(lambda: rt.run_sandbox(sc))
    cid = await rt.create_container(
        sid, ContainerConfig.from_pod(pod, pod["spec"]["containers"][0]), sc)
    delay = random.uniform(0.0, 0.08)

    async def stop_containerd() -> None:
        await asyncio.sleep(delay)
        await asyncio.to_thread(ctd.kill_daemon)
    stopping = asyncio.create_task(stop_containerd())
    try:
        await rt.start_container(cid)
        start = "start returned"
    except ContainerRuntimeError:
        start = "start cut short"
    await stopping
    await asyncio.to_thread(ctd.start_daemon)
    await asyncio.sleep(1.5)  # `sleep 1` ends, if it ran
    outcome = f"{start}, then {await _state(rt, sc.uid, cid)}"
    if outcome.endswith("created"):
        try:
            await rt.start_container(cid)
            again = "started again"
        except ContainerRuntimeError:
            again = "refused a second start"
        await asyncio.sleep(1.5)
        outcome += f"; {again}, then {await _state(rt, sc.uid, cid)}"
    await rt.stop_sandbox(sid)
    await rt.remove_sandbox(sid)
    return outcome


async def _run(ctd: Containerd, trials: int) -> Counter[str]:
    rt = make_runtime("cri", ctd.endpoint)
    tally: Counter[str] = Counter()
    try:
        for i in range(trials):
            outcome = await _trial(rt, ctd, i)
            print(f"{i:3d} {outcome}", flush=True)
            tally[outcome] += 1
    finally:
        await rt.close()
    return tally


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nodepulse_dev.startcut",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--build", choices=BUILDS, default="debian")
    args = parser.parse_args(argv)
    ctd = start_containerd(build=args.build, cni=False)
    try:
        tally = asyncio.run(_run(ctd, args.trials))
    finally:
        ctd.stop()
    print(f"\n{args.trials} trials, containerd build {args.build!r}:")
    for outcome, n in tally.most_common():
        print(f"{n:4d}  {outcome}")


if __name__ == "__main__":
    main()
