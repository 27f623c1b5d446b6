"""Small helpers the e2e modules share: waiting for a condition, and finding the
processes a test started (every container the tests run carries NP_E2E=<marker>)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from e2e.cluster.cluster import free_port

__all__ = ["alive", "environ", "eventually", "first_seen", "free_port", "marked",
           "stop_process"]

T = TypeVar("T")
K = TypeVar("K")


def eventually(pred: Callable[[], T | None], what: str, timeout: float = 60.0,
               every: float = 0.25,
               tolerate: tuple[type[BaseException], ...] = ()) -> T:
    """Poll `pred` until it returns something truthy, and return that. Exceptions of the
    `tolerate` types count as "not yet" (e.g. while the control plane comes back)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            got = pred()
            if got:
                return got
        except tolerate as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}"
                                 + (f" (last error: {last})" if last else ""))
        time.sleep(every)


def first_seen(keys: Iterable[K], holds: Callable[[K], bool], what: str,
               timeout: float = 60.0,
               tolerate: tuple[type[BaseException], ...] = ()) -> dict[K, float]:
    """Poll until `holds(key)` has been true once for every key (`eventually`, with
    its `tolerate`); when (wall clock) each was first seen to hold."""
    seen: dict[K, float] = {}
    pending = list(keys)

    def all_seen() -> bool:
        for k in pending:
            if k not in seen and holds(k):
                seen[k] = time.time()
        return len(seen) == len(pending)
    eventually(all_seen, what, timeout, tolerate=tolerate)
    return seen


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def environ(pid: int) -> dict[bytes, bytes]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def marked(value: str) -> list[int]:
    """Live processes whose environment has NP_E2E=<value>: the sweep that proves
    nothing a test started is left."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if environ(int(d.name)).get(b"NP_E2E") == value.encode() and alive(int(d.name)):
                    out.append(int(d.name))
    return out


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    """SIGTERM a process a test started, SIGKILL it if it has not exited in `timeout`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
