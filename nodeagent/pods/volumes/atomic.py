"""Writing a set of files into a volume so that a running container sees the old set
or the new one, never a mix: the kubelet's layout.

    <volume>/..<time>.<hash>/key      the files of one version
    <volume>/..data -> ..<time>.<hash>  swapped by rename(2), which is atomic
    <volume>/key -> ..data/key         what the container opens

The version's name ends with a hash of its content (paths, bytes, modes, owners), so a
write whose content is what `..data` already holds does nothing, even after an agent
restart, and reading the old files is never needed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DATA = "..data"
_DATA_TMP = "..data_tmp"


@dataclass(frozen=True)
class File:
    data: bytes
    mode: int  # permission bits, e.g. 0o644
    uid: int | None = None  # owner (a service account token's, when all containers
    # run as one user); None: the agent's


class PayloadError(ValueError):
    """A path in the payload cannot be written (absolute, `..`, or clashing)."""


def check_path(path: str) -> None:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", "..") for p in parts) \
            or parts[0].startswith(".."):
        raise PayloadError(f"invalid path {path!r}: must be relative, without '..' "
                           "and not start with '..'")


def payload_hash(payload: Mapping[str, File], gid: int | None) -> str:
    h = hashlib.sha256()
    h.update(f"gid={gid}\0".encode())
    for path in sorted(payload):
        f = payload[path]
        h.update(f"{path}\0{f.mode:o}\0{f.uid}\0{len(f.data)}\0".encode())
        h.update(f.data)
    return h.hexdigest()[:16]


def current_version(target: Path) -> str | None:
    """The name of the version `..data` points to (None: nothing written yet)."""
    try:
        return os.readlink(target / DATA)
    except OSError:
        return None


def write(target: Path, payload: Mapping[str, File], *, now: dt.datetime,
          gid: int | None = None) -> bool:
    """Make `target` hold exactly `payload` (path -> File); `gid` (the pod's fsGroup)
    owns every file, which is also made group-readable. False when it already did."""
    for path in payload:
        check_path(path)
    digest = payload_hash(payload, gid)
    old = current_version(target)
    if old is not None and old.endswith("." + digest):
        return False
    target.mkdir(parents=True, exist_ok=True)
    version = f"..{now.strftime('%Y_%m_%d_%H_%M_%S')}.{digest}"
    staging = target / version
    if staging.exists():  # left by a write that was cut short
        shutil.rmtree(staging)
    staging.mkdir(mode=0o755)
    os.chmod(staging, 0o755)
    for path, f in payload.items():
        full = staging / path
        full.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(f.data)
        os.chmod(full, f.mode & 0o7777)
        if f.uid is not None:
            os.chown(full, f.uid, -1)
    tmp = target / _DATA_TMP
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(version, tmp)
    os.rename(tmp, target / DATA)  # the swap: the container sees the new version now
    visible = {p.split("/", 1)[0] for p in payload}
    for name in visible:
        link = target / name
        if not link.is_symlink():
            if link.exists():
                raise PayloadError(f"{name}: exists in the volume and is not ours")
            os.symlink(f"{DATA}/{name}", link)
    for entry in os.scandir(target):
        if entry.name.startswith(".."):
            if entry.name not in (DATA, version) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)  # older versions
        elif entry.name not in visible and entry.is_symlink():
            os.unlink(entry.path)  # keys that are gone
    if gid is not None:
        set_group(target, gid, read_only=True)
    return True


RW_MASK, RO_MASK, EXEC_MASK = 0o660, 0o440, 0o110


def set_group(root: Path, gid: int, *, read_only: bool) -> None:
    """The kubelet's fsGroup ownership: every entry's group becomes `gid`; files get
    group (and owner) read, and write unless `read_only`; directories also get
    search and the setgid bit, so files created later inherit the group."""
    mask = RO_MASK if read_only else RW_MASK
    for dirpath, dirnames, filenames in os.walk(root):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for path in [dirpath, *(os.path.join(dirpath, n) for n in [*filenames, *links])]:
            os.lchown(path, -1, gid)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            bits = mask | (0o2000 | EXEC_MASK if stat.S_ISDIR(st.st_mode) else 0)
            os.chmod(path, (st.st_mode & 0o7777) | bits)
