"""Real servers for the researcher-access tests: an SMTP server (aiosmtpd), a TLS certificate for 127.0.0.1,
and an HTTPS client for the lab node's dashboard port."""

from __future__ import annotations

import base64
import contextlib
import datetime
import email
import email.message
import hashlib
import http.client
import ipaddress
import os
import re
import shutil
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def headless_chromium(spki_sha256: str, profile: Path, window: str, console_log: bool = False):
    """Debian's Chromium, headless, trusting the site's certificate by its key's pin and nothing else new
    (``console_log``: keeping the page console's messages).  Missing, it skips a test; under ``CI=true``
    (``.ci/run`` installs it) it fails it: a browser test never silently skips there."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            f"browser tests need Chromium and chromedriver, missing: {', '.join(missing)} "
            "(apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--window-size={window}", f"--user-data-dir={profile}",
                f"--ignore-certificate-errors-spki-list={spki_sha256}"):
        options.add_argument(arg)
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    return driver


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


# -- HTTP -------------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: http.client.HTTPMessage
    body: str

    def cookie(self, name: str) -> str | None:
        """The whole Set-Cookie line for ``name``."""
        return next((c for c in self.headers.get_all("Set-Cookie") or () if c.startswith(name + "=")), None)


class WebClient:
    """A cookie-keeping HTTPS client for ``site`` (``.base``, ``.tls``) that does not follow redirects.

    ``source_ip``: the loopback address it connects from (127.0.0.0/8 all reach 127.0.0.1 on Linux), so
    that a test can play several requesters.
    """

    def __init__(self, site, source_ip: str | None = None):
        url = urllib.parse.urlsplit(site.base)
        assert url.scheme == "https"
        self.host, self.port, self.context = url.hostname, url.port, site.tls.client_context()
        self.source = (source_ip, 0) if source_ip else None
        self.cookies: dict[str, str] = {}

    def request(self, method: str, path: str, fields: dict | None = None, xsrf: bool = True,
                headers: dict | None = None) -> Response:
        headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items()), **(headers or {})}
        body = None
        if fields is not None:
            body = urllib.parse.urlencode({**({"_xsrf": self.cookies.get("_xsrf", "")} if xsrf else {}), **fields})
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        conn = http.client.HTTPSConnection(self.host, self.port, timeout=60, context=self.context,
                                           source_address=self.source)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            result = Response(resp.status, resp.headers, resp.read().decode(errors="replace"))
        finally:
            conn.close()
        for line in result.headers.get_all("Set-Cookie") or ():
            name, _, value = line.split(";")[0].partition("=")
            if value.strip('"'):
                self.cookies[name] = value
            else:
                self.cookies.pop(name, None)
        return result

    def get(self, path: str) -> Response:
        return self.request("GET", path)

    def post(self, path: str, **fields) -> Response:
        return self.request("POST", path, fields)


def sign_in(client: WebClient, mailbox: Mailbox, address: str) -> Response:
    """Ask for a code for ``address`` and enter the one e-mailed; the code page's answer (303 when signed in)."""
    client.get("/goblin/signin")
    sent = len(mailbox.to(address))
    assert client.post("/goblin/signin", email=address).status == 200
    return client.post("/goblin/signin/code", email=address, code=mailbox.next_code(address, sent))


@pytest.fixture(scope="module")
def mailbox():
    """A local SMTP server the lab node's sign-in mails go to (import it into a test module)."""
    with running_mailbox() as box:
        yield box


@dataclass
class Site:
    """A lab node serving its dashboard over TLS on localhost."""

    node: object  # a goblin_dask.LabNode
    tls: LocalhostTLS

    @property
    def base(self) -> str:
        return self.node.dashboard_link.removesuffix("/status")

    @property
    def state_dir(self):
        return self.node.state_dir

    @property
    def registry(self):
        from goblin_dask.access.registry import ResearcherRegistry

        return ResearcherRegistry(self.state_dir)
