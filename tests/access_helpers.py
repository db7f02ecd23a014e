"""Real servers for the researcher-access tests: an SMTP server (aiosmtpd) and a TLS certificate for 127.0.0.1."""

from __future__ import annotations

import base64
import contextlib
import datetime
import email
import email.message
import hashlib
import ipaddress
import re
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.conftest import wait_for


@dataclass(frozen=True)
class LocalhostTLS:
    """A self-signed certificate for 127.0.0.1 (its own CA), and the SPKI pin Chromium takes."""

    cert: Path
    key: Path
    spki_sha256: str

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this certificate only, hostname checked."""
        return ssl.create_default_context(cafile=str(self.cert))

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(self.cert), str(self.key))
        return context


def localhost_tls(directory: Path) -> LocalhostTLS:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "localhost.pem", directory / "localhost-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return LocalhostTLS(cert_path, key_path, base64.b64encode(hashlib.sha256(spki).digest()).decode())


class Mailbox:
    """An aiosmtpd handler keeping every message it receives; it refuses recipients in ``bounce``."""

    def __init__(self):
        self.messages: list[email.message.Message] = []
        self.over_tls: list[bool] = []  # per message: whether it came after STARTTLS
        self.bounce: set[str] = set()
        self.port = 0
        self._lock = threading.Lock()

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if address in self.bounce:
            return "550 5.1.1 no such mailbox here"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        with self._lock:
            self.messages.append(email.message_from_bytes(envelope.content))
            self.over_tls.append(session.ssl is not None)
        return "250 OK"

    def to(self, address: str) -> list[email.message.Message]:
        with self._lock:
            return [m for m in self.messages if m["To"] == address]

    @staticmethod
    def code_in(message: email.message.Message) -> str:
        body = message.get_payload(decode=True).decode()
        return re.search(r"sign-in code is (\d{6})", body).group(1)

    def next_code(self, address: str, after: int) -> str:
        """The code in the first message to ``address`` beyond the ``after`` it already had."""
        wait_for(lambda: len(self.to(address)) > after, f"a sign-in e-mail to {address}")
        return self.code_in(self.to(address)[after])


@contextlib.contextmanager
def running_mailbox(starttls: LocalhostTLS | None = None) -> Iterator[Mailbox]:
    """A real SMTP server on 127.0.0.1 (requiring STARTTLS with ``starttls``'s certificate, if given)."""
    from aiosmtpd.controller import Controller

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box = Mailbox()
    tls = {"tls_context": starttls.server_context(), "require_starttls": True} if starttls else {}
    controller = Controller(box, hostname="127.0.0.1", port=port, **tls)
    controller.start()
    box.port = port
    try:
        yield box
    finally:
        controller.stop()
