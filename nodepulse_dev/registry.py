"""A real image registry on loopback for image-pull tests: distribution's `registry`
program (built from its Go module, cached), serving TLS with a certificate from its own
CA (nodepulse_dev/pki.py) and asking for basic auth (htpasswd, bcrypt). Images are pushed
to it with crane (from go-containerregistry, built the same way).

    reg = start_registry(workdir)          # returns when /v2/ answers (401: auth on)
    ref = reg.push(oci_tar, "e2e/busybox:1")   # "127.0.0.1:PORT/e2e/busybox@sha256:..."
    ctd.trust_registry(reg.host, reg.ca)   # the test containerd trusts its CA
    reg.auth                                # (username, password) for CRI AuthConfig
    reg.stop()                              # by PID

No other registry is reachable here, so this is the only one the tests pull from.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import ssl
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from nodepulse_dev import build, pki
from nodepulse_dev.cluster import PortTaken
from nodepulse_dev.ports import free_port

USERNAME = "nodepulse-e2e"


@dataclass
class Registry:
    """A running registry. Stop it with stop(); it is idempotent."""

    workdir: Path
    port: int
    proc: subprocess.Popen[bytes] | None
    ca: Path  # the CA certificate a client must trust
    username: str
    password: str

    @property
    def host(self) -> str:
        """What image references start with: "127.0.0.1:PORT"."""
        return f"127.0.0.1:{self.port}"

    @property
    def auth(self) -> tuple[str, str]:
        return self.username, self.password

    @property
    def log_path(self) -> Path:
        return self.workdir / "registry.log"

    def push(self, oci_tar: Path, repo_tag: str) -> str:
        """Push an OCI layout tar (nodepulse_dev/images.py) as HOST/`repo_tag`; return
        the pushed reference by digest (HOST/repo@sha256:...)."""
        layout = Path(tempfile.mkdtemp(prefix="layout-", dir=self.workdir))
        try:
            with tarfile.open(oci_tar) as tar:
                tar.extractall(layout, filter="data")
            out = self._crane("push", str(layout), f"{self.host}/{repo_tag}")
        finally:
            shutil.rmtree(layout, ignore_errors=True)
        return out.strip().splitlines()[-1]

    def digest(self, repo_tag: str) -> str:
        """The manifest digest HOST/`repo_tag` resolves to, asked of the registry."""
        return self._crane("digest", f"{self.host}/{repo_tag}").strip()

    def _crane(self, *args: str) -> str:
        crane = build.ensure(["crane"], log=lambda _: None)["crane"]
        # crane's own config, never the user's: credentials from DOCKER_CONFIG, the CA
        # from SSL_CERT_FILE (Go reads it in place of the system roots)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.workdir),
               "DOCKER_CONFIG": str(self.workdir / "docker"), "SSL_CERT_FILE": str(self.ca)}
        res = subprocess.run([str(crane), *args], env=env, capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"crane {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout

    def stop(self, timeout: float = 10) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def docker_config(host: str, username: str, password: str) -> dict:
    """A Docker config.json naming the credentials for `host` (what crane reads, and the
    shape of a kubernetes.io/dockerconfigjson Secret's data)."""
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    return {"auths": {host: {"username": username, "password": password, "auth": token}}}


def start_registry(workdir: Path | None = None, ready_timeout: float = 30) -> Registry:
    """Start a registry on a free loopback port with TLS and basic auth; return when it
    answers. Raises RuntimeError with the end of its log if it does not."""
    binary = build.ensure(["registry", "crane"])["registry"]
    workdir = Path(workdir or tempfile.mkdtemp(prefix="np-registry-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ca = pki.CertificateAuthority(workdir / "pki")
    crt, key = ca.issue("registry", "127.0.0.1", server_names=("127.0.0.1", "localhost"))
    password = secrets.token_urlsafe(16)
    htpasswd = workdir / "htpasswd"
    import bcrypt  # a test tool ([test] extra): only the e2e registry needs it
    htpasswd.write_text(f"{USERNAME}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt()).decode()}\n")
    (workdir / "docker").mkdir(exist_ok=True)
    for attempt in range(3):
        port = free_port()
        (workdir / "docker" / "config.json").write_text(
            json.dumps(docker_config(f"127.0.0.1:{port}", USERNAME, password)))
        config = {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(workdir / "storage")},
                        "delete": {"enabled": True}},
            "http": {"addr": f"127.0.0.1:{port}", "secret": secrets.token_hex(16),
                     "tls": {"certificate": str(crt), "key": str(key)}},
            "auth": {"htpasswd": {"realm": "nodepulse-e2e", "path": str(htpasswd)}},
        }
        (workdir / "config.yml").write_text(yaml.safe_dump(config))
        with open(workdir / "registry.log", "ab") as log:
            proc = subprocess.Popen([str(binary), "serve", str(workdir / "config.yml")],
                                    stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        reg = Registry(workdir, port, proc, ca.cert_path, USERNAME, password)
        try:
            _wait_ready(reg, ready_timeout)
            return reg
        except PortTaken:
            reg.stop()
            if attempt == 2:
                raise
        except BaseException:
            reg.stop()
            raise
    raise AssertionError("unreachable")


def _wait_ready(reg: Registry, timeout: float) -> None:
    """/v2/ answers 401 without credentials once the registry serves (with auth on)."""
    ctx = ssl.create_default_context(cafile=str(reg.ca))
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        assert reg.proc is not None
        if reg.proc.poll() is not None:
            tail = reg.log_path.read_text(errors="replace")[-2000:]
            error = PortTaken if "address already in use" in tail else RuntimeError
            raise error(f"registry exited with {reg.proc.returncode}; see {reg.log_path}:\n{tail}")
        try:
            urllib.request.urlopen(f"https://{reg.host}/v2/", timeout=5, context=ctx)
            raise RuntimeError(f"registry at {reg.host} answered /v2/ without credentials: "
                               "basic auth is not on")
        except urllib.error.HTTPError as e:
            if e.code == 401:
                return
            last = f"HTTP {e.code}"
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    raise RuntimeError(f"registry not ready at {reg.host} after {timeout:.0f} s ({last}); "
                       f"see {reg.log_path}")
