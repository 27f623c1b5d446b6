"""A slow disk for one folder: a FUSE filesystem that passes every operation through to
a backing folder and, while it is told to be slow, sleeps before each one, as a disk
that takes seconds per request does (an overloaded network volume, a dying drive).

    disk = SlowDisk(backing, mountpoint).mount()   # a process of its own
    disk.slow(0.5)       # every operation now waits half a second first
    disk.fast()          # no waiting again
    disk.unmount()       # lazily unmounted, its process stopped by PID

The delay is read from a control file beside the mount (its mtime is checked on each
operation), so the process needs no signal handling inside libfuse's loop. Needs
/dev/fuse, root (the mount is made without fusermount) and libfuse3 with mfusepy
(bench extras); `available()` says what is missing.

Run as a program: python -m e2e.harness.slowdisk BACKING MOUNTPOINT CONTROL
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MNT_DETACH = 2


def available() -> str | None:
    """None if a slow disk can be made here, else why not."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist"
    if os.geteuid() != 0:
        return "mounting a FUSE filesystem without fusermount needs root"
    if ctypes.util.find_library("fuse3") is None and ctypes.util.find_library("fuse") is None:
        return "libfuse is not installed (Debian package libfuse3-3)"
    try:
        import mfusepy  # noqa: F401
    except ImportError:
        return "the Python package mfusepy is not installed (pip install -e '.[bench]')"
    return None


class SlowDisk:
    def __init__(self, backing: Path, mountpoint: Path) -> None:
        self.backing, self.mountpoint = backing, mountpoint
        self.control = mountpoint.parent / f".{mountpoint.name}.delay"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = mountpoint.parent / f"{mountpoint.name}.slowdisk.log"
        self.delay = 0.0

    def mount(self, timeout: float = 20.0) -> SlowDisk:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.control.write_text("0")
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "e2e.harness.slowdisk", str(self.backing),
                 str(self.mountpoint), str(self.control)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=Path(__file__).resolve().parents[2])
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.unmount()
                raise RuntimeError(f"the slow disk did not mount on {self.mountpoint}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        return self

    def slow(self, delay: float) -> None:
        """Every operation waits `delay` seconds first, from now on."""
        self.delay = delay
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(repr(delay))
        os.replace(tmp, self.control)

    def fast(self) -> None:
        self.slow(0.0)

    def unmount(self) -> None:
        """Lazily (a container or the agent may still hold a file open); the process
        ends with the mount, else it is stopped by PID."""
        self.fast()
        libc = ctypes.CDLL(None, use_errno=True)
        if os.path.ismount(self.mountpoint) and \
                libc.umount2(str(self.mountpoint).encode(), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount {self.mountpoint}: {os.strerror(err)}")
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()


# ---- the filesystem (in its own process)
def _serve(backing: str, mountpoint: str, control: str) -> None:
    import mfusepy as fuse

    class Delay:
        """The control file's delay, read again when its mtime changes."""

        def __init__(self) -> None:
            self.mtime = -1.0
            self.value = 0.0
            self.lock = threading.Lock()

        def wait(self) -> None:
            try:
                mtime = os.stat(control).st_mtime
            except OSError:
                mtime = -1.0
            with self.lock:
                if mtime != self.mtime:
                    self.mtime = mtime
                    try:
                        self.value = float(Path(control).read_text() or 0)
                    except (OSError, ValueError):
                        self.value = 0.0
                value = self.value
            if value > 0:
                time.sleep(value)

    delay = Delay()

    def real(path: str) -> str:
        return os.path.join(backing, path.lstrip("/"))

    def wrapped(fn: Any) -> Any:
        def call(self: Any, path: str, *args: Any) -> Any:
            delay.wait()
            try:
                return fn(self, path, *args)
            except OSError as e:
                raise fuse.FuseOSError(e.errno or errno.EIO) from None
        return call

    class Passthrough(fuse.Operations):
        use_ns = True

        @wrapped
        def access(self, path: str, mode: int) -> int:
            if not os.access(real(path), mode):
                raise fuse.FuseOSError(errno.EACCES)
            return 0

        @wrapped
        def chmod(self, path: str, mode: int) -> int:
            os.chmod(real(path), mode)
            return 0

        @wrapped
        def chown(self, path: str, uid: int, gid: int) -> int:
            os.lchown(real(path), uid, gid)
            return 0

        @wrapped
        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        @wrapped
        def flush(self, path: str, fh: int) -> int:
            return 0

        @wrapped
        def fsync(self, path: str, datasync: int, fh: int) -> int:
            (os.fdatasync if datasync else os.fsync)(fh)
            return 0

        @wrapped
        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.lstat(real(path))
            out = {k: getattr(st, k) for k in (
                "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_dev",
                "st_blocks", "st_rdev")}
            out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns,
                       st_ctime=st.st_ctime_ns)
            return out

        @wrapped
        def link(self, target: str, source: str) -> int:
            os.link(real(source), real(target))
            return 0

        @wrapped
        def mkdir(self, path: str, mode: int) -> int:
            os.mkdir(real(path), mode)
            return 0

        @wrapped
        def mknod(self, path: str, mode: int, dev: int) -> int:
            os.mknod(real(path), mode, dev)
            return 0

        @wrapped
        def open(self, path: str, flags: int) -> int:
            return os.open(real(path), flags)

        @wrapped
        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        @wrapped
        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(real(path))]

        @wrapped
        def readlink(self, path: str) -> str:
            return os.readlink(real(path))

        @wrapped
        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        @wrapped
        def rename(self, old: str, new: str) -> int:
            os.rename(real(old), real(new))
            return 0

        @wrapped
        def rmdir(self, path: str) -> int:
            os.rmdir(real(path))
            return 0

        @wrapped
        def statfs(self, path: str) -> dict[str, int]:
            st = os.statvfs(real(path))
            return {k: getattr(st, k) for k in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                "f_files", "f_flag", "f_frsize", "f_namemax")}

        @wrapped
        def symlink(self, target: str, source: str) -> int:
            os.symlink(source, real(target))
            return 0

        @wrapped
        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(real(path), length)
            return 0

        @wrapped
        def unlink(self, path: str) -> int:
            os.unlink(real(path))
            return 0

        @wrapped
        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            if times is None:
                os.utime(real(path), follow_symlinks=False)
            else:
                os.utime(real(path), ns=times, follow_symlinks=False)
            return 0

        @wrapped
        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            return os.pwrite(fh, data, offset)

    # allow_other: containers (runc, the shims) open the volumes under this mount
    fuse.FUSE(Passthrough(), mountpoint, foreground=True, allow_other=True,
              default_permissions=True)


if __name__ == "__main__":
    _serve(*sys.argv[1:4])
