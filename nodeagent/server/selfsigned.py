"""The kubelet API's self-signed certificate, made in a child process:

    python -m nodeagent.server.selfsigned PATH NODE NOW NAME...

keeps PATH holding a certificate and key (one file, 0600) for NAMEs that stays valid at
least a day past NOW (ISO 8601), making a new one when it does not, and prints its
notAfter. The agent runs main() so (through `python -c`, nodeagent.server.tls) instead of
making the certificate itself, so that its own, long-lived process never loads the crypto
library: a host of virtual nodes serving self-signed would carry it for nothing after the
first second.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nodeagent.api.certificates import key_pem, new_key, sans, validity, write_private

VALIDITY = dt.timedelta(days=365)
KEEP_MARGIN = dt.timedelta(days=1)  # a certificate this close to its end is made anew


def self_signed(node: str, names: Sequence[str], now: dt.datetime) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for `names`, valid a year."""
    key = new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                            f"{node}@{int(now.timestamp())}")])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans(names)), critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)


def ensure(path: Path, node: str, names: Sequence[str], now: dt.datetime) -> dt.datetime:
    """The notAfter of the certificate at `path`, made anew unless the one there is
    readable and valid past `now` + KEEP_MARGIN."""
    try:
        pem = path.read_bytes()
        not_after = validity(pem)[1]
        serialization.load_pem_private_key(pem, password=None)
        if not_after > now + KEEP_MARGIN:
            return not_after
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError):
        print(f"{path} is unusable; making a new self-signed certificate", file=sys.stderr)
    cert, key = self_signed(node, names, now)
    write_private(path, cert + key)
    return validity(cert)[1]


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3:
        print("usage: python -m nodeagent.server.selfsigned PATH NODE NOW NAME...",
              file=sys.stderr)
        return 2
    path, node, now = Path(argv[0]), argv[1], dt.datetime.fromisoformat(argv[2])
    try:
        print(ensure(path, node, argv[3:], now).isoformat())
    except OSError as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
