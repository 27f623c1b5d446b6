"""The kubelet API's serving certificate, from one of three places:

- files (--tls-cert-file, --tls-private-key-file), read at start;
- the CertificateSigningRequest API (--rotate-server-certificates): a key made here, a
  CSR for signer kubernetes.io/kubelet-serving naming the node (CN system:node:<name>,
  O system:nodes) and its addresses, the signed certificate saved under
  <root-dir>/pki and used at once, and a new one requested at a random point between
  70 % and 90 % of its lifetime (the kubelet's rule); someone (an approver, an admin)
  must approve each CSR, as for the kubelet (the request and the wait:
  nodeagent.api.certificates);
- else self-signed, saved under <root-dir>/pki and made at start, when none there is
  valid past tomorrow, by a child process (nodeagent.server.selfsigned), so that the
  crypto library it needs is never loaded into the agent.

One ssl.SSLContext serves every connection; a renewed certificate is loaded into it,
so connections made afterwards get the new one. With --client-ca-file the context asks
for a client certificate and verifies any given against that CA.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import random
import ssl
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import nodeagent
from nodeagent.api.client import CertError
from nodeagent.api.clock import Clock
from nodeagent.api.kube import Kube

log = logging.getLogger(__name__)

RETRY = 30.0    # seconds before a refused or failed CSR is tried again
SELF_SIGNED_TIMEOUT = 120.0  # seconds the child making the self-signed certificate may take

__all__ = ["CertError", "ServingCert"]

# The child making the self-signed certificate imports this very package, wherever it
# was loaded from; its folder goes first on the path once the interpreter has started,
# so that nothing beside the package stands in for a standard module.
_CHILD = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
          "from nodeagent.server.selfsigned import main; sys.exit(main(sys.argv[1:]))")

# nodeagent.api.certificates (and with it the crypto library) is imported by the methods
# that read or request a certificate in this process (files, CSR rotation): an agent
# serving self-signed never loads it, its certificate made by a child
# (nodeagent.server.selfsigned).


class ServingCert:
    """The server's TLS context and where its certificate comes from."""

    def __init__(self, *, node: str, names: Sequence[str], pki_dir: Path,
                 cert_file: str | None = None, key_file: str | None = None,
                 client_ca_file: str | None = None, clock: Clock,
                 rng: random.Random | None = None, tls13_only: bool = False) -> None:
        self.node = node
        self.names = list(names)
        self.pki_dir = pki_dir
        self.cert_file = cert_file
        self.key_file = key_file
        self.clock = clock
        self.rng = rng or random.Random()
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_3 if tls13_only \
            else ssl.TLSVersion.TLSv1_2
        if client_ca_file:
            try:
                self.context.load_verify_locations(cafile=client_ca_file)
            except (OSError, ssl.SSLError) as e:
                raise CertError(f"--client-ca-file {client_ca_file}: {e}") from None
            self.context.verify_mode = ssl.CERT_OPTIONAL
        self.not_after: dt.datetime | None = None
        self.renewals = 0  # certificates received through CSRs

    # -- loading --
    def load_files(self) -> None:
        from nodeagent.api.certificates import validity
        assert self.cert_file and self.key_file
        try:
            self.context.load_cert_chain(self.cert_file, self.key_file)
            self.not_after = validity(Path(self.cert_file).read_bytes())[1]
        except (OSError, ssl.SSLError, ValueError) as e:
            raise CertError(f"--tls-cert-file {self.cert_file} / --tls-private-key-file "
                            f"{self.key_file}: {e}") from None

    def use(self, cert_pem: bytes, key_pem: bytes, path: Path) -> None:
        """Save cert + key in one file (0600) and serve them from now on."""
        from nodeagent.api.certificates import validity, write_private
        write_private(path, cert_pem + key_pem)
        try:
            self.context.load_cert_chain(path)
        except ssl.SSLError as e:
            raise CertError(f"{path}: {e}") from None
        self.not_after = validity(cert_pem)[1]

    def load_self_signed(self) -> None:
        """Serve the self-signed certificate under the pki folder, made anew by a child
        process when there is none valid past tomorrow (nodeagent.server.selfsigned)."""
        path = self.pki_dir / "kubelet-server-self-signed.pem"
        argv = [sys.executable, "-c", _CHILD, str(Path(nodeagent.__file__).parents[1]),
                str(path), self.node, self.clock.now().isoformat(), *self.names]
        try:
            done = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=SELF_SIGNED_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CertError(f"{path}: making the self-signed certificate: {e}") from None
        said = done.stderr.strip().splitlines()
        if done.returncode != 0:
            why = said[-1] if said else f"exit {done.returncode}"
            raise CertError(f"{path}: making the self-signed certificate failed: {why}")
        for line in said:
            log.warning("kubelet API: %s", line)
        try:
            self.context.load_cert_chain(path)
            self.not_after = dt.datetime.fromisoformat(done.stdout.strip())
        except (OSError, ssl.SSLError, ValueError) as e:
            raise CertError(f"{path}: {e}") from None
        log.info("kubelet API: serving a self-signed certificate (%s)", path)

    # -- rotation through the CSR API --
    @property
    def current_path(self) -> Path:
        return self.pki_dir / "kubelet-server-current.pem"

    def load_current(self) -> tuple[dt.datetime, dt.datetime] | None:
        """The certificate an earlier run got, if it is still valid."""
        from nodeagent.api.certificates import validity
        try:
            pem = self.current_path.read_bytes()
            before, after = validity(pem)
        except (OSError, ValueError):
            return None
        if after <= self.clock.now():
            return None
        try:
            self.context.load_cert_chain(self.current_path)
        except ssl.SSLError:
            return None
        self.not_after = after
        return before, after

    async def rotate(self, kube: Kube, stop: asyncio.Event) -> None:
        """Keep a CSR-signed certificate in place until `stop` (the interim one is
        self-signed)."""
        from nodeagent.api.certificates import renew_at, validity
        current = self.load_current()
        if current is None and self.not_after is None:  # none loaded yet: the interim one
            self.load_self_signed()
        while not stop.is_set():
            if current is not None:
                due = renew_at(*current, self.rng)
                wait = (due - self.clock.now()).total_seconds()
                if wait > 0:
                    log.info("kubelet API: serving certificate valid until %s; renewing "
                             "at %s", current[1].isoformat(), due.isoformat())
                    if await _wait(stop, self.clock, wait):
                        return
            request = asyncio.ensure_future(self._request(kube))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({request, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not request.done():
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
                return
            try:
                cert, key = request.result()
            except Exception as e:  # noqa: BLE001 - logged; tried again after RETRY
                log.warning("kubelet API: serving certificate request failed: %s; trying "
                            "again in %.0f s", e, RETRY)
                if await _wait(stop, self.clock, RETRY):
                    return
                continue
            self.use(cert, key, self.current_path)
            current = validity(cert)
            self.renewals += 1
            log.info("kubelet API: new serving certificate, valid until %s",
                     current[1].isoformat())

    async def _request(self, kube: Kube) -> tuple[bytes, bytes]:
        """A new key and its certificate, signed by kubernetes.io/kubelet-serving for the
        node's names."""
        from nodeagent.api import certificates as c
        key = c.new_key()
        key_usages = c.usages(key, "server auth")
        body = c.csr_object(c.csr_name("csr-", key, self.node, c.SERVING_SIGNER, key_usages),
                            c.csr_pem(key, self.node, self.names), c.SERVING_SIGNER,
                            key_usages)
        cert = await c.request_certificate(kube, body, self.clock,
                                           what="kubelet API serving certificate")
        return cert, c.key_pem(key)


async def _wait(stop: asyncio.Event, clock: Clock, seconds: float) -> bool:
    """Sleep up to `seconds`; True when `stop` was set meanwhile."""
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        stopper.cancel()
    return stop.is_set()
