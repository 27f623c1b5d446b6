"""The local control plane's own PKI: a CA, serving and client certificates, and
the service-account signing key."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=2)  # a test cluster lives for minutes


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


class CertificateAuthority:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.cert_path = directory / "ca.crt"
        self.key_path = directory / "ca.key"
        if self.cert_path.exists():
            self.key = serialization.load_pem_private_key(self.key_path.read_bytes(), None)
            self.cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
            return
        directory.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self.cert = (x509.CertificateBuilder()
                     .subject_name(_name("nodepulse-e2e-ca")).issuer_name(_name("nodepulse-e2e-ca"))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(True, False, False, False, False, True, True,
                                                  False, False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        _write_key(self.key_path, self.key)
        self.cert_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, stem: str, cn: str, orgs: tuple[str, ...] = (), *,
              server_names: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """Write <stem>.crt/.key: a client cert, or a serving cert for `server_names`."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (x509.CertificateBuilder()
                   .subject_name(_name(cn, orgs)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(_sans(server_names)),
                                            critical=False)
        assert isinstance(self.key, ec.EllipticCurvePrivateKey)
        cert = builder.sign(self.key, hashes.SHA256())
        crt, keyp = self.dir / f"{stem}.crt", self.dir / f"{stem}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(keyp, key)
        return crt, keyp


def service_account_keys(directory: Path) -> tuple[Path, Path]:
    """RSA key pair the API server signs service-account tokens with."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    priv, pub = directory / "sa.key", directory / "sa.pub"
    _write_key(priv, key)
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def _sans(names: tuple[str, ...]) -> list[x509.GeneralName]:
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    return sans


def csr_pem(cn: str, orgs: tuple[str, ...], names: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
    """(CSR PEM, private key PEM) for a CertificateSigningRequest to an existing cluster;
    `names`: the subject alternative names of a serving certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(_name(cn, orgs))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(_sans(names)),
                                        critical=False)
    csr = builder.sign(key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return csr.public_bytes(serialization.Encoding.PEM), key_pem
