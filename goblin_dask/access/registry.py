"""The researcher registry: access requests and sign-in state in the lab node's state directory.

Everything lives in ``<state_dir>/researchers/`` (mode 0700): ``registry.sqlite3`` and
``signin-secret`` (both 0600), and the credentials issued on approval.  One-time codes
and session tokens are stored only as HMACs under that secret, so a copy of the
database alone signs nobody in.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from goblin_dask.credentials import _write_private

REGISTRY_DIR = "researchers"
_EMAIL = re.compile(r"^[^@\s<>\"',;]+@[^@\s<>\"',;]+\.[^@\s<>\"',;.]+$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    email TEXT PRIMARY KEY, name TEXT NOT NULL, affiliation TEXT NOT NULL, purpose TEXT NOT NULL,
    status TEXT NOT NULL, credential_name TEXT UNIQUE, credential_path TEXT,
    requested_at REAL NOT NULL, decided_at REAL);
CREATE TABLE IF NOT EXISTS codes (
    id INTEGER PRIMARY KEY, email TEXT NOT NULL, client_ip TEXT NOT NULL, code_hash TEXT NOT NULL,
    expires_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS codes_email ON codes (email);
CREATE TABLE IF NOT EXISTS code_sends (email TEXT NOT NULL, client_ip TEXT NOT NULL, sent_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS wrong_codes (
    email TEXT NOT NULL, client_ip TEXT NOT NULL, at REAL NOT NULL, cleared INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS sessions (token_hash TEXT PRIMARY KEY, email TEXT NOT NULL, expires_at REAL NOT NULL);
"""


class AccessError(ValueError):
    """An access request that does not exist, or a decision that does not apply to it."""


def normalize_email(text: str) -> str:
    """The form in which an address is stored and compared (trimmed, lower case); ValueError if malformed."""
    email = (text or "").strip().lower()
    if len(email) > 254 or not _EMAIL.match(email):
        raise ValueError(f"not an e-mail address: {text!r}")
    return email


def credential_name(email: str) -> str:
    """The certificate name of a researcher: the address with every run of other characters as '-'."""
    return re.sub(r"[^a-z0-9]+", "-", normalize_email(email)).strip("-")


