"""The lab node's own certificate authority, and the credentials it issues.

Every connection of a lab node is mutual TLS under this CA (``ssl.CERT_REQUIRED`` both
ways), so a peer without a certificate of this lab is dropped in the handshake, before
the scheduler reads (or unpickles) a byte of it.  A certificate names its holder's
role (OU) and name (CN); the scheduler authorizes each request by them.

A :class:`Credential` bundles the CA certificate, the holder's certificate and key,
and, for workers, the signed admission token.  ``encode()`` gives the single string it
travels as; ``save(path)`` the private file (0600) a volunteer passes as ``--token FILE`` and a
researcher to ``goblin_dask.connect``.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ROLES = ("volunteer", "lab", "researcher", "admin")
#: The roles whose certificate may open a client session (``register-client``) on a lab node.
CLIENT_ROLES = frozenset({"researcher", "admin", "lab"})
CREDENTIAL_PREFIX = _PREFIX = "goblin1:"


@dataclass(frozen=True)
class Credential:
    role: str
    name: str
    ca: str
    cert: str
    key: str
    token: str = ""

    def security(self):
        """A distributed ``Security`` presenting this certificate in every role."""
        from distributed import Security

        return Security(
            require_encryption=True,
            tls_ca_file=self.ca,
            tls_client_cert=self.cert,
            tls_client_key=self.key,
            tls_worker_cert=self.cert,
            tls_worker_key=self.key,
            tls_scheduler_cert=self.cert,
            tls_scheduler_key=self.key,
        )

    def certificate_role(self) -> str | None:
        """The role the certificate itself names (what the lab node goes by), not the ``role`` field beside it."""
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        try:
            subject = x509.load_pem_x509_certificate(self.cert.encode()).subject
        except ValueError:
            return None
        ous = subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
        return str(ous[0].value) if ous else None

    def encode(self) -> str:
        raw = json.dumps(asdict(self), separators=(",", ":")).encode()
        return _PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> "Credential":
        text = text.strip()
        if not text.startswith(_PREFIX):
            raise ValueError("not a goblin credential (it should start with 'goblin1:')")
        body = text[len(_PREFIX):]
        try:
            data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            return cls(**data)
        except Exception as e:
            raise ValueError(f"corrupt goblin credential: {e}") from None

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.encode() + "\n")
        return path

    @classmethod
    def load(cls, source: str | os.PathLike) -> "Credential":
        """From an encoded string, or from a file holding one."""
        text = str(source)
        if not text.startswith(_PREFIX):
            try:
                text = Path(source).read_text()
            except (FileNotFoundError, IsADirectoryError, OSError) as e:
                if isinstance(e, FileNotFoundError) and ("/" in text or text.endswith(".credential")):
                    raise FileNotFoundError(f"credential file {text} does not exist") from None
                if isinstance(e, FileNotFoundError) or len(text) > 255:
                    raise ValueError(f"{text[:20]!r}...: neither a goblin credential (a string starting with "
                                     f"{_PREFIX!r}) nor a file holding one") from None
                raise
        return cls.decode(text)


class LabCA:
    """The CA in a lab node's state directory (``ca.pem``, ``ca-key.pem``)."""

    def __init__(self, state_dir: str | os.PathLike):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        cert_path, key_path = self.state_dir / "ca.pem", self.state_dir / "ca-key.pem"
        if not cert_path.exists():
            cert_pem, key_pem = _new_ca()
            _write_private(key_path, key_pem)
            cert_path.write_text(cert_pem)
        self.ca_pem = cert_path.read_text()
        self._key_pem = key_path.read_text()

    def issue(self, role: str, name: str, token: str = "", days: int = 365) -> Credential:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        cert, key = _new_leaf(self.ca_pem, self._key_pem, role, name, days)
        return Credential(role=role, name=name, ca=self.ca_pem, cert=cert, key=key, token=token)


def peer_identity(comm) -> tuple[str, str] | None:
    """(role, name) from the TLS peer certificate of ``comm``, or None."""
    return cert_identity((getattr(comm, "extra_info", None) or {}).get("peercert"))


def cert_identity(cert: dict | None) -> tuple[str, str] | None:
    """(role, name) from a certificate as ``ssl.SSLSocket.getpeercert()`` gives it, or None."""
    if not cert:
        return None
    fields = {k: v for rdn in cert.get("subject", ()) for k, v in rdn}
    role, name = fields.get("organizationalUnitName"), fields.get("commonName")
    return (role, name) if role in ROLES and name else None


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.timezone.utc)


def _new_ca() -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "goblin lab node CA")])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem


def _new_leaf(ca_pem: str, ca_key_pem: str, role: str, name: str, days: int) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca_pem.encode())
    ca_key = serialization.load_pem_private_key(ca_key_pem.encode(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
        x509.NameAttribute(NameOID.COMMON_NAME, name),
    ])
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem
