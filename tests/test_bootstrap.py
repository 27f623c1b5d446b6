"""TLS bootstrap and client-certificate rotation (nodeagent.api.bootstrap) against the
in-memory API and a test CA, on a FakeClock: the CSR's fields, the files and kubeconfig
written, a restart while waiting, denials and API errors retried with back-off, and
rotation at its time with the API client moving to the new certificate."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import logging
import random
import stat
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nodeagent.api.bootstrap import (
    BACKOFF_INITIAL,
    CURRENT,
    PENDING_KEY,
    ClientCertRotation,
    ClientCertSettings,
    client_credentials,
)
from nodeagent.api.certificates import renew_at, validity
from nodeagent.api.client import ClientConfigError, Credentials, load_credentials
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import CERTIFICATE_SIGNING_REQUESTS as CSRS
from nodeagent.api.kube import Kube
from nodeagent.api.rest import Connections
from tests.conftest import TestSigner, aio
from tests.fakekube import FakeKube, api_error

NODE = "n1"
SERVER = "https://203.0.113.5:6443"


class Rig:
    def __init__(self, tmp: Path, *, rotate: bool = True) -> None:
        self.clock = FakeClock(dt.datetime(2026, 3, 1, tzinfo=dt.UTC))
        self.kube = FakeKube(self.clock.monotonic)
        self.signer = TestSigner(self.kube, self.clock)
        self.ca_pem = self.signer.cert.public_bytes(serialization.Encoding.PEM)
        self.boot = tmp / "bootstrap-kubelet.conf"
        self.boot.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "b",
            "clusters": [{"name": "c", "cluster": {
                "server": SERVER,
                "certificate-authority-data": base64.b64encode(self.ca_pem).decode()}}],
            "users": [{"name": "u", "user": {"token": "abcdef.0123456789abcdef"}}],
            "contexts": [{"name": "b", "context": {"cluster": "c", "user": "u"}}]}))
        self.settings = ClientCertSettings(node=NODE, kubeconfig=tmp / "kubelet.conf",
                                           bootstrap_kubeconfig=self.boot,
                                           cert_dir=tmp / "pki", rotate=rotate)
        self.built_with: list[Credentials] = []  # credentials each bootstrap Kube had

    def kube_for(self, creds: Credentials) -> Kube:
        self.built_with.append(creds)
        return self.kube

    async def credentials(self) -> Credentials:
        return await client_credentials(self.settings, self.clock, kube_for=self.kube_for)


@aio
async def test_bootstrap_gets_a_client_certificate_and_writes_the_kubeconfig(
        tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    task = asyncio.create_task(rig.credentials())
    await settle()
    [name] = rig.signer.pending()
    assert name.startswith("node-csr-")
    assert rig.built_with[0].authorization() == "Bearer abcdef.0123456789abcdef"
    spec = rig.kube.obj(CSRS, name)["spec"]
    assert spec["signerName"] == "kubernetes.io/kube-apiserver-client-kubelet"
    assert spec["usages"] == ["digital signature", "client auth"]
    req = x509.load_pem_x509_csr(base64.b64decode(spec["request"]))
    assert req.subject.rfc4514_string() == f"CN=system:node:{NODE},O=system:nodes"
    pending = tmp_path / "pki" / PENDING_KEY
    assert stat.S_IMODE(pending.stat().st_mode) == 0o600  # kept while waiting
    pem = rig.signer.sign(name)
    creds = await task
    current = tmp_path / "pki" / CURRENT
    assert current.is_symlink()
    stored = current.resolve()
    assert stored.name == "kubelet-client-2026-03-01-00-00-00.pem"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert stored.read_bytes().startswith(pem) and b"PRIVATE KEY" in stored.read_bytes()
    assert not pending.exists()
    written = yaml.safe_load(rig.settings.kubeconfig.read_text())  # type: ignore[union-attr]
    [cluster] = written["clusters"]
    assert cluster["cluster"] == {"server": SERVER, "certificate-authority-data":
                                  base64.b64encode(rig.ca_pem).decode()}
    assert written["users"][0]["user"] == {"client-certificate": str(current),
                                           "client-key": str(current)}
    assert creds.server == SERVER and creds.cert_file == str(current)
    assert creds.authorization() is None  # the certificate, no token
    assert creds.client_certificate() == stored.read_bytes()


@aio
async def test_a_restart_while_waiting_finds_its_csr_again(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    first = asyncio.create_task(rig.credentials())
    await settle()
    [name] = rig.signer.pending()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    again = asyncio.create_task(rig.credentials())
    await settle()
    assert rig.signer.pending() == [name]  # the same key, the same request
    rig.signer.sign(name)
    await again
    assert len(rig.kube.items(CSRS)) == 1


@aio
async def test_a_denied_csr_is_logged_and_a_new_one_sent_after_a_backoff(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(tmp_path)
    task = asyncio.create_task(rig.credentials())
    await settle()
    [name] = rig.signer.pending()
    with caplog.at_level(logging.ERROR, "nodeagent.api.bootstrap"):
        rig.signer.deny(name, "Unknown", "this node is not expected")
        await settle()
    assert f"CertificateSigningRequest {name} denied: Unknown this node is not expected" \
        in caplog.text
    assert not task.done() and rig.signer.pending() == []
    await rig.clock.advance(BACKOFF_INITIAL - 0.5)
    assert rig.signer.pending() == []  # not before its back-off
    await rig.clock.advance(1)
    [second] = rig.signer.pending()
    assert second != name  # a new key
    rig.signer.sign(second)
    await task


@aio
async def test_api_errors_are_logged_and_retried_with_growing_backoff(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(tmp_path)
    forbidden = api_error(403, message="User \"system:anonymous\" cannot create resource")
    rig.kube.fail("create certificatesigningrequests", forbidden, forbidden)
    with caplog.at_level(logging.ERROR, "nodeagent.api.bootstrap"):
        task = asyncio.create_task(rig.credentials())
        await settle()
    assert "could not be sent: HTTP 403 Forbidden: User \"system:anonymous\"" in caplog.text
    await rig.clock.advance(BACKOFF_INITIAL)
    assert rig.kube.count("create certificatesigningrequests") == 2
    await rig.clock.advance(BACKOFF_INITIAL)  # the second wait is twice as long
    assert rig.kube.count("create certificatesigningrequests") == 2
    await rig.clock.advance(BACKOFF_INITIAL)
    [name] = rig.signer.pending()
    rig.signer.sign(name)
    await task


@aio
async def test_a_usable_kubeconfig_needs_no_bootstrap_and_an_expired_one_does(
        tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    task = asyncio.create_task(rig.credentials())
    await settle()
    [name] = rig.signer.pending()
    rig.signer.sign(name, lifetime=dt.timedelta(days=1))
    await task
    calls = len(rig.kube.calls)
    await rig.credentials()  # a restart: the kubeconfig is good
    assert len(rig.kube.calls) == calls
    await rig.clock.advance(2 * 86400)  # the certificate has expired
    task = asyncio.create_task(rig.credentials())
    await settle()
    [again] = rig.signer.pending()
    rig.signer.sign(again)
    creds = await task
    assert validity(creds.client_certificate() or b"")[1] > rig.clock.now()


@aio
async def test_bootstrap_needs_the_kubeconfig_path(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    settings = ClientCertSettings(node=NODE, kubeconfig=None, bootstrap_kubeconfig=rig.boot,
                                  cert_dir=tmp_path, rotate=False)
    with pytest.raises(ClientConfigError, match="--bootstrap-kubeconfig needs --kubeconfig"):
        await client_credentials(settings, rig.clock, kube_for=rig.kube_for)


async def bootstrapped(rig: Rig, lifetime: dt.timedelta) -> Credentials:
    task = asyncio.create_task(rig.credentials())
    await settle()
    [name] = rig.signer.pending()
    rig.signer.sign(name, lifetime=lifetime)
    return await task


@aio
async def test_rotation_renews_at_its_time_and_the_client_moves_to_it(
        tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    creds = await bootstrapped(rig, dt.timedelta(days=100))
    first = creds.client_certificate() or b""
    rotation = ClientCertRotation(rig.settings, creds, rig.kube, rig.clock,
                                  rng=random.Random(7), kube_for=rig.kube_for)
    stop = asyncio.Event()
    task = asyncio.create_task(rotation.run(stop))
    await settle()
    due = renew_at(*validity(first), random.Random(7))
    assert rotation.due == due
    await rig.clock.advance((due - rig.clock.now()).total_seconds() - 1)
    assert rig.signer.pending() == []
    await rig.clock.advance(2)
    [name] = rig.signer.pending()
    assert len(rig.built_with) == 1  # sent with the node's credentials, not bootstrap
    generation = creds.generation
    rig.signer.sign(name, lifetime=dt.timedelta(days=100))
    await settle()
    assert rotation.rotations == 1 and creds.generation == generation + 1
    second = creds.client_certificate() or b""
    assert second != first and validity(second)[0] == rig.clock.now().replace(microsecond=0)
    stored = sorted(p.name for p in (tmp_path / "pki").glob("kubelet-client-2*.pem"))
    assert len(stored) == 2 and (tmp_path / "pki" / CURRENT).resolve().name == stored[-1]
    # a restart takes the rotated certificate, not the one the kubeconfig was written with
    again = await rig.credentials()
    assert again.client_certificate() == second
    stop.set()
    await task


@aio
async def test_rotation_after_expiry_asks_with_the_bootstrap_credentials(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(tmp_path)
    creds = await bootstrapped(rig, dt.timedelta(days=10))
    not_after = validity(creds.client_certificate() or b"")[1]
    rotation = ClientCertRotation(rig.settings, creds, rig.kube, rig.clock,
                                  rng=random.Random(1), kube_for=rig.kube_for)
    # the API server takes the node's certificate no more (until the bootstrap's)
    rig.kube.intercept("create certificatesigningrequests",
                       lambda call: api_error(401) if len(rig.built_with) == 1 else None)
    stop = asyncio.Event()
    task = asyncio.create_task(rotation.run(stop))
    with caplog.at_level(logging.ERROR, "nodeagent.api.bootstrap"):
        await rig.clock.advance((not_after - rig.clock.now()).total_seconds() - 60)
    assert "client certificate (rotation): the CertificateSigningRequest could not be " \
        "sent: HTTP 401" in caplog.text
    assert rig.signer.pending() == [] and len(rig.built_with) == 1
    await rig.clock.advance(400)  # expired: the next attempt goes with the bootstrap's
    assert len(rig.built_with) == 2
    [name] = rig.signer.pending()
    rig.signer.sign(name)
    await settle()
    assert rotation.rotations == 1
    stop.set()
    await task


@aio
async def test_rotation_leaves_certificates_of_others_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(tmp_path)
    creds = load_credentials(rig.boot)  # a token, no certificate
    rotation = ClientCertRotation(rig.settings, creds, rig.kube, rig.clock)
    with caplog.at_level(logging.WARNING, "nodeagent.api.bootstrap"):
        await rotation.run(asyncio.Event())
    assert "not rotating: the credentials hold no client certificate" in caplog.text


@aio
async def test_a_new_client_certificate_gets_new_connections(tmp_path: Path) -> None:
    """After rotation, requests go over connections made with the new certificate; the
    old connections are closed later (the API server checks expiry on every request)."""
    rig = Rig(tmp_path)
    creds = await bootstrapped(rig, dt.timedelta(days=100))
    pool = Connections(creds)
    old = pool.session()
    assert pool.session() is old
    context = creds.ssl_context()
    creds.use_client_certificate(str(tmp_path / "pki" / CURRENT))
    assert creds.ssl_context() is context  # the same context, its chain replaced
    new = pool.session()
    assert new is not old and not old.closed
    await pool.aclose()
    assert old.closed and new.closed
