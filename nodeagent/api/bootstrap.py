"""The node's client certificate, kept as the kubelet keeps it: TLS bootstrap at start,
rotation while running.

Files in --cert-dir, under the kubelet's names (either program can take over from the
other):

    kubelet-client-<YYYY-MM-DD-HH-MM-SS>.pem   a certificate, then its key; mode 0600
    kubelet-client-current.pem                 a symlink to the newest of them
    kubelet-client.key.tmp                     the key of a request not signed yet

Bootstrap (`client_credentials`): with --bootstrap-kubeconfig, when --kubeconfig is
missing, unreadable, without a client certificate or with an expired one. A key (the
pending one, when a restart finds it, so the CSR sent before is found again), a CSR for
signer kubernetes.io/kube-apiserver-client-kubelet (CN system:node:<node>, O
system:nodes; usages digital signature and client auth, key encipherment too for an RSA
key) sent with the bootstrap credentials; once approved and signed, the pair is stored
and --kubeconfig written: the bootstrap kubeconfig's server and CA, and
kubelet-client-current.pem as both client certificate and key.

Rotation (`ClientCertRotation`, with rotateCertificates): at a random point between 70 %
and 90 % of the certificate's lifetime, a new key and CSR, sent with the node's own
credentials (the bootstrap ones once the certificate has expired); the new pair is
stored, and the API client makes its new connections with it and closes those made with
the old one (nodeagent.api.rest). No restart.

A request that is denied, fails or cannot be sent is logged with its reason and tried
again with back-off (a refused one with a new key).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import logging
import os
import random
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nodeagent.api.certificates import (
    CLIENT_SIGNER,
    CsrRefused,
    PrivateKey,
    common_name,
    csr_name,
    csr_object,
    csr_pem,
    key_pem,
    load_key,
    new_key,
    renew_at,
    request_certificate,
    usages,
    validity,
    write_private,
)
from nodeagent.api.client import (
    ApiError,
    CertError,
    ClientConfigError,
    Credentials,
    brief,
    from_kubeconfig,
    load_credentials,
)
from nodeagent.api.clock import Clock
from nodeagent.api.kube import Kube, RestKube

log = logging.getLogger(__name__)

CURRENT = "kubelet-client-current.pem"
PENDING_KEY = "kubelet-client.key.tmp"
BACKOFF_INITIAL = 5.0  # seconds before a failed request is tried again; doubles
BACKOFF_MAX = 300.0
WHAT = "client certificate"

KubeFor = Callable[[Credentials], Kube]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ClientCertSettings:
    node: str
    kubeconfig: Path | None  # --kubeconfig: read, or written by the bootstrap
    bootstrap_kubeconfig: Path | None
    cert_dir: Path
    rotate: bool  # rotateCertificates


def _rest_kube(creds: Credentials) -> Kube:
    return RestKube(creds, 2, component="agent-bootstrap")


async def _close(kube: Kube) -> None:
    aclose = getattr(kube, "aclose", None)
    if aclose is not None:
        await aclose()


class CertStore:
    """The certificate files of --cert-dir."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @property
    def current_path(self) -> Path:
        return self.folder / CURRENT

    def current(self) -> bytes | None:
        """The current certificate and key (PEM), when there is one."""
        try:
            return self.current_path.read_bytes()
        except OSError:
            return None

    def save(self, cert: bytes, key: bytes, now: dt.datetime) -> Path:
        """Store a new pair and make it the current one (the symlink replaced in one
        step)."""
        path = self.folder / f"kubelet-client-{now.strftime('%Y-%m-%d-%H-%M-%S')}.pem"
        write_private(path, cert + key)
        link = self.folder / (CURRENT + ".tmp")
        link.unlink(missing_ok=True)
        link.symlink_to(path.name)
        os.replace(link, self.current_path)
        return path

    def pending_key(self) -> PrivateKey | None:
        path = self.folder / PENDING_KEY
        try:
            return load_key(path.read_bytes(), str(path))
        except OSError:
            return None
        except CertError as e:
            log.warning("%s; making a new key", e)
            return None

    def keep_pending(self, key: PrivateKey) -> None:
        write_private(self.folder / PENDING_KEY, key_pem(key))

    def drop_pending(self) -> None:
        (self.folder / PENDING_KEY).unlink(missing_ok=True)


def bootstrap_reason(kubeconfig: Path, now: dt.datetime) -> str | None:
    """Why --kubeconfig cannot be used as it is (None: it can): the kubelet's rule."""
    if not kubeconfig.exists():
        return f"{kubeconfig} does not exist"
    try:
        cert = from_kubeconfig(kubeconfig).client_certificate()
    except (ClientConfigError, OSError) as e:
        return f"{kubeconfig} cannot be used: {e}"
    if not cert:
        return f"{kubeconfig} holds no client certificate"
    try:
        not_after = validity(cert)[1]
    except ValueError as e:
        return f"{kubeconfig}: its client certificate cannot be read: {e}"
    if not_after <= now:
        return f"{kubeconfig}: its client certificate expired at {not_after.isoformat()}"
    return None


