"""Certificates through the CertificateSigningRequest API: the one way the agent makes a
key and a request, names and sends the CSR, waits for it to be approved and signed, and
picks when to renew. Two users: the node's client certificate (signer
kubernetes.io/kube-apiserver-client-kubelet, nodeagent.api.bootstrap) and the kubelet
API's serving certificate (kubernetes.io/kubelet-serving, nodeagent.server.tls).

A CSR is named after its key, subject and usages, so an agent restarted while it waits
finds its own request again instead of sending another. The wait is a watch on that
one name (nodeagent.api.reflector); a CSR denied, failed or deleted before it is signed
raises CsrRefused naming it and the reason given.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import hashlib
import ipaddress
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from nodeagent.api.client import ApiError, CertError
from nodeagent.api.clock import Clock, clock_timeout
from nodeagent.api.kube import CERTIFICATE_SIGNING_REQUESTS, Kube, Obj
from nodeagent.api.reflector import Reflector, ReflectorConfig

log = logging.getLogger(__name__)

CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
SERVING_SIGNER = "kubernetes.io/kubelet-serving"
NODES_GROUP = "system:nodes"
PENDING_LOG = 60.0  # seconds between "still waiting" lines while a CSR is pending

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


class CsrRefused(Exception):
    """The CSR was denied, failed or deleted before it was signed (the message names it
    and the reason), or its name is taken by a request for another key."""


# -- keys, requests, certificates --

def new_key() -> ec.EllipticCurvePrivateKey:
    """An ECDSA P-256 key, as the kubelet makes for its certificates."""
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def load_key(pem: bytes, where: str) -> PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise CertError(f"{where}: not a PEM private key: {e}") from None
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise CertError(f"{where}: an {type(key).__name__} key; ECDSA or RSA is needed")
    return key


def node_subject(node: str) -> x509.Name:
    """CN=system:node:<node>, O=system:nodes: who the API server's Node authorizer and
    NodeRestriction take the holder for."""
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, NODES_GROUP),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}")])


def sans(names: Sequence[str]) -> list[x509.GeneralName]:
    """IP addresses and DNS names, each once."""
    out: list[x509.GeneralName] = []
    for n in dict.fromkeys(n for n in names if n):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def csr_pem(key: PrivateKey, node: str, names: Sequence[str] = ()) -> bytes:
    """A PKCS#10 request for the node's subject; `names` (a serving certificate's
    addresses) become its subject alternative names. A client certificate request has
    none: the API server's kubelet-client approval refuses any."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(node_subject(node))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans(names)),
                                        critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def usages(key: PrivateKey, purpose: str) -> list[str]:
    """The key usages the signer expects for `purpose` ("client auth" or "server
    auth"): key encipherment only for an RSA key (an ECDSA key cannot encipher)."""
    out = ["digital signature"]
    if isinstance(key, rsa.RSAPrivateKey):
        out.append("key encipherment")
    return [*out, purpose]


