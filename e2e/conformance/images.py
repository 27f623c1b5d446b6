"""The images the upstream e2e tests run, built here (no registry is reachable) and
named as the tests expect them: those of the node specs (import_all) and those of the
whole [Conformance] suite (conformance_images).

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
  sidecar probe specs run `/bin/bash -c`); the network tools of the upstream image
  (Alpine's bind-tools, netcat-openbsd, iproute2, iperf, musl's getent) are Debian's
  from a Debian root filesystem, with the libraries they load, and /coredns is the
  CoreDNS this suite builds. Two tags are two images (/etc/e2e-image names the tag).
- nonewprivs: the nnp program from the module (test/images/nonewprivs), setuid root
  in /usr/local/bin as its Dockerfile makes it, on busybox.
- nginx: Debian's nginx (the packages nginx and nginx-common, fetched with `apt-get
  download`, not installed) with the libraries it loads, on busybox; it serves a page
  on port 80 in the foreground, as the upstream image does.
- the others of the [Conformance] suite: see CONFORMANCE_IMAGES.
"""

from __future__ import annotations

import json
import os
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
# and, from a Debian root filesystem, the network tools of upstream's agnhost (Alpine's
# bind-tools, netcat-openbsd, iproute2, iperf): the DNS specs run `dig` in agnhost as in
# jessie-dnsutils, the Service specs `nc -t`/`nc -u`
TOOLS_PACKAGES = ["dnsutils", "netcat-openbsd", "iproute2", "iperf"]
NET_TOOLS = ("usr/bin/dig", "usr/bin/nslookup", "usr/bin/host", "usr/bin/nc", "usr/bin/ip",
             "usr/bin/iperf",
             # the DNS specs' /etc/hosts probes run `getent hosts` (Alpine's musl has one;
             # busybox has none); glibc's own hosts lookup, files then DNS as musl's
             "usr/bin/getent")
NSSWITCH = b"hosts: files dns\n"


def dnsutils_rootfs() -> Path:
    """Debian minbase with dnsutils and agnhost's other network tools, a tar: the
    jessie-dnsutils image's content (on bookworm: jessie is long gone from Debian's
    mirrors), and where agnhost's tools come from."""
    from e2e.kind import rootfs

    return rootfs.debootstrap("e2e-tools", TOOLS_PACKAGES)


def _read_in_tree(tree: Path, path: str) -> bytes:
    """A file of the root filesystem `tree`, following its symlinks inside the tree."""
    current = tree / path.lstrip("/")
    for _ in range(40):
        parent = Path(os.path.realpath(current.parent)) if current.parent != tree else tree
        current = parent / current.name
        if not current.is_symlink():
            return current.read_bytes()
        target = os.readlink(current)
        current = tree / target.lstrip("/") if target.startswith("/") else parent / target
    raise RuntimeError(f"{path} in {tree}: too many symlinks")


def tree_programs(tar: Path, programs: tuple[str, ...]) -> dict[str, tuple[bytes, int]]:
    """`programs` of the root filesystem tar `tar` with the libraries they load (the
    tree's own ldd, in a chroot), by path."""
    files = {}
    with tempfile.TemporaryDirectory(prefix="tree-") as tmp:
        tree = Path(tmp)
        subprocess.run(["tar", "-C", tmp, "-xf", str(tar)], check=True, timeout=600)
        for program in programs:
            files[program] = (_read_in_tree(tree, program), 0o755)
            out = subprocess.run(["chroot", tmp, "ldd", f"/{program}"], capture_output=True,
                                 text=True, check=True, timeout=60).stdout
            for lib in re.findall(r"(/\S+) \(0x", out):
                files[lib.lstrip("/")] = (_read_in_tree(tree, lib), 0o755)
    return files