def write_kubeconfig(path: Path, boot: Credentials, pem: Path) -> None:
    """A kubeconfig for the bootstrap kubeconfig's server with the certificate and key in
    `pem` (the kubelet's names for its entries)."""
    cluster: dict[str, object] = {"server": boot.server}
    if boot.ca_file:
        cluster["certificate-authority"] = boot.ca_file
    elif boot.ca_data:
        cluster["certificate-authority-data"] = base64.b64encode(boot.ca_data).decode()
    if boot.insecure:
        cluster["insecure-skip-tls-verify"] = True
    if boot.tls_server_name:
        cluster["tls-server-name"] = boot.tls_server_name
    if boot.proxy:
        cluster["proxy-url"] = boot.proxy
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "default-context",
           "clusters": [{"name": "default-cluster", "cluster": cluster}],
           "users": [{"name": "default-auth",
                      "user": {"client-certificate": str(pem), "client-key": str(pem)}}],
           "contexts": [{"name": "default-context",
                         "context": {"cluster": "default-cluster", "user": "default-auth",
                                     "namespace": "default"}}]}
    write_private(path, yaml.safe_dump(doc, sort_keys=False).encode())


async def obtain(pick: Callable[[], tuple[Kube, str]], store: CertStore, node: str,
                 clock: Clock) -> tuple[bytes, bytes]:
    """A signed client certificate for `node` and its key (PEM), through CSRs until one
    is signed. `pick()` gives, for each attempt, the Kube to send it with and what the
    request is for (log lines). Failures are logged and tried again with back-off, a
    refused request with a new key."""
    delay = BACKOFF_INITIAL
    while True:
        kube, why = pick()
        key = store.pending_key()
        if key is None:
            key = new_key()
            store.keep_pending(key)
        key_usages = usages(key, "client auth")
        body = csr_object(csr_name("node-csr-", key, node, CLIENT_SIGNER, key_usages),
                          csr_pem(key, node), CLIENT_SIGNER, key_usages)
        try:
            cert = await request_certificate(kube, body, clock, what=f"{WHAT} ({why})")
            _check_issued(cert, key, node)
        except CsrRefused as e:
            log.error("%s (%s): %s; trying again with a new key in %.0f s", WHAT, why, e,
                      delay)
            store.drop_pending()
        except (ApiError, ConnectionError, TimeoutError) as e:
            log.error("%s (%s): the CertificateSigningRequest could not be sent: %s; "
                      "trying again in %.0f s", WHAT, why, brief(e), delay)
        else:
            store.drop_pending()
            return cert, key_pem(key)
        await clock.sleep(delay)
        delay = min(BACKOFF_MAX, delay * 2)


def _check_issued(cert: bytes, key: PrivateKey, node: str) -> None:
    """The signer's answer is a certificate for our key and name (not some other)."""
    try:
        parsed = x509.load_pem_x509_certificate(cert)
    except ValueError as e:
        raise CsrRefused(f"the signed certificate cannot be read: {e}") from None
    ours = key.public_key().public_bytes(serialization.Encoding.DER,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    theirs = parsed.public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo)
    if ours != theirs:
        raise CsrRefused("the signed certificate is for another key")
    if common_name(cert) != f"system:node:{node}":
        raise CsrRefused(f"the signed certificate names {common_name(cert)!r}, not "
                         f"system:node:{node}")


async def client_credentials(settings: ClientCertSettings, clock: Clock, *,
                             kube_for: KubeFor = _rest_kube) -> Credentials:
    """The credentials the agent runs with: --kubeconfig's, made first through TLS
    bootstrap when it cannot be used as it is; with rotation, the certificate rotation
    stored last (the kubeconfig names the one it was written with)."""
    store = CertStore(settings.cert_dir)
    if settings.bootstrap_kubeconfig is not None:
        if settings.kubeconfig is None:
            raise ClientConfigError("--bootstrap-kubeconfig needs --kubeconfig: the "
                                    "kubeconfig the bootstrap writes")
        reason = bootstrap_reason(settings.kubeconfig, clock.now())
        if reason is not None:
            log.info("TLS bootstrap: %s; asking for a client certificate with %s", reason,
                     settings.bootstrap_kubeconfig)
            boot = load_credentials(settings.bootstrap_kubeconfig)
            kube = kube_for(boot)
            try:
                cert, key = await obtain(lambda: (kube, "bootstrap"), store, settings.node,
                                         clock)
                path = store.save(cert, key, clock.now())
                write_kubeconfig(settings.kubeconfig, boot, store.current_path)
            except OSError as e:
                raise ClientConfigError(f"TLS bootstrap: cannot write {e.filename or ''} "
                                        f"(--cert-dir {settings.cert_dir}, --kubeconfig "
                                        f"{settings.kubeconfig}): {e.strerror or e}") from e
            finally:
                await _close(kube)
            log.info("TLS bootstrap: client certificate stored in %s, %s written", path,
                     settings.kubeconfig)
    creds = load_credentials(settings.kubeconfig)
    if settings.rotate:
        current = store.current()
        if current is not None and _usable(current, settings.node, clock.now()) and \
                store.current_path.resolve() != Path(creds.cert_file or "").resolve():
            creds.use_client_certificate(str(store.current_path))
            log.info("client certificate: using %s (the last one rotation stored)",
                     store.current_path)
    return creds


