"""The kubelet API's self-signed certificate (nodeagent.server.tls and
nodeagent.server.selfsigned): made by a child process, so that the agent's process never
loads the crypto library for it; kept while it is valid past tomorrow, made anew near its
end or when the file is unusable; a failure is a CertError naming the file and why."""

from __future__ import annotations

import datetime as dt
import logging
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.api.certificates import validity
from nodeagent.api.clock import FakeClock
from nodeagent.server.tls import CertError, ServingCert

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
FILE = "kubelet-server-self-signed.pem"


def serving(pki: Path, now: dt.datetime) -> ServingCert:
    cert = ServingCert(node="n1", names=["127.0.0.1", "n1"], pki_dir=pki,
                       clock=FakeClock(now))
    cert.load_self_signed()
    return cert


def test_an_agent_serving_self_signed_never_loads_the_crypto_library(tmp_path: Path) -> None:
    """In a fresh interpreter: the agent's modules and the kubelet API's server, and a
    certificate made and loaded, with no cryptography module imported."""
    script = f"""
import sys, datetime as dt
from pathlib import Path
import nodeagent.cli, nodeagent.agent, nodeagent.server.kubeletserver, nodeagent.server.bundle
from nodeagent.api.clock import FakeClock
from nodeagent.server.tls import ServingCert
cert = ServingCert(node="n1", names=["127.0.0.1"], pki_dir=Path({str(tmp_path)!r}),
                   clock=FakeClock(dt.datetime(2026, 1, 2, tzinfo=dt.UTC)))
cert.load_self_signed()
print(cert.not_after.isoformat())
print(sorted(m for m in sys.modules if m.split(".")[0] in ("cryptography", "_cffi_backend")))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).parents[1])
    not_after, loaded = done.stdout.splitlines()
    assert loaded == "[]"
    assert not_after == validity((tmp_path / FILE).read_bytes())[1].isoformat()


def test_a_valid_certificate_is_kept_and_one_near_its_end_made_anew(tmp_path: Path) -> None:
    first = serving(tmp_path, NOW)
    made = (tmp_path / FILE).read_bytes()
    before, after = validity(made)
    assert first.not_after == after and after - before > dt.timedelta(days=364)
    assert (tmp_path / FILE).stat().st_mode & 0o777 == 0o600
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(tmp_path / FILE)

    assert serving(tmp_path, after - dt.timedelta(days=2)).not_after == after
    assert (tmp_path / FILE).read_bytes() == made

    renewed = serving(tmp_path, after - dt.timedelta(hours=12))
    assert (tmp_path / FILE).read_bytes() != made
    assert renewed.not_after == validity((tmp_path / FILE).read_bytes())[1] > after


def test_an_unusable_file_is_replaced_with_a_warning(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / FILE).write_bytes(b"-----BEGIN CERTIFICATE-----\nnot one\n")
    with caplog.at_level(logging.WARNING, logger="nodeagent.server.tls"):
        cert = serving(tmp_path, NOW)
    assert cert.not_after == validity((tmp_path / FILE).read_bytes())[1]
    assert f"{tmp_path / FILE} is unusable; making a new self-signed certificate" \
        in caplog.text


def test_a_certificate_that_cannot_be_written_is_an_error_naming_the_file(
        tmp_path: Path) -> None:
    blocker = tmp_path / "pki"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(CertError) as e:
        serving(blocker, NOW)
    assert str(e.value).startswith(f"{blocker / FILE}: making the self-signed certificate "
                                   "failed: ")
    assert "Errno" in str(e.value)