def _shared_secret(path: Path) -> bytes:
    """The secret in ``path``, created (0600) if missing: atomically, so that processes opening
    the same state directory at once (the node, the ``goblin researchers`` command) agree on one."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        _write_private(tmp, secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return bytes.fromhex(path.read_text().strip())


@dataclass(frozen=True)
class AccessRequest:
    email: str
    name: str
    affiliation: str
    purpose: str
    status: str
    credential_name: str | None
    credential_path: str | None
    requested_at: float
    decided_at: float | None


class ResearcherRegistry:
    """Access requests and sign-in state of one lab node (safe to share between processes)."""

    def __init__(self, state_dir: str | os.PathLike, clock: Callable[[], float] = time.time):
        self.state_dir = Path(state_dir)
        self.directory = self.state_dir / REGISTRY_DIR
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.clock = clock
        self._secret = _shared_secret(self.directory / "signin-secret")
        self.path = self.directory / "registry.sqlite3"
        if not self.path.exists():
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        with contextlib.closing(sqlite3.connect(self.path, timeout=10)) as db:
            old = db.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'codes'").fetchone()
            if old and "client_ip" not in old[0]:  # one code per address (before 0.1.1): pending codes are dropped
                db.execute("DROP TABLE codes")
            db.executescript(_SCHEMA)

    # -- storage -------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write-locked transaction, so that check-then-update steps cannot interleave across processes."""
        db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        db.row_factory = sqlite3.Row
        try:
            db.execute("BEGIN IMMEDIATE")
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    def digest(self, purpose: str, value: str) -> str:
        """What is stored in place of a code or token: its HMAC under the node's sign-in secret."""
        return hmac.new(self._secret, f"{purpose}\0{value}".encode(), hashlib.sha256).hexdigest()

    def derived_secret(self, purpose: str) -> bytes:
        """A secret for another use (the web app's cookie signing), independent of the stored digests."""
        return hmac.new(self._secret, f"derived\0{purpose}".encode(), hashlib.sha256).digest()

    # -- access requests -----------------------------------------------------------
    def submit(self, email: str, *, name: str, affiliation: str, purpose: str) -> AccessRequest:
        """File (or, while still pending, amend) the access request of ``email``."""
        email = normalize_email(email)
        fields = {"name": name.strip(), "affiliation": affiliation.strip(), "purpose": purpose.strip()}
        missing = [k for k, v in fields.items() if not v]
        if missing:
            raise AccessError(f"an access request needs: {', '.join(missing)}")
        with self.transaction() as db:
            row = db.execute("SELECT status FROM requests WHERE email = ?", (email,)).fetchone()
            if row is not None and row["status"] != "pending":
                raise AccessError(f"the access request of {email} was already {row['status']}")
            db.execute(
                "INSERT INTO requests (email, name, affiliation, purpose, status, requested_at) "
                "VALUES (:email, :name, :affiliation, :purpose, 'pending', :now) ON CONFLICT(email) DO UPDATE SET "
                "name = :name, affiliation = :affiliation, purpose = :purpose, requested_at = :now",
                {"email": email, "now": self.clock(), **fields})
        return self.get(email)

    def get(self, email: str) -> AccessRequest | None:
        with self.transaction() as db:
            return self._get(db, normalize_email(email))

    @staticmethod
    def _get(db: sqlite3.Connection, email: str) -> AccessRequest | None:
        row = db.execute("SELECT * FROM requests WHERE email = ?", (email,)).fetchone()
        return AccessRequest(**dict(row)) if row else None

    def list(self, status: str | None = None) -> list[AccessRequest]:
        """Requests, oldest first (all, or those with ``status``)."""
        with self.transaction() as db:
            rows = db.execute("SELECT * FROM requests WHERE ? IS NULL OR status = ? ORDER BY requested_at",
                              (status, status)).fetchall()
        return [AccessRequest(**dict(r)) for r in rows]

    def approve(self, email: str) -> Path:
        """Issue ``email``'s researcher credential under the lab CA; returns the file (0600) to hand over.

        Only a filed request can be approved (a refused one too: the admin changed their mind).  One
        transaction from check to record, so two admins approving at once issue one credential.
        """
        from goblin_dask.tls import LabCA

        email = normalize_email(email)
        with self.transaction() as db:
            self._decidable(db, email, "approve")
            name = self._unused_credential_name(db, email)
            path = self.directory / f"{name}.credential"
            if path.exists():  # never overwrite a credential (one `goblin researchers issue` wrote, say)
                raise AccessError(f"cannot approve {email}: {path} exists (a credential issued under that name); "
                                  f"revoke or move it first")
            LabCA(self.state_dir).issue("researcher", name).save(path)
            os.chmod(path, 0o600)
            db.execute("UPDATE requests SET status = 'approved', credential_name = ?, credential_path = ?, "
                       "decided_at = ? WHERE email = ?", (name, str(path), self.clock(), email))
        return path

    def refuse(self, email: str) -> AccessRequest:
        """Refuse a pending request: nothing is issued."""
        email = normalize_email(email)
        with self.transaction() as db:
            request = self._decidable(db, email, "refuse")
            if request.status != "pending":
                raise AccessError(f"only a pending request can be refused; {email}'s is {request.status}")
            db.execute("UPDATE requests SET status = 'refused', decided_at = ? WHERE email = ?", (self.clock(), email))
            return self._get(db, email)

    def _decidable(self, db: sqlite3.Connection, email: str, verb: str) -> AccessRequest:
        request = self._get(db, email)
        if request is None:
            raise AccessError(f"cannot {verb} {email}: no access request from that address")
        if request.status == "approved":
            raise AccessError(f"cannot {verb} {email}: already approved (credential {request.credential_path})")
        return request

    def _unused_credential_name(self, db: sqlite3.Connection, email: str) -> str:
        """:func:`credential_name`, made unique (addresses like a.b@x and a-b@x would otherwise share it, and a
        name may be taken by a credential ``goblin researchers issue`` wrote, or revoked)."""
        from goblin_dask.credentials import revoked_names

        name = credential_name(email)
        taken = db.execute("SELECT 1 FROM requests WHERE credential_name = ? AND email != ?", (name, email)).fetchone()
        if taken or (self.directory / f"{name}.credential").exists() or name in revoked_names(self.state_dir):
            return f"{name}-{hashlib.sha256(email.encode()).hexdigest()[:6]}"
        return name
