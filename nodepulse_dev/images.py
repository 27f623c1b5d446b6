"""Container images built locally, since no registry is reachable.

An OCI image tar is an OCI layout (oci-layout, index.json, blobs/sha256/...):
one gzip layer with the rootfs, a config JSON naming the layer's uncompressed
digest in rootfs.diff_ids, and a manifest tying the two. Everything is written
deterministically (fixed mtimes, owners, gzip header), so the same inputs give
the same image digest on every run.

Images:
- PAUSE_IMAGE: the sandbox image, one static C program (/pause) that sleeps until
  SIGTERM/SIGINT and reaps children. Built with `gcc -static -Os -s`.
- BUSYBOX_IMAGE: busybox as upstream releases it (built once from the source Debian's
  archive carries, static; see upstream_busybox) with a symlink per applet, so `sh`,
  `sleep`, `nc`, `cat`... work; default command `sh`.

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
import tempfile
import urllib.request
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


def build_oci_tar(out: Path, rootfs: Rootfs | bytes, *, ref: str,
                  entrypoint: list[str] | None = None, cmd: list[str] | None = None,
                  env: list[str] | None = None, user: str | None = None) -> str:
    """Write an OCI layout tar for one linux/amd64 image to `out`; return the
    manifest digest. `ref` is the tag recorded in index.json (the part after ':').
    `rootfs` is the layer's files, or the layer itself (an uncompressed tar)."""
    layer = rootfs if isinstance(rootfs, bytes) else _layer(rootfs)
    gz = gzip.compress(layer, compresslevel=6, mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            **({"Entrypoint": entrypoint} if entrypoint else {}),
            **({"Cmd": cmd} if cmd else {}),
            **({"User": user} if user else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [_sha(layer)]},
        "history": [{"created_by": "nodepulse nodepulse_dev/images.py"}],
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


def pause_tar_path(cache: Path = CACHE) -> Path:
    return cache / f"pause-{hashlib.sha256(PAUSE_C.encode()).hexdigest()[:12]}.tar"


def build_pause_tar(cache: Path = CACHE) -> Path:
    """Compile the pause program statically and wrap it as PAUSE_IMAGE."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found: install the apt packages gcc and libc6-dev")
    out = pause_tar_path(cache)
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    src, binary = out.with_suffix(".c"), out.with_suffix("")
    src.write_text(PAUSE_C)
    res = subprocess.run([gcc, "-static", "-Os", "-s", "-o", str(binary), str(src)],
                         capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"gcc -static failed for the pause image (is libc6-dev "
                           f"installed?): {res.stderr.strip()}")
    rootfs = Rootfs(files={"pause": (binary.read_bytes(), 0o755)})
    build_oci_tar(out, rootfs, ref=_split(PAUSE_IMAGE)[1], entrypoint=["/pause"])
    return out


# Upstream busybox, not Debian's busybox-static: Debian's ash drops environment variables
# whose names are not shell identifiers (`data-1`), which upstream's passes on, and the
# Kubernetes e2e specs read such variables (envFrom keys) back with `sh -c env`. The
# source is the .orig tarball of Debian's busybox package (upstream's release, as Debian
# archives it), checked against its hash.
BUSYBOX_VERSION = "1.37.0"
BUSYBOX_SHA256 = "3311dff32e746499f4df0d5df04d7eb396382d7e108bb9250e7b519b837043a4"


def debian_mirror() -> str:
    """The Debian archive apt uses here (its sources lists)."""
    lists = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for path in lists + [Path("/etc/apt/sources.list")]:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            uris = (words[1:] if words[:1] == ["URIs:"] else
                    [w for w in words[1:] if "://" in w][:1] if words[:1] == ["deb"] else [])
            for uri in uris:
                if uri.rstrip("/").endswith("/debian"):
                    return uri.rstrip("/")
    raise RuntimeError("no Debian archive in apt's sources lists (/etc/apt/sources.list.d): "
                       "needed to fetch busybox's source")


def busybox_path(cache: Path = CACHE) -> Path:
    return cache / f"busybox-{BUSYBOX_VERSION}" / "busybox"


def upstream_busybox(cache: Path = CACHE) -> Path:
    """Upstream busybox BUSYBOX_VERSION, static (its default config, with busybox's own
    passwd/group code, so no NSS library is needed in the image), built once and cached.
    About a minute on 2 cores; Go builds' lock keeps it from running beside one."""
    from nodepulse_dev import build  # the build lock; images is imported by build's users

    out = busybox_path(cache)
    if out.exists():
        return out
    with build._build_lock():
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        name = f"busybox_{BUSYBOX_VERSION}.orig.tar.bz2"
        url = f"{debian_mirror()}/pool/main/b/busybox/{name}"
        with urllib.request.urlopen(url, timeout=120) as answer:
            source = answer.read()
        if hashlib.sha256(source).hexdigest() != BUSYBOX_SHA256:
            raise RuntimeError(f"{url}: sha256 {hashlib.sha256(source).hexdigest()}, "
                               f"expected {BUSYBOX_SHA256}")
        with tempfile.TemporaryDirectory(prefix="busybox-", dir=out.parent) as tmp:
            with tarfile.open(fileobj=io.BytesIO(source), mode="r:bz2") as tar:
                tar.extractall(tmp, filter="data")
            src = Path(tmp) / f"busybox-{BUSYBOX_VERSION}"
            subprocess.run(["make", "defconfig"], cwd=src, check=True, capture_output=True)
            config = (src / ".config").read_text()
            config = config.replace("# CONFIG_STATIC is not set", "CONFIG_STATIC=y")
            # tc does not build against current kernel headers (upstream's own releases
            # leave it out too)
            config = config.replace("CONFIG_TC=y", "# CONFIG_TC is not set")
            (src / ".config").write_text(config)
            res = subprocess.run(["make", f"-j{os.cpu_count() or 1}"], cwd=src,
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"building busybox {BUSYBOX_VERSION} failed: "
                                   f"{res.stderr[-2000:]}")
            partial = out.with_suffix(".partial")
            shutil.copy(src / "busybox", partial)
            partial.rename(out)  # only a finished build is ever seen as cached
    return out


def busybox_rootfs(busybox: Path | None = None) -> Rootfs:
    """Static busybox (upstream_busybox by default) with a symlink per applet, and a root
    user."""
    busybox = busybox or upstream_busybox()
    data = busybox.read_bytes()
    # the image holds nothing else: a dynamic binary would not run in it
    if b"/lib64/ld-linux" in data[:4096]:
        raise RuntimeError(f"{busybox} is dynamically linked")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
    rootfs = Rootfs(files={"bin/busybox": (data, 0o755)},
                    symlinks={f"bin/{a}": "busybox" for a in applets if a != "busybox"},
                    dirs={"tmp", "etc", "proc", "sys", "dev", "root"})
    rootfs.files["etc/passwd"] = (b"root:x:0:0:root:/root:/bin/sh\n", 0o644)
    rootfs.files["etc/group"] = (b"root:x:0:\n", 0o644)
    return rootfs


def build_busybox_tar(cache: Path = CACHE, busybox: Path | None = None) -> Path:
    """Wrap static busybox (upstream_busybox by default) as BUSYBOX_IMAGE, one symlink
    per applet."""
    busybox = busybox or upstream_busybox(cache)
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