def agnhost_rootfs(image_name: str) -> Rootfs:
    """agnhost's root filesystem (see the module doc); `image_name` is written to
    /etc/e2e-image so that two tags of agnhost are two images, as upstream."""
    agnhost, coredns = build.ensure(["agnhost", "coredns"]).values()
    for program in FROM_DEBIAN:
        if not program.exists():
            raise RuntimeError(f"{program} not found: install the apt package {program.name}")
    porter = module_source() / "test/images/agnhost/porter"
    rootfs = images.busybox_rootfs()
    rootfs.files["agnhost"] = (agnhost.read_bytes(), 0o755)
    rootfs.symlinks["agnhost-2"] = "agnhost"
    rootfs.files["coredns"] = (coredns.read_bytes(), 0o755)
    for name in ("localhost.crt", "localhost.key"):
        rootfs.files[name] = ((porter / name).read_bytes(), 0o644)
    for program in FROM_DEBIAN:
        rootfs.symlinks.pop(str(program).lstrip("/"), None)  # not busybox's applet
        rootfs.files[str(program).lstrip("/")] = (program.read_bytes(), 0o755)
        for path, data in _ldd_closure(program).items():
            rootfs.files[path] = (data, 0o755)
    for path, entry in tree_programs(dnsutils_rootfs(), NET_TOOLS).items():
        rootfs.symlinks.pop(path, None)
        rootfs.symlinks.pop(f"bin/{Path(path).name}", None)  # busybox's applet of the name
        rootfs.files[path] = entry
    rootfs.files["etc/nsswitch.conf"] = (NSSWITCH, 0o644)
    rootfs.dirs |= {"uploads", "home/user-defined-in-image"}
    rootfs.files["etc/passwd"] = (
        b"root:x:0:0:root:/root:/bin/sh\n"
        b"user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n", 0o644)
    rootfs.files["etc/group"] = (
        b"root:x:0:\nuser-defined-in-image:x:1000:\n"
        b"group-defined-in-image:x:50000:user-defined-in-image\n", 0o644)
    rootfs.files["etc/e2e-image"] = (image_name.encode() + b"\n", 0o644)
    _add_fake_registry(rootfs, images.build_pause_tar(), "pause", "testing")
    return rootfs


def _inputs(*paths: Path) -> str:
    """A hash of the files an image is made of and of this module's text."""
    return file_hash(Path(__file__), *paths)


def build_agnhost_tar(tag: str, cache: Path = CACHE) -> Path:
    """The agnhost image; `tag` is the ref its index records (what import names it)."""
    bins = build.ensure(["agnhost", "coredns"])
    inputs = _inputs(*bins.values(), images.build_pause_tar(cache),
                     images.upstream_busybox(cache), *FROM_DEBIAN, dnsutils_rootfs())
    out = cache / f"agnhost-{tag}-{inputs}.tar"
    if not out.exists():
        name = upstream_names()["Agnhost"].rpartition(":")[0] + f":{tag}"
        build_oci_tar(out, agnhost_rootfs(name), ref=tag, entrypoint=["/agnhost"],
                      cmd=["pause"])
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
        out = cache / f"nginx-{tag}-{_inputs(busybox, *debs)}.tar"
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
        # the specs roll from one nginx tag to the other: two images, as upstream
        rootfs.files["etc/e2e-image"] = (f"nginx:{tag}\n".encode(), 0o644)
        build_oci_tar(out, rootfs, ref=tag, entrypoint=["/usr/sbin/nginx"],
                      cmd=["-g", "daemon off;"])
    return out


def build_nonroot_tar(tag: str, cache: Path = CACHE) -> Path:
    """busybox whose image user is 1234, as the upstream nonroot image (USER 1234)."""
    busybox = images.upstream_busybox(cache)
    out = cache / f"nonroot-{tag}-{_inputs(busybox)}.tar"
    if not out.exists():
        build_oci_tar(out, images.busybox_rootfs(busybox), ref=tag, user="1234")
    return out


