"""Sending sign-in codes through the SMTP server the lab admin configures.

Dask config ``goblin.smtp``: ``host``, ``port`` (25, or 587 with ``starttls``), ``from``,
``starttls`` (false), ``ca-file`` (CA bundle that verifies the server under STARTTLS;
default: the system's), ``username`` and ``password`` (log in, after STARTTLS).  Like any
dask config, each key can also come from the environment (``DASK_GOBLIN__SMTP__STARTTLS=true``);
``GOBLIN_SMTP_HOST``, ``GOBLIN_SMTP_PORT`` and ``GOBLIN_SMTP_FROM`` override the first three.
Without a host the node offers no e-mail sign-in.
"""

from __future__ import annotations

import os
import smtplib
import socket
import ssl
from dataclasses import dataclass
from email.message import EmailMessage

from goblin_dask import settings


@dataclass(frozen=True)
class SmtpSettings:
    host: str
    port: int = 25
    sender: str = ""
    starttls: bool = False
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None

    @classmethod
    def from_config(cls) -> "SmtpSettings | None":
        host = os.environ.get("GOBLIN_SMTP_HOST") or settings.get("goblin.smtp.host")
        if not host:
            return None
        starttls = bool(settings.get("goblin.smtp.starttls"))
        port = os.environ.get("GOBLIN_SMTP_PORT") or settings.get("goblin.smtp.port") or (587 if starttls else 25)
        sender = (os.environ.get("GOBLIN_SMTP_FROM") or settings.get("goblin.smtp.from")
                  or f"goblin lab node <goblin@{socket.gethostname()}>")
        return cls(host=host, port=int(port), sender=sender, starttls=starttls,
                   username=settings.get("goblin.smtp.username"), password=settings.get("goblin.smtp.password"),
                   ca_file=settings.get("goblin.smtp.ca-file"))


def send_code(smtp: SmtpSettings, to: str, code: str, valid_minutes: float) -> None:
    """E-mail ``code`` to ``to`` (blocking: call it off the event loop)."""
    message = EmailMessage()
    message["From"], message["To"] = smtp.sender, to
    message["Subject"] = "Your sign-in code for the goblin lab node"
    message.set_content(
        f"Your sign-in code is {code}\n\n"
        f"It is valid for {valid_minutes:g} minutes and works once. If you did not ask for it, ignore this e-mail:\n"
        "nobody can sign in without the code.\n"
    )
    with smtplib.SMTP(smtp.host, smtp.port, timeout=30) as server:
        if smtp.starttls:
            server.starttls(context=ssl.create_default_context(cafile=smtp.ca_file))
        if smtp.username:
            server.login(smtp.username, smtp.password or "")
        server.send_message(message)
