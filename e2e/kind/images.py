"""The project's image, built by its Dockerfile on a Python base image made here.

Users build with the public base (`docker build .`: python:3.11-slim-bookworm). No
registry is reachable here, so the tests pass `--build-arg PYTHON_IMAGE=` a base of
their own: Debian bookworm's minbase with its python3.11 and pip (e2e/kind/rootfs.py),
laid out as the public image is for the Dockerfile (`python` and `pip` on PATH, pip
allowed to install into the system's site-packages), and trusting the CA certificates
this machine trusts (its package registries may be reached through a TLS proxy).

The built image is saved under ~/.cache/nodepulse/kind, named by a hash of its build
context and base, so a second run with the same sources builds nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from e2e.kind import rootfs
from e2e.kind.docker import Dockerd

REPO = Path(__file__).resolve().parent.parent.parent
PYTHON_BASE = "localhost/nodepulse/python:3.11-bookworm"
PROJECT_IMAGE = "localhost/nodepulse:e2e"
PYTHON_PACKAGES = ["python3", "python3-pip", "python-is-python3", "ca-certificates"]
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_LOCAL_CAS = Path("/usr/local/share/ca-certificates")


def _python_layout(tree: Path) -> None:
    # PEP 668's marker stops `pip install` outside a venv; the public image has none
    for marker in tree.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    if HOST_LOCAL_CAS.is_dir():
        shutil.copytree(HOST_LOCAL_CAS, tree / "usr/local/share/ca-certificates",
                        dirs_exist_ok=True)
    if HOST_CA_BUNDLE.exists():
        shutil.copy2(HOST_CA_BUNDLE, tree / "etc/ssl/certs/ca-certificates.crt")


def _python_key() -> str:
    trust = HOST_CA_BUNDLE.read_bytes() if HOST_CA_BUNDLE.exists() else b""
    return "pep668-off cas=" + hashlib.sha256(trust).hexdigest()


def python_base_path() -> Path:
    return rootfs.tar_path("python", PYTHON_PACKAGES, _python_key())


def python_base_tar(log: Callable[[str], None] = print) -> Path:
    return rootfs.debootstrap("python", PYTHON_PACKAGES, log=log,
                              prepare=_python_layout, prepare_key=_python_key())


def build_context(repo: Path = REPO) -> list[Path]:
    """The files `docker build` sends: those .dockerignore lets in (its `!` lines),
    without byte code, plus the Dockerfile and .dockerignore themselves."""
    allowed = [line[1:].rstrip("/") for line in (repo / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    files = [repo / "Dockerfile", repo / ".dockerignore"]
    for name in allowed:
        path = repo / name
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file()
                            and "__pycache__" not in p.parts and p.suffix != ".pyc")
        elif path.exists():
            files.append(path)
    return files


def _context_hash(repo: Path, base_tar: Path) -> str:
    h = hashlib.sha256(base_tar.name.encode())
    for path in build_context(repo):
        h.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def load_python_base(engine: Dockerd, log: Callable[[str], None] = print) -> str:
    tar = python_base_tar(log)
    engine.docker("import", "-c", "ENV LANG=C.UTF-8", "-c", 'CMD ["python3"]',
                  str(tar), PYTHON_BASE)
    return PYTHON_BASE


def project_image(engine: Dockerd, log: Callable[[str], None] = print,
                  repo: Path = REPO) -> str:
    """PROJECT_IMAGE in `engine`: loaded from the cache, or built by the Dockerfile
    (BuildKit, host network for pip) on the local Python base and then cached."""
    base_tar = python_base_tar(log)
    cached = rootfs.cache_dir() / f"nodepulse-image-{_context_hash(repo, base_tar)}.tar"
    if cached.exists():
        engine.docker("load", "-i", str(cached))
        return PROJECT_IMAGE
    load_python_base(engine, log)
    started = time.monotonic()
    log(f"building {PROJECT_IMAGE} from {repo / 'Dockerfile'} on {PYTHON_BASE}")
    engine.docker("build", "--network", "host", "--build-arg", f"PYTHON_IMAGE={PYTHON_BASE}",
                  "-t", PROJECT_IMAGE, str(repo), env={"DOCKER_BUILDKIT": "1"})
    partial = cached.with_suffix(".partial")
    engine.docker("save", "-o", str(partial), PROJECT_IMAGE)
    rootfs.keep_only(cached, partial)
    log(f"built {PROJECT_IMAGE} in {time.monotonic() - started:.0f} s")
    return PROJECT_IMAGE
