"""The one place that says how to reach the API server: the credentials (from a
kubeconfig or the in-cluster service account), the error an API answer raises, and the
shared retry policy and error wording.

The agent and the operator reach the API through nodeagent.api.kube over these
credentials, and never import the kubernetes client package: it costs a process about
15 MB of memory, which counts in a process of thousands of virtual nodes. Tests,
benchmarks and scripts that want the kubernetes client's generated API get one, with
the same credentials, from `new_api_client`.

What a kubeconfig may hold, and what is done with it: the server, its CA (file or data),
insecure-skip-tls-verify, tls-server-name and proxy-url of the cluster; the user's client
certificate and key (files or data), token, tokenFile (read again every minute, as the
kubelet rotates bound tokens), username and password, or an exec credential plugin (run
again once the token it gave expires). An auth-provider (the old in-tree oidc, gcp,
azure) is refused by name: their exec plugins replace them.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import contextlib
import dataclasses
import datetime as dt
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from kubernetes import client

USER_AGENT = "nodepulse"
IN_CLUSTER = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD = 60.0  # seconds a token read from a file is used before it is read again


class ClientConfigError(Exception):
    """No usable credentials: names where it looked, or what in them is wrong."""


class CertError(ValueError):
    """A certificate or key that cannot be used; the message names the file."""


class ApiError(Exception):
    """A non-2xx answer of the API server: its status, reason, body (the Status object's
    JSON, as sent) and headers."""

    def __init__(self, status: int, reason: str = "", body: bytes | str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.reason = reason
        self.body = body
        self.headers: Mapping[str, str] = headers or {}
        super().__init__(f"HTTP {status} {reason}")


@dataclasses.dataclass
class ExecPlugin:
    """users[].user.exec: a command that prints an ExecCredential."""

    command: str
    args: list[str]
    env: dict[str, str]
    api_version: str
    cluster: dict[str, Any] | None  # handed to the plugin when provideClusterInfo is set
    base_dir: Path  # a relative command is relative to the kubeconfig's folder

    def run(self) -> dict[str, Any]:
        """The plugin's ExecCredential status: token or client certificate data, and
        expirationTimestamp."""
        command = self.command
        if os.sep in command and not os.path.isabs(command):
            command = str(self.base_dir / command)
        info: dict[str, Any] = {"apiVersion": self.api_version, "kind": "ExecCredential",
                                "spec": {"interactive": False}}
        if self.cluster is not None:
            info["spec"]["cluster"] = self.cluster
        env = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": json.dumps(info)}
        try:
            out = subprocess.run([command, *self.args], env=env, capture_output=True,
                                 text=True, timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ClientConfigError(f"exec plugin {self.command}: {e}") from e
        if out.returncode != 0:
            raise ClientConfigError(f"exec plugin {self.command} exited {out.returncode}: "
                                    f"{out.stderr.strip()[-500:]}")
        try:
            status = json.loads(out.stdout)["status"]
            if not isinstance(status, dict):
                raise TypeError("status is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise ClientConfigError(f"exec plugin {self.command}: its output is not an "
                                    f"ExecCredential with a status: {e}") from e
        return status


class Credentials:
    """Where the API server is and how to prove who we are: what every connection to
    it is made with. `authorization()` gives the Authorization header's value, read
    again from its file or plugin when due (any thread may ask)."""

    def __init__(self, server: str, *, source: str, ca_file: str | None = None,
                 ca_data: bytes | None = None, cert_file: str | None = None,
                 key_file: str | None = None, cert_data: bytes | None = None,
                 key_data: bytes | None = None, insecure: bool = False,
                 tls_server_name: str | None = None, proxy: str | None = None,
                 token: str | None = None, token_file: str | None = None,
                 username: str | None = None, password: str | None = None,
                 exec_plugin: ExecPlugin | None = None,
                 clock: Any = time.monotonic) -> None:
        self.server = server.rstrip("/")
        self.source = source  # where these came from, for messages
        self.ca_file, self.ca_data = ca_file, ca_data
        self.cert_file, self.key_file = cert_file, key_file
        self.cert_data, self.key_data = cert_data, key_data
        self.insecure = insecure
        self.tls_server_name = tls_server_name
        self.proxy = proxy
        self.token_file = token_file
        self.username, self.password = username, password
        self.exec_plugin = exec_plugin
        self._clock = clock
        self._ssl: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self._token = token
        self._token_until = float("inf") if token else -float("inf")
        # moves on each time the client certificate is replaced: connections made with
        # the one before are closed (nodeagent.api.rest)
        self.generation = 0
        if exec_plugin is not None:
            self._run_plugin()  # its client certificate, if it gives one, is needed now

    # -- TLS --
    def ssl_context(self) -> ssl.SSLContext | None:
        """For an https server: its CA (or none checked, when insecure) and our client
        certificate. Made once: every connection shares it (each context holds its own
        copy of the CA and key)."""
        if not self.server.startswith("https:"):
            return None
        if self._ssl is None:
            self._ssl = self._make_ssl_context()
        return self._ssl

    def _make_ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(
            cafile=self.ca_file, cadata=self.ca_data.decode() if self.ca_data else None)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        elif self.cert_data:
            # the ssl module loads a key pair only from files: a private one, gone at once
            folder = tempfile.mkdtemp(prefix="nodepulse-cert-")
            try:
                cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
                cert.write_bytes(self.cert_data)
                key.touch(0o600)
                key.write_bytes(self.key_data or b"")
                ctx.load_cert_chain(str(cert), str(key) if self.key_data else None)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        return ctx

    def use_client_certificate(self, pem_file: str) -> None:
        """Prove who we are with the certificate and key in `pem_file` (one file, as the
        kubelet keeps them) from now on: loaded into the TLS context connections are
        made with, and `generation` moves on."""
        with self._lock:
            if self._ssl is not None:
                self._ssl.load_cert_chain(pem_file)
            self.cert_file = self.key_file = pem_file
            self.cert_data = self.key_data = None
            self.generation += 1

    def client_certificate(self) -> bytes | None:
        """The client certificate (PEM) these credentials present, if any."""
        if self.cert_file:
            return Path(self.cert_file).read_bytes()
        return self.cert_data

    # -- the Authorization header --
    def authorization(self) -> str | None:
        if self.username is not None:
            pair = f"{self.username}:{self.password or ''}".encode()
            return f"Basic {base64.b64encode(pair).decode()}"
        if self.token_file is None and self.exec_plugin is None:
            return f"Bearer {self._token}" if self._token else None
        with self._lock:
            if self._clock() >= self._token_until:
                if self.exec_plugin is not None:
                    self._run_plugin()
                else:
                    self._read_token_file()
            return f"Bearer {self._token}" if self._token else None

    def _read_token_file(self) -> None:
        assert self.token_file is not None
        try:
            self._token = Path(self.token_file).read_text().strip()
        except OSError as e:
            if self._token is None:  # at start: say so; later: keep the last one
                raise ClientConfigError(f"{self.source}: token file {self.token_file}: "
                                        f"{e.strerror or e}") from e
        self._token_until = self._clock() + TOKEN_REREAD

    def _run_plugin(self) -> None:
        assert self.exec_plugin is not None
        status = self.exec_plugin.run()
        self._token = status.get("token") or None
        if status.get("clientCertificateData"):
            self.cert_data = str(status["clientCertificateData"]).encode()
            self.key_data = str(status.get("clientKeyData") or "").encode()
        expires = status.get("expirationTimestamp")
        self._token_until = float("inf")
        if expires and self._token:
            try:
                at = dt.datetime.fromisoformat(str(expires).replace("Z", "+00:00"))
            except ValueError as e:
                raise ClientConfigError(f"exec plugin {self.exec_plugin.command}: "
                                        f"expirationTimestamp {expires!r}: {e}") from e
            left = (at - dt.datetime.now(dt.UTC)).total_seconds()
            # asked again a little before it runs out
            self._token_until = self._clock() + max(0.0, left - 10.0)
        if not self._token and not self.cert_data:
            raise ClientConfigError(f"exec plugin {self.exec_plugin.command}: its "
                                    "ExecCredential holds neither a token nor a certificate")

    # -- as files, for clients that read credentials only from files --
    def file_of(self, what: str) -> str | None:
        """The CA, client certificate or key ("ca", "cert", "key") as a file path: the
        one named, or the data written once to a private file removed at exit."""
        path, data = {"ca": (self.ca_file, self.ca_data),
                      "cert": (self.cert_file, self.cert_data),
                      "key": (self.key_file, self.key_data)}[what]
        if path or not data:
            return path
        return _private_file(data)


_files_dir: str | None = None


def _private_file(data: bytes) -> str:
    global _files_dir
    if _files_dir is None:
        _files_dir = tempfile.mkdtemp(prefix="nodepulse-creds-")
        atexit.register(shutil.rmtree, _files_dir, True)
    fd, path = tempfile.mkstemp(dir=_files_dir)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


# ---- loading
def load_credentials(kubeconfig: str | os.PathLike[str] | None = None,
                     context: str | None = None) -> Credentials:
    """Credentials from, in order: the given kubeconfig, $KUBECONFIG, the in-cluster
    service account, ~/.kube/config."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        if not Path(path).is_file():
            raise ClientConfigError(f"kubeconfig {path!s}: no such file")
        return from_kubeconfig(Path(path), context)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster()
    default = Path.home() / ".kube" / "config"
    if default.is_file():
        return from_kubeconfig(default, context)
    raise ClientConfigError(
        "no kubeconfig given (--kubeconfig or $KUBECONFIG), not running in a pod, "
        f"and {default} does not exist")