def csr_name(prefix: str, key: PrivateKey, node: str, signer: str,
             key_usages: Sequence[str]) -> str:
    """`prefix` and a digest of what the request is: the same key asks under the same
    name, so a restarted agent finds the CSR it sent."""
    public = key.public_key().public_bytes(serialization.Encoding.DER,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    digest = hashlib.sha256(public)
    for part in (node, signer, *key_usages):
        digest.update(b"\0" + part.encode())
    return prefix + digest.hexdigest()[:40]


def csr_object(name: str, request: bytes, signer: str, key_usages: Sequence[str]) -> Obj:
    return {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
            "metadata": {"name": name},
            "spec": {"request": base64.b64encode(request).decode(), "signerName": signer,
                     "usages": list(key_usages)}}


def validity(cert_pem: bytes) -> tuple[dt.datetime, dt.datetime]:
    """(not before, not after) of the first certificate in `cert_pem`."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return cert.not_valid_before_utc, cert.not_valid_after_utc


def common_name(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def renew_at(not_before: dt.datetime, not_after: dt.datetime, rng: random.Random) -> dt.datetime:
    """A random point between 70 % and 90 % of the certificate's lifetime (the kubelet's
    rule: many nodes signed at once do not all come back at once)."""
    return not_before + (not_after - not_before) * rng.uniform(0.7, 0.9)


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by the owner only, replacing it in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# -- the request and the wait --

def issued(csr: Obj) -> bytes | None:
    """The signed certificate (PEM) once there is one; raises CsrRefused when the CSR
    is denied or failed."""
    name = (csr.get("metadata") or {}).get("name", "")
    status = csr.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") in ("Denied", "Failed") and c.get("status", "True") == "True":
            why = " ".join(str(c.get(k)) for k in ("reason", "message") if c.get(k))
            raise CsrRefused(f"CertificateSigningRequest {name} {c['type'].lower()}"
                             + (f": {why}" if why else ""))
    cert = status.get("certificate")
    return base64.b64decode(cert) if cert else None


def _same_request(existing: Obj, body: Obj) -> bool:
    """The CSR found under our name asks for our key, from the same signer."""
    spec, ours = existing.get("spec") or {}, body["spec"]
    if spec.get("signerName") != ours["signerName"]:
        return False
    try:
        theirs = x509.load_pem_x509_csr(base64.b64decode(spec.get("request") or ""))
        mine = x509.load_pem_x509_csr(base64.b64decode(ours["request"]))
    except ValueError:
        return False
    return bool(theirs.public_key() == mine.public_key())


@dataclasses.dataclass
class _Watched:
    """What the watch on one CSR saw: the certificate or why there will be none."""

    name: str
    done: asyncio.Future[bytes]

    def on_list(self, items: list[Obj]) -> None:
        if not items:
            self._fail(CsrRefused(f"CertificateSigningRequest {self.name} was deleted "
                                  "before it was signed"))
        for obj in items:
            self._look(obj)

    def on_events(self, events: list[tuple[str, Obj]]) -> None:
        for kind, obj in events:
            if kind == "DELETED":
                self._fail(CsrRefused(f"CertificateSigningRequest {self.name} was "
                                      "deleted before it was signed"))
            else:
                self._look(obj)

    def _look(self, obj: Obj) -> None:
        try:
            cert = issued(obj)
        except CsrRefused as e:
            self._fail(e)
            return
        if cert is not None and not self.done.done():
            self.done.set_result(cert)

    def _fail(self, e: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(e)


async def request_certificate(kube: Kube, body: Obj, clock: Clock, *, what: str) -> bytes:
    """Send the CSR `body` and wait until it is signed: the certificate PEM. A CSR of the
    same name sent earlier for the same key (a restart while waiting) is waited for
    instead. Raises CsrRefused (denied, failed, deleted, or the name taken by another
    key's request) and the API's errors of the create. `what` names the certificate in
    log lines."""
    name = body["metadata"]["name"]
    signer = body["spec"]["signerName"]
    try:
        await kube.create(CERTIFICATE_SIGNING_REQUESTS, body, timeout=30.0)
        log.info("%s: CertificateSigningRequest %s sent (signer %s); waiting for its "
                 "approval and signature", what, name, signer)
    except ApiError as e:
        if e.status != 409:
            raise
        existing = await kube.get(CERTIFICATE_SIGNING_REQUESTS, name, timeout=30.0)
        if not _same_request(existing, body):
            raise CsrRefused(f"CertificateSigningRequest {name} exists for another key "
                             "or signer") from None
        log.info("%s: CertificateSigningRequest %s was sent before; waiting for it", what,
                 name)
    done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    reflector = Reflector(kube, ReflectorConfig(
        CERTIFICATE_SIGNING_REQUESTS, name=f"CertificateSigningRequest {name}",
        field_selector=f"metadata.name={name}", backoff_max=10.0),
        _Watched(name, done), clock)
    watching = asyncio.create_task(reflector.run(), name=f"csr-{name}")
    try:
        while True:
            try:
                return await clock_timeout(clock, asyncio.shield(done), PENDING_LOG,
                                           "pending")
            except TimeoutError:
                pass
            log.info("%s: CertificateSigningRequest %s is still waiting to be approved "
                     "and signed (kubectl certificate approve %s)", what, name, name)
    finally:
        reflector.stop()
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        if not done.done():
            done.cancel()

