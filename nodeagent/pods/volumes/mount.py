"""The one thing volumes need from the host's mount table: tmpfs for `emptyDir` with
`medium: Memory`, and taking mounts down before a pod's volume folder is removed.

`HostMounter` calls mount(2) and umount2(2) directly (the agent must hold
CAP_SYS_ADMIN: it runs containers, so as root it does); tests use a fake.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

MNT_DETACH = 2


class Mounter(Protocol):
    def mount_tmpfs(self, path: str, size: int | None) -> None:
        """A tmpfs at `path` (an existing folder), at most `size` bytes. OSError when
        the agent may not mount."""

    def unmount(self, path: str) -> None:
        """Lazily (MNT_DETACH): containers still holding it keep it until they end."""

    def mounts_under(self, path: str) -> list[str]:
        """Mount points at or below `path`, deepest first."""


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as \\040-style octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


class HostMounter:
    def __init__(self, mountinfo: str = "/proc/self/mountinfo") -> None:
        self.mountinfo = mountinfo
        self._libc: Any = None

    def mount_tmpfs(self, path: str, size: int | None) -> None:
        options = f"mode=0777,size={size}" if size else "mode=0777"
        self._call("mount", f"mount tmpfs on {path}", b"tmpfs", os.fsencode(path), b"tmpfs",
                   0, options.encode())

    def unmount(self, path: str) -> None:
        self._call("umount2", f"unmount {path}", os.fsencode(path), MNT_DETACH)

    def _call(self, function: str, what: str, *args: Any) -> None:
        """libc's `function`; OSError naming `what` when it fails. ctypes and libc are
        loaded at the first call: an agent of virtual nodes mounts nothing."""
        import ctypes
        import ctypes.util
        if self._libc is None:
            self._libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                                     use_errno=True)
        if getattr(self._libc, function)(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mounts_under(self, path: str) -> list[str]:
        root = os.path.realpath(path)
        found = []
        for line in Path(self.mountinfo).read_text().splitlines():
            fields = line.split(" ")
            if len(fields) > 4:
                point = _unescape(fields[4])
                if point == root or point.startswith(root.rstrip("/") + "/"):
                    found.append(point)
        return sorted(set(found), key=lambda p: p.count("/"), reverse=True)
