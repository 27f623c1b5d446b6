"""Container images built locally, since no registry is reachable.

An OCI image tar is an OCI layout (oci-layout, index.json, blobs/sha256/...):
one gzip layer with the rootfs, a config JSON naming the layer's uncompressed
digest in rootfs.diff_ids, and a manifest tying the two. Everything is written
deterministically (fixed mtimes, owners, gzip header), so the same inputs give
the same image digest on every run.

Images:
- PAUSE_IMAGE: the sandbox image, one static C program (/pause) that sleeps until
  SIGTERM/SIGINT and reaps children. Built with `gcc -static -Os -s`.
- BUSYBOX_IMAGE: busybox-static (/bin/busybox) with a symlink per applet, so
  `sh`, `sleep`, `nc`, `cat`... work; default command `sh`.

`import_image` hands a tar to containerd with `ctr -n k8s.io images import
--base-name`, which makes it visible to CRI at once.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

PAUSE_IMAGE = "localhost/nodepulse/pause:1"
BUSYBOX_IMAGE = "localhost/nodepulse/busybox:1"

CACHE = Path(os.environ.get("NODEPULSE_CACHE", Path.home() / ".cache" / "nodepulse")) / "images"

PAUSE_C = r"""
/* Sandbox holder: keeps the pod's namespaces alive, reaps orphans, exits on TERM/INT. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { (void)sig; _exit(0); }
static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {}
}

int main(void) {
    struct sigaction stop = {0}, child = {0};
    stop.sa_handler = on_stop;
    child.sa_handler = on_child;
    child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    if (sigaction(SIGTERM, &stop, NULL) || sigaction(SIGINT, &stop, NULL) ||
        sigaction(SIGCHLD, &child, NULL))
        return 1;
    for (;;) pause();
}
"""


@dataclass
class Rootfs:
    """Files of one layer: path inside the image -> content, mode; plus symlinks."""

    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    symlinks: dict[str, str] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes | None = None, *, mode: int = 0o644,
             kind: bytes = tarfile.REGTYPE, linkname: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.mode, info.mtime, info.uid, info.gid, info.type = mode, 0, 0, 0, kind
    info.linkname = linkname
    if data is not None:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        tar.addfile(info)


def _layer(rootfs: Rootfs) -> bytes:
    """Uncompressed layer tar, entries sorted, parent folders first."""
    dirs = set(rootfs.dirs)
    for p in [*rootfs.files, *rootfs.symlinks]:
        parent = Path(p).parent
        while str(parent) not in (".", "/", ""):
            dirs.add(str(parent))
            parent = parent.parent
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            _tar_add(tar, d, mode=0o755, kind=tarfile.DIRTYPE)
        for p in sorted(rootfs.files):
            data, mode = rootfs.files[p]
            _tar_add(tar, p, data, mode=mode)
        for p in sorted(rootfs.symlinks):
            _tar_add(tar, p, mode=0o777, kind=tarfile.SYMTYPE, linkname=rootfs.symlinks[p])
    return buf.getvalue()


def build_oci_tar(out: Path, rootfs: Rootfs, *, ref: str, entrypoint: list[str] | None = None,
                  cmd: list[str] | None = None, env: list[str] | None = None) -> str:
    """Write an OCI layout tar for one linux/amd64 image to `out`; return the
    manifest digest. `ref` is the tag recorded in index.json (the part after ':')."""
    layer = _layer(rootfs)
    gz = gzip.compress(layer, compresslevel=6, mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            **({"Entrypoint": entrypoint} if entrypoint else {}),
            **({"Cmd": cmd} if cmd else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [_sha(layer)]},
        "history": [{"created_by": "nodepulse e2e/cluster/images.py"}],
    }
    config_b = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _sha(config_b), "size": len(config_b)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": _sha(gz), "size": len(gz)}],
    }
    manifest_b = json.dumps(manifest, sort_keys=True).encode()
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": _sha(manifest_b), "size": len(manifest_b),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"org.opencontainers.image.ref.name": ref},
        }],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _tar_add(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _tar_add(tar, "index.json", json.dumps(index, sort_keys=True).encode())
        _tar_add(tar, "blobs", mode=0o755, kind=tarfile.DIRTYPE)
        _tar_add(tar, "blobs/sha256", mode=0o755, kind=tarfile.DIRTYPE)
        for blob in (config_b, manifest_b, gz):
            _tar_add(tar, "blobs/sha256/" + _sha(blob).removeprefix("sha256:"), blob)
    tmp.replace(out)
    return _sha(manifest_b)


def _split(image: str) -> tuple[str, str]:
    name, _, tag = image.rpartition(":")
    return name, tag


def build_pause_tar(cache: Path = CACHE) -> Path:
    """Compile the pause program statically and wrap it as PAUSE_IMAGE."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found: install the apt packages gcc and libc6-dev")
    src_hash = hashlib.sha256(PAUSE_C.encode()).hexdigest()[:12]
    out = cache / f"pause-{src_hash}.tar"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    src, binary = cache / f"pause-{src_hash}.c", cache / f"pause-{src_hash}"
    src.write_text(PAUSE_C)
    res = subprocess.run([gcc, "-static", "-Os", "-s", "-o", str(binary), str(src)],
                         capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"gcc -static failed for the pause image (is libc6-dev "
                           f"installed?): {res.stderr.strip()}")
    rootfs = Rootfs(files={"pause": (binary.read_bytes(), 0o755)})
    build_oci_tar(out, rootfs, ref=_split(PAUSE_IMAGE)[1], entrypoint=["/pause"])
    return out


def busybox_rootfs(busybox: Path = Path("/bin/busybox")) -> Rootfs:
    """busybox-static (/bin/busybox) with a symlink per applet, and a root user."""
    if not busybox.exists():
        raise RuntimeError(f"{busybox} not found: install the apt package busybox-static")
    data = busybox.read_bytes()
    # busybox-static is a static binary; a dynamic one would not run in the image.
    if b"/lib64/ld-linux" in data[:4096]:
        raise RuntimeError(f"{busybox} is dynamically linked: install busybox-static")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
    rootfs = Rootfs(files={"bin/busybox": (data, 0o755)},
                    symlinks={f"bin/{a}": "busybox" for a in applets if a != "busybox"},
                    dirs={"tmp", "etc", "proc", "sys", "dev", "root"})
    rootfs.files["etc/passwd"] = (b"root:x:0:0:root:/root:/bin/sh\n", 0o644)
    rootfs.files["etc/group"] = (b"root:x:0:\n", 0o644)
    return rootfs


def build_busybox_tar(cache: Path = CACHE, busybox: Path = Path("/bin/busybox")) -> Path:
    """Wrap busybox-static as BUSYBOX_IMAGE, one symlink per applet."""
    out = cache / f"busybox-{file_hash(busybox)}.tar"
    if not out.exists():
        build_oci_tar(out, busybox_rootfs(busybox), ref=_split(BUSYBOX_IMAGE)[1], cmd=["sh"])
    return out


def file_hash(*paths: Path) -> str:
    """A short content hash of files (names cached image tars after their inputs)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes() if p.exists() else b"")
    return h.hexdigest()[:12]


def import_image(tar: Path, image: str, *, address: str, namespace: str = "k8s.io",
                 ctr: str = "ctr") -> None:
    """Import an OCI tar into a containerd (socket `address`) under the fully
    qualified name `image` (name:tag; the tag is the ref recorded in the tar)."""
    name, _ = _split(image)
    res = subprocess.run([ctr, "--address", address, "-n", namespace, "images", "import",
                          "--base-name", name, str(tar)],
                         capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"ctr images import of {tar} as {image} failed: "
                           f"{(res.stderr or res.stdout).strip()}")
    listed = subprocess.run([ctr, "--address", address, "-n", namespace, "images", "ls", "-q"],
                            capture_output=True, text=True, timeout=60).stdout.split()
    if image not in listed:
        raise RuntimeError(f"ctr imported {tar} but {image} is not listed (have: {listed})")


def tag_image(image: str, *names: str, address: str, namespace: str = "k8s.io",
              ctr: str = "ctr") -> None:
    """Give the imported `image` the other fully qualified `names` too."""
    res = subprocess.run([ctr, "--address", address, "-n", namespace, "images", "tag",
                          "--force", image, *names], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"ctr images tag {image} {' '.join(names)} failed: "
                           f"{(res.stderr or res.stdout).strip()}")


def build_all(cache: Path = CACHE) -> dict[str, Path]:
    """Image name -> OCI tar, built (or taken from the cache)."""
    return {PAUSE_IMAGE: build_pause_tar(cache), BUSYBOX_IMAGE: build_busybox_tar(cache)}
