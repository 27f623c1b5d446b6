"""The images the upstream node e2e tests run, built here (no registry is reachable)
and named as the tests expect them.

The names come from the pinned module's test/utils/image/manifest.go, so they follow
the Kubernetes pin. What each image holds:

- busybox, pause: this project's own images (nodepulse_dev/images.py), tagged with the
  upstream names; the upstream busybox is busybox too, the upstream pause a program
  that does what ours does.
- agnhost: the agnhost program built from the same module (test/images/agnhost), in a
  rootfs laid out as its Dockerfile lays it out (/agnhost, /agnhost-2, /localhost.crt
  and .key from porter/, /uploads, the user 1000 and the group 50000, /var/registry
  with the pause image under the tag "testing" for fake-registry-server), with
  busybox-static in place of Alpine's shell tools, and Debian's curl and bash with
  the libraries they load (the lifecycle hooks exec `sh -c "curl ..."` in it, the
  sidecar probe specs run `/bin/bash -c`). Alpine's bind-tools, iproute2, iperf and
  coredns are not there: a test that needs them fails, and docs/conformance.md says so.
- nonewprivs: the nnp program from the module (test/images/nonewprivs), setuid root
  in /usr/local/bin as its Dockerfile makes it, on busybox.
- nginx: Debian's nginx (the packages nginx and nginx-common, fetched with `apt-get
  download`, not installed) with the libraries it loads, on busybox; it serves a page
  on port 80 in the foreground, as the upstream image does.
"""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

from nodepulse_dev import build, images
from nodepulse_dev.images import CACHE, Rootfs, build_oci_tar, file_hash

MODULE_DIR = "k8s.io/kubernetes@{version}"


def module_source() -> Path:
    """The pinned k8s.io/kubernetes module's source (downloaded by its build)."""
    return build.cache_root() / "gomod" / MODULE_DIR.format(version=build.kubernetes_version())


def upstream_names() -> dict[str, str]:
    """ImageID (as manifest.go names it: "Agnhost", "BusyBox", "Pause", ...) -> the
    image name the tests use, read from the pinned module's manifest.go."""
    text = (module_source() / "test/utils/image/manifest.go").read_text()
    registries = dict(re.findall(r'^\s*(\w+Registry):\s*"([^"]+)"', text, re.M))
    names = {m[0]: f"{registries[m[1]]}/{m[2]}:{m[3]}" for m in re.findall(
        r'configs\[(\w+)\] = Config\{list\.(\w+), "([^"]+)", "([^"]+)"\}', text)}
    if "Agnhost" not in names or "Pause" not in names:
        raise RuntimeError("test/utils/image/manifest.go of the pinned module no longer "
                           "reads as expected (no configs[Agnhost] or configs[Pause])")
    return names


