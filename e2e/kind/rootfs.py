"""Debian root filesystems made with debootstrap, cached as tars under
~/.cache/nodepulse/kind, and images built from a root filesystem's own packages.

No registry is reachable here, so every base image the kind tests use starts as a
`debootstrap --variant=minbase` of Debian bookworm from the mirror apt already uses,
plus named packages. The tar's name carries a hash of what went into it, so a second
run (same suite, packages and mirror) builds nothing.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from nodepulse_dev import build

SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def cache_dir() -> Path:
    return build.cache_root() / "kind"


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror apt uses for SUITE (deb822 .sources or one-line .list)."""
    texts = [p.read_text() for p in sorted(apt_dir.glob("sources.list.d/*.sources"))]
    for stanza in "\n\n".join(texts).split("\n\n"):
        fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
        if SUITE in fields.get("Suites", "").split() and "main" in fields.get("Components", ""):
            return fields["URIs"].split()[0]
    lists = [apt_dir / "sources.list", *sorted(apt_dir.glob("sources.list.d/*.list"))]
    for line in "\n".join(p.read_text() for p in lists if p.exists()).splitlines():
        m = re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)", line.strip())
        if m and m.group(2) == SUITE and "main" in m.group(3).split():
            return m.group(1)
    return DEFAULT_MIRROR


def keep_only(out: Path, partial: Path) -> None:
    """Make the finished `partial` the cache entry `out` and drop older entries of the
    same kind (`<kind>-<hash>.tar`): each is hundreds of MB."""
    partial.rename(out)
    kind = out.name.rsplit("-", 1)[0]  # not a longer kind's: node-<hash>, node-nodepulse-<hash>
    for old in out.parent.glob(kind + "-*.tar"):
        if old != out and re.fullmatch(re.escape(kind) + r"-[0-9a-f]+\.tar", old.name):
            old.unlink(missing_ok=True)


# What a container never needs; dropped to keep the images small.
SLIM = ["usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
        "var/cache/apt", "var/lib/apt/lists", "var/log"]


def tar_path(name: str, packages: list[str], prepare_key: str = "") -> Path:
    """Where debootstrap's tar of `name` is cached (named by what makes it)."""
    key = hashlib.sha256("\n".join([SUITE, debian_mirror(), *sorted(packages), prepare_key,
                                    *SLIM]).encode()).hexdigest()[:12]
    return cache_dir() / f"rootfs-{name}-{key}.tar"


def debootstrap(name: str, packages: list[str], *, log: Callable[[str], None] = print,
                prepare: Callable[[Path], None] | None = None, prepare_key: str = "") -> Path:
    """A tar of SUITE's minbase plus `packages`, made once. `prepare` may change the
    tree before it is packed (its `prepare_key` names what it does, for the cache)."""
    out = tar_path(name, packages, prepare_key)
    if out.exists():
        return out
    with build.lock_for(out):
        if not out.exists():
            _debootstrap(name, packages, out, log, prepare)
    return out


def _debootstrap(name: str, packages: list[str], out: Path, log: Callable[[str], None],
                 prepare: Callable[[Path], None] | None) -> None:
    mirror = debian_mirror()
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap not found: install the apt package debootstrap")
    debs = cache_dir() / "debs"  # packages shared by every rootfs (debootstrap's cache)
    debs.mkdir(exist_ok=True)
    started = time.monotonic()
    log(f"debootstrap {SUITE} {name} (once; cached as {out})")
    with tempfile.TemporaryDirectory(prefix=f"rootfs-{name}-", dir=out.parent) as tmp, \
            build.lock_for(debs):  # one debootstrap at a time writes the shared packages
        tree = Path(tmp) / "tree"
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
             f"--cache-dir={debs}", SUITE, str(tree), mirror],
            capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            tail = (Path(tree / "debootstrap/debootstrap.log").read_text()[-3000:]
                    if (tree / "debootstrap/debootstrap.log").exists() else proc.stderr[-3000:])
            raise RuntimeError(f"debootstrap of {name} from {mirror} failed "
                               f"({proc.returncode}):\n{tail}")
        for path in SLIM:
            for child in (tree / path).glob("*"):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        if prepare:
            prepare(tree)
        partial = out.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(tree), "--numeric-owner", "-cf", str(partial), "."],
                       check=True, timeout=600)
        keep_only(out, partial)
    log(f"debootstrap {name}: {time.monotonic() - started:.0f} s")