def _usable(pem: bytes, node: str, now: dt.datetime) -> bool:
    try:
        return validity(pem)[1] > now and common_name(pem) == f"system:node:{node}"
    except ValueError:
        return False


class ClientCertRotation:
    """Renews the node's client certificate before it expires (rotateCertificates)."""

    def __init__(self, settings: ClientCertSettings, creds: Credentials, kube: Kube,
                 clock: Clock, *, rng: random.Random | None = None,
                 kube_for: KubeFor = _rest_kube) -> None:
        self.settings = settings
        self.creds = creds
        self.kube = kube  # the node's own credentials (creds)
        self.clock = clock
        self.rng = rng or random.Random()
        self.kube_for = kube_for
        self.store = CertStore(settings.cert_dir)
        self.rotations = 0
        self.due: dt.datetime | None = None  # when the next request goes out

    def applies(self) -> str | None:
        """Why rotation cannot run with these credentials (None: it can): it renews
        this node's own client certificate only."""
        try:
            cert = self.creds.client_certificate()
        except OSError as e:
            return f"its client certificate cannot be read: {e}"
        if not cert:
            return "the credentials hold no client certificate"
        try:
            name = common_name(cert)
        except ValueError as e:
            return f"its client certificate cannot be read: {e}"
        if name != f"system:node:{self.settings.node}":
            return f"the client certificate is {name!r}, not system:node:{self.settings.node}"
        return None

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`."""
        why_not = self.applies()
        if why_not is not None:
            log.warning("rotateCertificates: not rotating: %s", why_not)
            return
        while not stop.is_set():
            cert = self.creds.client_certificate()
            assert cert is not None
            before, after = validity(cert)
            self.due = renew_at(before, after, self.rng)
            wait = (self.due - self.clock.now()).total_seconds()
            log.info("%s valid until %s; renewing at %s", WHAT, after.isoformat(),
                     self.due.isoformat())
            if wait > 0 and await _wait(stop, self.clock, wait):
                return
            got = await _until_stopped(stop, self._renew(after))
            if got is None:
                return
            try:
                path = self.store.save(*got, self.clock.now())
                self.creds.use_client_certificate(str(self.store.current_path))
            except (OSError, ssl.SSLError) as e:
                log.error("%s: the new certificate cannot be stored in %s: %s; asking "
                          "again in %.0f s", WHAT, self.settings.cert_dir, e, BACKOFF_MAX)
                if await _wait(stop, self.clock, BACKOFF_MAX):
                    return
                continue
            self.rotations += 1
            log.info("%s rotated: %s, valid until %s", WHAT, path,
                     validity(got[0])[1].isoformat())

    async def _renew(self, not_after: dt.datetime) -> tuple[bytes, bytes]:
        """A new pair, sent with the node's credentials while they are valid and with
        the bootstrap ones (when given) once they have expired, as at start."""
        boot: Kube | None = None

        def pick() -> tuple[Kube, str]:
            nonlocal boot
            path = self.settings.bootstrap_kubeconfig
            if self.clock.now() < not_after or path is None:
                return self.kube, "rotation"
            if boot is None:
                boot = self.kube_for(load_credentials(path))
            return boot, "rotation after expiry, with the bootstrap credentials"
        try:
            return await obtain(pick, self.store, self.settings.node, self.clock)
        finally:
            if boot is not None:
                await _close(boot)


async def _wait(stop: asyncio.Event, clock: Clock, seconds: float) -> bool:
    """Sleep up to `seconds` on `clock`; True when `stop` was set meanwhile."""
    await _until_stopped(stop, clock.sleep(seconds))
    return stop.is_set()


async def _until_stopped(stop: asyncio.Event, aw: Awaitable[T]) -> T | None:
    """`aw`'s result, or None when `stop` is set first (`aw` is cancelled then)."""
    task = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()