def _ldd_closure(binary: Path) -> dict[str, bytes]:
    """The shared libraries (and the loader) a dynamic binary needs, by path."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    libs = {}
    for path in re.findall(r"(/\S+) \(0x", out):
        libs[path.lstrip("/")] = Path(path).read_bytes()
    return libs


# Debian's programs in the agnhost image (apt packages curl and bash)
FROM_DEBIAN = (Path("/usr/bin/curl"), Path("/bin/bash"))


def build_agnhost_tar(tag: str, cache: Path = CACHE) -> Path:
    """The agnhost image; `tag` is the ref its index records (what import names it)."""
    agnhost = build.ensure(["agnhost"])["agnhost"]
    for program in FROM_DEBIAN:
        if not program.exists():
            raise RuntimeError(f"{program} not found: install the apt package {program.name}")
    porter = module_source() / "test/images/agnhost/porter"
    pause_tar = images.build_pause_tar(cache)
    inputs = file_hash(agnhost, pause_tar, images.upstream_busybox(cache), *FROM_DEBIAN)
    out = cache / f"agnhost-{tag}-{inputs}.tar"
    if out.exists():
        return out
    rootfs = images.busybox_rootfs()
    rootfs.files["agnhost"] = (agnhost.read_bytes(), 0o755)
    rootfs.symlinks["agnhost-2"] = "agnhost"
    for name in ("localhost.crt", "localhost.key"):
        rootfs.files[name] = ((porter / name).read_bytes(), 0o644)
    for program in FROM_DEBIAN:
        rootfs.symlinks.pop(str(program).lstrip("/"), None)  # not busybox's applet
        rootfs.files[str(program).lstrip("/")] = (program.read_bytes(), 0o755)
        for path, data in _ldd_closure(program).items():
            rootfs.files[path] = (data, 0o755)
    rootfs.dirs |= {"uploads", "home/user-defined-in-image"}
    rootfs.files["etc/passwd"] = (
        b"root:x:0:0:root:/root:/bin/sh\n"
        b"user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n", 0o644)
    rootfs.files["etc/group"] = (
        b"root:x:0:\nuser-defined-in-image:x:1000:\n"
        b"group-defined-in-image:x:50000:user-defined-in-image\n", 0o644)
    _add_fake_registry(rootfs, pause_tar, "pause", "testing")
    build_oci_tar(out, rootfs, ref=tag, entrypoint=["/agnhost"], cmd=["pause"])
    return out


def _add_fake_registry(rootfs: Rootfs, oci_tar: Path, name: str, tag: str) -> None:
    """Lay out an image as agnhost's fake-registry-server serves it from /var/registry:
    manifests/<digest> (the index, each manifest), manifests/<tag> holding the index's
    digest, blobs/<digest>."""
    base = f"var/registry/{name}"
    with tarfile.open(oci_tar) as tar:
        def read(member: str) -> bytes:
            f = tar.extractfile(member)
            assert f is not None, member
            return f.read()

        index = json.loads(read("index.json"))
        for m in index["manifests"]:
            m.pop("annotations", None)
        index_b = json.dumps(index, sort_keys=True).encode()
        index_digest = images._sha(index_b)
        rootfs.files[f"{base}/manifests/{index_digest}"] = (index_b, 0o644)
        rootfs.files[f"{base}/manifests/{tag}"] = (index_digest.encode() + b"\n", 0o644)
        for m in index["manifests"]:
            digest = m["digest"]
            manifest_b = read("blobs/sha256/" + digest.removeprefix("sha256:"))
            rootfs.files[f"{base}/manifests/{digest}"] = (manifest_b, 0o644)
            manifest = json.loads(manifest_b)
            for blob in [manifest["config"], *manifest["layers"]]:
                rootfs.files[f"{base}/blobs/{blob['digest']}"] = (
                    read("blobs/sha256/" + blob["digest"].removeprefix("sha256:")), 0o644)


def build_nonewprivs_tar(tag: str, cache: Path = CACHE) -> Path:
    nnp = build.ensure(["nonewprivs"])["nonewprivs"]
    out = cache / f"nonewprivs-{tag}-{file_hash(nnp, Path('/bin/busybox'))}.tar"
    if not out.exists():
        rootfs = images.busybox_rootfs()
        rootfs.files["usr/local/bin/nnp"] = (nnp.read_bytes(), 0o4755)  # setuid root
        build_oci_tar(out, rootfs, ref=tag, cmd=["nnp"])
    return out


NGINX_PACKAGES = ("nginx", "nginx-common")
NGINX_CONF = b"""\
# the upstream nginx test image's behaviour: a page on port 80, nginx in the foreground
worker_processes 1;
error_log /dev/stderr;
pid /run/nginx.pid;
events { worker_connections 256; }
http {
    include /etc/nginx/mime.types;
    access_log /dev/stdout;
    server {
        listen 80;
        root /usr/share/nginx/html;
    }
}
"""


def _debian_packages(names: tuple[str, ...], into: Path) -> list[Path]:
    """The .deb files of Debian's candidate versions of `names`, downloaded into `into`
    (nothing installed); apt's lists are refreshed once if they do not know them."""
    def download() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["apt-get", "download", "-q", *names], cwd=into,
                              capture_output=True, text=True, timeout=300)
    res = download()
    if res.returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600)
        res = download()
    if res.returncode != 0:
        raise RuntimeError(f"apt-get download {' '.join(names)} failed: {res.stderr[-1000:]}")
    return sorted(into.glob("*.deb"))