def build_webserver_tar(image_id: str, tag: str, cache: Path = CACHE) -> Path:
    """kitten or nautilus: agnhost with the picture and data.json of
    test/images/<kitten|nautilus>/html at its root, serving them (test-webserver)."""
    html = module_source() / "test/images" / image_id.lower() / "html"
    base = build_agnhost_tar(upstream_names()["Agnhost"].rpartition(":")[2], cache)
    out = cache / f"{image_id.lower()}-{tag}-{_inputs(base, *sorted(html.iterdir()))}.tar"
    if not out.exists():
        rootfs = agnhost_rootfs(upstream_names()[image_id])
        for f in html.iterdir():
            rootfs.files[f.name] = (f.read_bytes(), 0o644)
        build_oci_tar(out, rootfs, ref=tag, entrypoint=["/agnhost"], cmd=["test-webserver"])
    return out


def build_dnsutils_tar(tag: str, cache: Path = CACHE) -> Path:
    """jessie-dnsutils: Debian minbase with dnsutils (dig, nslookup), its tar the layer."""
    tree = dnsutils_rootfs()
    out = cache / f"jessie-dnsutils-{tag}-{_inputs(tree)}.tar"
    if not out.exists():
        build_oci_tar(out, tree.read_bytes(), ref=tag, cmd=["/bin/sh"])
    return out


def build_static_tar(program: str, path: str, tag: str, cache: Path = CACHE,
                     entrypoint: list[str] | None = None) -> Path:
    """A program built here (nodepulse_dev/build.py) at `path` on busybox."""
    binary = build.ensure([program])[program]
    busybox = images.upstream_busybox(cache)
    out = cache / f"{program}-{tag}-{_inputs(binary, busybox)}.tar"
    if not out.exists():
        rootfs = images.busybox_rootfs(busybox)
        rootfs.files[path] = (binary.read_bytes(), 0o755)
        build_oci_tar(out, rootfs, ref=tag, entrypoint=entrypoint)
    return out


# What the [Conformance] specs run (test/utils/image/manifest.go's IDs), besides pause
# and busybox, and how each is made here. Of manifest.go's other images, none is named
# by a [Conformance] spec (resource-consumer only by the autoscaling specs).
CONFORMANCE_IMAGES = {
    "Agnhost": lambda tag: build_agnhost_tar(tag),
    # the specs that roll an agnhost workload from one version to the next: the same
    # program, a second image
    "AgnhostPrev": lambda tag: build_agnhost_tar(tag),
    "Nginx": lambda tag: build_nginx_tar(tag),
    "NginxNew": lambda tag: build_nginx_tar(tag),
    "Nonewprivs": lambda tag: build_nonewprivs_tar(tag),
    "NonRoot": lambda tag: build_nonroot_tar(tag),
    "Kitten": lambda tag: build_webserver_tar("Kitten", tag),
    "Nautilus": lambda tag: build_webserver_tar("Nautilus", tag),
    "JessieDnsutils": lambda tag: build_dnsutils_tar(tag),
    # k8s.io/sample-apiserver at the version the Kubernetes module pins (the Aggregator
    # spec's image is an older build of the same program)
    "APIServer": lambda tag: build_static_tar("sample-apiserver", "sample-apiserver", tag,
                                              entrypoint=["/sample-apiserver"]),
    # the suite's etcd (nodepulse_dev/gomod/etcd) under the tag the Aggregator spec names
    "Etcd": lambda tag: build_static_tar("etcd", "usr/local/bin/etcd", tag),
}


def conformance_images() -> dict[str, Path]:
    """Every image the [Conformance] specs run, built (cached): upstream name -> OCI tar.
    pause and busybox are this project's images (nodepulse_dev/images.py) under the
    upstream names."""
    names = upstream_names()
    tars = {names["Pause"]: images.build_pause_tar(), names["BusyBox"]: images.build_busybox_tar()}
    for image_id, builder in CONFORMANCE_IMAGES.items():
        tars[names[image_id]] = builder(names[image_id].rpartition(":")[2])
    return tars


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
