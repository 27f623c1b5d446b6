"""Certificates through the CSR API (nodeagent.api.certificates), shared by the node's
client certificate and the kubelet API's serving certificate: the request's fields, the
wait for the signature by a watch, refusals named, a restarted requester finding its
CSR, and the serving certificate's renewal at 70-90 % of its lifetime."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import random
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa

from nodeagent.api.certificates import (
    CLIENT_SIGNER,
    CsrRefused,
    csr_name,
    csr_object,
    csr_pem,
    issued,
    new_key,
    renew_at,
    request_certificate,
    usages,
    validity,
)
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import CERTIFICATE_SIGNING_REQUESTS as CSRS
from nodeagent.server.tls import ServingCert
from tests.conftest import TestSigner, aio
from tests.fakekube import FakeKube


def client_csr(node: str = "n1") -> dict:
    key = new_key()
    u = usages(key, "client auth")
    return csr_object(csr_name("node-csr-", key, node, CLIENT_SIGNER, u), csr_pem(key, node),
                      CLIENT_SIGNER, u)


def test_usages_add_key_encipherment_only_for_rsa() -> None:
    assert usages(new_key(), "client auth") == ["digital signature", "client auth"]
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert usages(rsa_key, "server auth") == ["digital signature", "key encipherment",
                                              "server auth"]


def test_the_request_names_the_node_and_nothing_else() -> None:
    req = x509.load_pem_x509_csr(csr_pem(new_key(), "n1"))
    assert req.subject.rfc4514_string() == "CN=system:node:n1,O=system:nodes"
    assert not list(req.extensions)  # no SAN: the client approval refuses any
    served = x509.load_pem_x509_csr(csr_pem(new_key(), "n1", ["127.0.0.1", "n1"]))
    san = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(v) for v in san.get_values_for_type(x509.DNSName)] == ["n1"]


def test_the_name_follows_the_key() -> None:
    key = new_key()
    u = usages(key, "client auth")
    assert csr_name("p-", key, "n1", CLIENT_SIGNER, u) == csr_name("p-", key, "n1",
                                                                     CLIENT_SIGNER, u)
    assert csr_name("p-", key, "n1", CLIENT_SIGNER, u) != csr_name("p-", new_key(), "n1",
                                                                     CLIENT_SIGNER, u)
    assert csr_name("p-", key, "n1", CLIENT_SIGNER, u) != csr_name("p-", key, "n2",
                                                                     CLIENT_SIGNER, u)


def test_renewal_falls_between_70_and_90_percent() -> None:
    before = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    after = before + dt.timedelta(days=100)
    points = [renew_at(before, after, random.Random(i)) for i in range(50)]
    assert all(before + dt.timedelta(days=70) <= p <= before + dt.timedelta(days=90)
               for p in points)
    assert len(set(points)) > 1


@aio
async def test_signed_certificate_comes_by_the_watch() -> None:
    clock = FakeClock()
    kube = FakeKube(clock.monotonic)
    signer = TestSigner(kube, clock)
    body = client_csr()
    task = asyncio.create_task(request_certificate(kube, body, clock, what="test"))
    await settle()
    name = body["metadata"]["name"]
    assert signer.pending() == [name]
    sent = kube.obj(CSRS, name)["spec"]
    assert sent["signerName"] == CLIENT_SIGNER
    assert sent["usages"] == ["digital signature", "client auth"]
    await clock.advance(600)  # pending a while: only log lines
    assert not task.done()
    pem = signer.sign(name)
    assert await task == pem
    assert kube.watches_open == 0  # the watch is closed once it has served


@aio
async def test_denied_and_deleted_requests_are_refusals_naming_the_csr() -> None:
    clock = FakeClock()
    kube = FakeKube(clock.monotonic)
    signer = TestSigner(kube, clock)
    body = client_csr()
    name = body["metadata"]["name"]
    task = asyncio.create_task(request_certificate(kube, body, clock, what="test"))
    await settle()
    signer.deny(name, "NotMine", "not a node of ours")
    with pytest.raises(CsrRefused, match=f"{name} denied: NotMine not a node of ours"):
        await task
    other = client_csr()
    task = asyncio.create_task(request_certificate(kube, other, clock, what="test"))
    await settle()
    kube.remove(CSRS, other["metadata"]["name"])
    with pytest.raises(CsrRefused, match="deleted before it was signed"):
        await task


@aio
async def test_a_restarted_requester_waits_for_the_csr_it_sent() -> None:
    clock = FakeClock()
    kube = FakeKube(clock.monotonic)
    signer = TestSigner(kube, clock)
    body = client_csr()
    first = asyncio.create_task(request_certificate(kube, body, clock, what="test"))
    await settle()
    first.cancel()
    again = asyncio.create_task(request_certificate(kube, body, clock, what="test"))
    await settle()
    assert kube.count("create certificatesigningrequests", ok=False) == 1  # 409
    pem = signer.sign(body["metadata"]["name"])
    assert await again == pem
    assert len(kube.items(CSRS)) == 1


@aio
async def test_a_name_taken_by_another_key_is_refused() -> None:
    clock = FakeClock()
    kube = FakeKube(clock.monotonic)
    body, other = client_csr(), client_csr()
    other["metadata"]["name"] = body["metadata"]["name"]
    kube.put(CSRS, other)
    with pytest.raises(CsrRefused, match="exists for another key"):
        await request_certificate(kube, body, clock, what="test")


@aio
async def test_the_serving_certificate_is_renewed_at_its_time(tmp_path: Path) -> None:
    clock = FakeClock(dt.datetime(2026, 1, 2, tzinfo=dt.UTC))
    kube = FakeKube(clock.monotonic)
    signer = TestSigner(kube, clock)
    cert = ServingCert(node="n1", names=["127.0.0.1"], pki_dir=tmp_path, clock=clock,
                       rng=random.Random(3))
    stop = asyncio.Event()
    task = asyncio.create_task(cert.rotate(kube, stop))
    await settle()
    [name] = signer.pending()
    spec = kube.obj(CSRS, name)["spec"]
    assert spec["signerName"] == "kubernetes.io/kubelet-serving"
    assert spec["usages"] == ["digital signature", "server auth"]
    first = signer.sign(name, lifetime=dt.timedelta(days=10))
    await settle()
    assert cert.renewals == 1 and cert.not_after == validity(first)[1]
    assert cert.current_path.read_bytes().startswith(first)
    due = renew_at(*validity(first), random.Random(3))
    await clock.advance((due - clock.now()).total_seconds() - 1)
    assert signer.pending() == []
    await clock.advance(2)
    [again] = signer.pending()
    assert again != name
    signer.sign(again)
    await settle()
    assert cert.renewals == 2
    stop.set()
    await task


def test_issued_reads_the_certificate_field() -> None:
    assert issued({"metadata": {"name": "x"}, "status": {}}) is None
    assert issued({"status": {"certificate": base64.b64encode(b"PEM").decode()}}) == b"PEM"
    # a condition that is not in force refuses nothing
    assert issued({"status": {"conditions": [{"type": "Failed", "status": "False"}]}}) is None