def in_cluster(folder: Path = IN_CLUSTER) -> Credentials:
    """The pod's service account: the API server's Service address from the
    environment, the token (rotated by the kubelet: read again every minute) and CA
    from the mounted folder."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ClientConfigError("in-cluster: KUBERNETES_SERVICE_HOST and "
                                "KUBERNETES_SERVICE_PORT must both be set")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    token, ca = folder / "token", folder / "ca.crt"
    for f in (token, ca):
        if not f.is_file():
            raise ClientConfigError(f"in-cluster: {f} does not exist (is a service account "
                                    "token mounted into this pod?)")
    creds = Credentials(f"https://{host}:{port}", source="in-cluster service account",
                        ca_file=str(ca), token_file=str(token))
    creds.authorization()  # read the token now: a missing one is an error at start
    return creds


def from_kubeconfig(path: Path, context: str | None = None) -> Credentials:
    where = f"kubeconfig {path}"
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ClientConfigError(f"{where}: cannot be read: {e}") from e
    if not isinstance(doc, dict):
        raise ClientConfigError(f"{where}: not a kubeconfig (a mapping is expected)")
    name = context or doc.get("current-context")
    if not name:
        raise ClientConfigError(f"{where}: no current-context, and no context given")
    ctx = _named(doc, "contexts", "context", str(name), where)
    cluster = _named(doc, "clusters", "cluster", str(ctx.get("cluster") or ""),
                     f"{where}, context {name}")
    user_name = ctx.get("user")
    user = (_named(doc, "users", "user", str(user_name), f"{where}, context {name}")
            if user_name else {})
    base = path.resolve().parent
    server = cluster.get("server")
    if not server:
        raise ClientConfigError(f"{where}: cluster {ctx.get('cluster')!r} has no server")

    def file(section: Mapping[str, Any], key: str) -> str | None:
        value = section.get(key)
        if not value:
            return None
        resolved = Path(str(value)).expanduser()
        return str(resolved if resolved.is_absolute() else base / resolved)

    def data(section: Mapping[str, Any], key: str) -> bytes | None:
        value = section.get(key)
        if not value:
            return None
        try:
            return base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ClientConfigError(f"{where}: {key} is not base64: {e}") from e

    if user.get("auth-provider"):
        provider = (user["auth-provider"] or {}).get("name", "?")
        raise ClientConfigError(
            f"{where}: user {user_name!r} uses auth-provider {provider!r}, which nodepulse "
            "does not support; use the provider's exec credential plugin instead")
    plugin = None
    if user.get("exec"):
        spec = user["exec"]
        if not spec.get("command"):
            raise ClientConfigError(f"{where}: user {user_name!r}: exec has no command")
        cluster_info = None
        if spec.get("provideClusterInfo"):
            cluster_info = {k: v for k, v in (
                ("server", server), ("tls-server-name", cluster.get("tls-server-name")),
                ("insecure-skip-tls-verify", cluster.get("insecure-skip-tls-verify")),
                ("certificate-authority-data", cluster.get("certificate-authority-data")),
                ("proxy-url", cluster.get("proxy-url"))) if v}
        plugin = ExecPlugin(
            command=str(spec["command"]), args=[str(a) for a in spec.get("args") or []],
            env={str(v["name"]): str(v.get("value", "")) for v in spec.get("env") or []},
            api_version=str(spec.get("apiVersion") or "client.authentication.k8s.io/v1"),
            cluster=cluster_info, base_dir=base)
    return Credentials(
        str(server), source=where,
        ca_file=file(cluster, "certificate-authority"),
        ca_data=data(cluster, "certificate-authority-data"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        tls_server_name=cluster.get("tls-server-name") or None,
        proxy=cluster.get("proxy-url") or None,
        cert_file=file(user, "client-certificate"), key_file=file(user, "client-key"),
        cert_data=data(user, "client-certificate-data"),
        key_data=data(user, "client-key-data"),
        token=user.get("token") or None, token_file=file(user, "tokenFile"),
        username=user.get("username") or None, password=user.get("password") or None,
        exec_plugin=plugin)


def _named(doc: Mapping[str, Any], section: str, key: str, name: str,
           where: str) -> dict[str, Any]:
    for entry in doc.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key)
            return value if isinstance(value, dict) else {}
    raise ClientConfigError(f"{where}: no {section[:-1]} named {name!r}")


# ---- the kubernetes client, for tests, benchmarks and scripts
def new_api_client(kubeconfig: str | os.PathLike[str] | None = None,
                   context: str | None = None, *, component: str = "nodepulse",
                   pool_size: int = 16, retries: int | None = None) -> client.ApiClient:
    """A kubernetes client ApiClient with the same credentials as load_credentials
    gives, its connection pool allowing `pool_size` concurrent requests. `retries=0`
    turns off urllib3's own re-sending."""
    from kubernetes import client

    creds = load_credentials(kubeconfig, context)
    cfg = client.Configuration()
    cfg.host = creds.server
    cfg.ssl_ca_cert = creds.file_of("ca")
    cfg.cert_file, cfg.key_file = creds.file_of("cert"), creds.file_of("key")
    cfg.verify_ssl = not creds.insecure
    cfg.tls_server_name = creds.tls_server_name
    cfg.proxy = creds.proxy

    def refresh(c: client.Configuration) -> None:
        header = creds.authorization()
        c.api_key = {"authorization": header} if header else {}
    refresh(cfg)
    cfg.refresh_api_key_hook = refresh
    cfg.connection_pool_maxsize = pool_size
    if retries is not None:
        cfg.retries = retries
    api = client.ApiClient(cfg)
    api.user_agent = f"{USER_AGENT}/{component}"
    return api