def build_nginx_tar(tag: str, cache: Path = CACHE) -> Path:
    with tempfile.TemporaryDirectory(prefix="nginx-") as tmp:
        debs = _debian_packages(NGINX_PACKAGES, Path(tmp))
        busybox = images.upstream_busybox(cache)
        out = cache / f"nginx-{tag}-{file_hash(busybox, *debs)}.tar"
        if out.exists():
            return out
        root = Path(tmp) / "root"
        for deb in debs:
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=120)
        nginx = root / "usr/sbin/nginx"
        rootfs = images.busybox_rootfs(busybox)
        rootfs.files["usr/sbin/nginx"] = (nginx.read_bytes(), 0o755)
        for path, data in _ldd_closure(nginx).items():
            rootfs.files[path] = (data, 0o755)
        rootfs.files["etc/nginx/mime.types"] = ((root / "etc/nginx/mime.types").read_bytes(),
                                                0o644)
        rootfs.files["etc/nginx/nginx.conf"] = (NGINX_CONF, 0o644)
        rootfs.files["usr/share/nginx/html/index.html"] = (
            b"<html><body>nginx (nodepulse e2e image)</body></html>\n", 0o644)
        # nginx's workers run as nobody:nogroup when no user is configured
        rootfs.files["etc/passwd"] = (b"root:x:0:0:root:/root:/bin/sh\n"
                                      b"nobody:x:65534:65534::/nonexistent:/bin/false\n", 0o644)
        rootfs.files["etc/group"] = (b"root:x:0:\nnogroup:x:65534:\n", 0o644)
        rootfs.dirs |= {"run", "var/lib/nginx", "var/log/nginx"}
        build_oci_tar(out, rootfs, ref=tag, entrypoint=["/usr/sbin/nginx"],
                      cmd=["-g", "daemon off;"])
    return out


def import_all(ctd) -> dict[str, str]:
    """Build (cached) and import into the containerd `ctd` (nodepulse_dev.containerd) every
    upstream image the node tests can have here; return ImageID -> name."""
    names = upstream_names()
    ctd.tag_image(images.BUSYBOX_IMAGE, names["BusyBox"])
    ctd.tag_image(images.PAUSE_IMAGE, names["Pause"])
    for image_id, builder in (("Agnhost", build_agnhost_tar),
                              ("Nonewprivs", build_nonewprivs_tar),
                              ("Nginx", build_nginx_tar)):
        ctd.import_image(builder(names[image_id].rpartition(":")[2]), names[image_id])
    return {k: names[k] for k in ("BusyBox", "Pause", "Agnhost", "Nonewprivs", "Nginx")}


# The specs that pull with imagePullPolicy Always, and what they pull ("should be able to
# pull image": agnhost from registry.k8s.io)
PULLED_FROM_UPSTREAM = ("Agnhost",)


def serve_upstream_pulls(ctd, workdir: Path):  # -> nodepulse_dev.registry.Registry
    """A local registry (nodepulse_dev/registry.py) holding the images the specs pull from
    registry.k8s.io, under the same repository and tag, and containerd told to use it as
    that host's mirror (its certs.d hosts.toml): so such a pull really goes to a registry
    and back, here, where the internet is not reachable. Test setup only; the agent is
    not told. Stop the registry returned."""
    from nodepulse_dev.registry import start_registry

    names = upstream_names()
    reg = start_registry(workdir)
    try:
        upstream = {names[i].partition("/")[0] for i in PULLED_FROM_UPSTREAM}
        if upstream != {"registry.k8s.io"}:
            raise RuntimeError(f"manifest.go moved the pulled images to {upstream}")
        for image_id in PULLED_FROM_UPSTREAM:
            repo_tag = names[image_id].partition("/")[2]
            reg.push(build_agnhost_tar(repo_tag.rpartition(":")[2]), repo_tag)
        ctd.mirror_registry("registry.k8s.io", reg.host, reg.ca, reg.auth)
    except BaseException:
        reg.stop()
        raise
    return reg
