"""The processes a test started: whether one still lives, its environment, finding
them by marker (every container the tests run carries NP_E2E=<marker>), stopping one."""

from __future__ import annotations

import contextlib
from pathlib import Path


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