# ---- errors: what is retried, and how it is named
def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an API error, or None for transport errors."""
    return exc.status if isinstance(exc, ApiError) else None


def is_retriable(exc: BaseException) -> bool:
    """Worth trying again: the server is busy or unreachable, not refusing the request."""
    if isinstance(exc, ApiError):
        return exc.status in (0, 429, 500, 502, 503, 504)
    return isinstance(exc, (ConnectionError, TimeoutError))


def invalid_fields(exc: BaseException) -> set[str]:
    """The fields an Invalid (422) answer names as its causes (details.causes[].field)."""
    if not isinstance(exc, ApiError):
        return set()
    try:
        causes = (json.loads(exc.body or b"{}").get("details") or {}).get("causes") or []
        return {str(c.get("field")) for c in causes if c.get("field")}
    except (ValueError, AttributeError, TypeError):
        return set()


def brief(exc: BaseException) -> str:
    """How a log line or an Event names an error: "HTTP 404 NotFound: <the Status
    message>" for the API server's answers, "<type>: <text>" for the rest."""
    if isinstance(exc, ApiError):
        message = ""
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            message = str(json.loads(exc.body or b"{}").get("message") or "")
        text = f"HTTP {exc.status} {exc.reason}"
        return f"{text}: {message}" if message and message != exc.reason else text
    return f"{type(exc).__name__}: {exc}"
