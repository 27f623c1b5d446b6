"""Restart safety of the process runtime with a real agent process: an "agent" (a
separate Python process using ProcessRuntime) starts pods and is killed with SIGKILL;
a new runtime on the same state dir adopts every running container, creates no
duplicates, still learns exit codes of processes it never parented, and stops them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from nodeagent.runtime import ContainerState
from nodeagent.runtime.process import ANNOTATION_PID, ProcessRuntime

AGENT = textwrap.dedent('''
    import asyncio, json, sys
    from nodeagent.runtime import ContainerConfig, SandboxConfig
    from nodeagent.runtime.process import ProcessRuntime

    async def main(state, n):
        rt = ProcessRuntime(state)
        out = {}
        for i in range(n):
            pod = {"metadata": {"name": f"p{i}", "namespace": "e2e", "uid": f"uid-{i}"},
                   "spec": {"containers": [{"name": "main", "image": "localhost/busybox:1",
                                            "command": ["sleep", "3600"]}]}}
            sc = SandboxConfig.from_pod(pod)
            sid = await rt.run_sandbox(sc)
            cid = await rt.create_container(
                sid, ContainerConfig.from_pod(pod, pod["spec"]["containers"][0]), sc)
            await rt.start_container(cid)
            out[f"uid-{i}"] = cid
        print(json.dumps(out), flush=True)
        await asyncio.Event().wait()   # run until killed

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
''')


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _sleepers(state: Path) -> list[int]:
    """Wrapper processes of this state dir (their argv names the state dir)."""
    needle = str(state).encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmd and b"sleep" in cmd and _alive(int(d.name)):
                out.append(int(d.name))
    return out


def test_sigkilled_agent_is_adopted_without_duplicates(tmp_path: Path) -> None:
    state = tmp_path / "state"
    n = 5
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(state), str(n)],
                             stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert agent.stdout is not None
        started: dict[str, str] = json.loads(agent.stdout.readline())
        assert len(started) == n
        agent.send_signal(signal.SIGKILL)
        agent.wait(30)
        wrappers = sorted(_sleepers(state))
        assert len(wrappers) == n
        # one container ends while no agent runs at all: its wrapper records the code
        orphan = json.loads((state / "containers" / f"{started['uid-4']}.json").read_text())
        opid = int(orphan["pid"])
        os.kill(int(Path(f"/proc/{opid}/task/{opid}/children").read_text().split()[0]),
                signal.SIGTERM)
        exit_file = state / "containers" / f"{started['uid-4']}.exit"
        deadline = time.monotonic() + 10
        while not (exit_file.exists() and exit_file.read_text().strip()):
            assert time.monotonic() < deadline, "the wrapper never recorded the exit code"
            time.sleep(0.05)
        wrappers = [w for w in wrappers if w != opid]

        async def adopt() -> None:
            rt = ProcessRuntime(state)  # the lock died with the agent
            try:
                listed = await rt.relist()
                by_uid = {c.pod_uid: c for c in listed.containers}
                assert {u: c.id for u, c in by_uid.items()} == started
                ended = by_uid["uid-4"]
                assert (ended.state, ended.exit_code) == (ContainerState.EXITED, 143)
                running = {u: c for u, c in by_uid.items() if u != "uid-4"}
                assert all(c.state == ContainerState.RUNNING for c in running.values())
                assert sorted(int(c.annotations[ANNOTATION_PID])
                              for c in running.values()) == wrappers
                assert len(listed.sandboxes) == n
                assert sorted(_sleepers(state)) == wrappers  # nothing new was started

                # a process the new runtime never parented: its exit code still arrives
                victim = running["uid-0"]
                wpid = int(victim.annotations[ANNOTATION_PID])
                child = int(Path(f"/proc/{wpid}/task/{wpid}/children").read_text().split()[0])
                os.kill(child, signal.SIGKILL)
                assert await rt.wait_container(victim.id, 30)
                deadline = time.monotonic() + 10
                c = None
                while time.monotonic() < deadline:  # within two 1 s relist periods
                    c = next(x for x in (await rt.relist()).containers if x.id == victim.id)
                    if c.state == ContainerState.EXITED:
                        break
                    await asyncio.sleep(0.1)
                assert c is not None and (c.state, c.exit_code) == (ContainerState.EXITED, 137)

                # adopted containers stop on request (SIGTERM to their group)
                for u in ("uid-1", "uid-2"):
                    await rt.stop_container(running[u].id, 10)
                st = {u: (await rt.pod_status(u)).containers[0] for u in ("uid-1", "uid-2")}
                assert {u: c.exit_code for u, c in st.items()} == {"uid-1": 143, "uid-2": 143}
            finally:
                for sb in (await rt.relist()).sandboxes:
                    await rt.remove_sandbox(sb.id)
                await rt.close()

        asyncio.run(adopt())
        assert _sleepers(state) == []
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(30)
        for pid in _sleepers(state):  # only if an assertion failed midway
            os.killpg(pid, signal.SIGKILL)
