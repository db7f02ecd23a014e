"""Sign-in by one-time code: codes, their limits, and the sessions they open.

A code is 6 digits, sent by e-mail, valid for 10 minutes, good for one sign-in, and
burnt after 5 wrong tries; a new code replaces the previous one.  Code requests are
rate-limited per address and per client IP, which also bounds guessing (at most
``codes_per_email * max_wrong_attempts`` tries per window).  Limits come from dask
config ``goblin.signin`` (keys as in :class:`SignInLimits`, with '-').
"""

from __future__ import annotations

import hmac
import math
import os
import secrets
from dataclasses import dataclass, fields

import dask

from goblin_dask.access.registry import ResearcherRegistry, normalize_email


@dataclass(frozen=True)
class SignInLimits:
    code_ttl: float = 600.0  # seconds a code is valid
    max_wrong_attempts: int = 5  # per code
    codes_per_email: int = 3  # code requests per address per window
    codes_per_ip: int = 10  # per client IP per window (a lab's researchers may share one)
    rate_window: float = 600.0  # seconds
    session_ttl: float = 8 * 3600.0  # seconds a sign-in lasts

    @classmethod
    def from_config(cls) -> "SignInLimits":
        conf = dask.config.get("goblin.signin", None) or {}
        conf = {k.replace("-", "_"): v for k, v in conf.items()}
        return cls(**{f.name: type(f.default)(conf[f.name]) for f in fields(cls) if f.name in conf})


class RateLimited(PermissionError):
    """Too many code requests; ``retry_after`` says in how many seconds one is accepted again."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class CodeRefused(PermissionError):
    """A code that does not sign in; ``need_new_code`` when the address has no usable code left."""

    def __init__(self, message: str, need_new_code: bool):
        super().__init__(message)
        self.need_new_code = need_new_code


def admin_emails() -> frozenset[str]:
    """Addresses that sign in as lab admins: env ``GOBLIN_ADMINS`` (comma-separated) or config ``goblin.admins``."""
    configured = os.environ.get("GOBLIN_ADMINS") or dask.config.get("goblin.admins", None) or ()
    if isinstance(configured, str):
        configured = configured.split(",")
    return frozenset(normalize_email(e) for e in configured if e.strip())


class SignIn:
    def __init__(self, registry: ResearcherRegistry, limits: SignInLimits | None = None):
        self.registry = registry
        self.limits = limits or SignInLimits()

    def issue_code(self, email: str, client_ip: str) -> str:
        """A new code for ``email`` (to be e-mailed; only its digest is kept), or :class:`RateLimited`."""
        email, now, lim = normalize_email(email), self.registry.clock(), self.limits
        code = f"{secrets.randbelow(10**6):06d}"
        with self.registry.transaction() as db:
            db.execute("DELETE FROM code_sends WHERE sent_at <= ?", (now - lim.rate_window,))
            for column, value, limit, who in (("email", email, lim.codes_per_email, "this address"),
                                              ("client_ip", client_ip, lim.codes_per_ip, "your network address")):
                count, oldest = db.execute(f"SELECT COUNT(*), MIN(sent_at) FROM code_sends WHERE {column} = ?",
                                           (value,)).fetchone()
                if count >= limit:
                    retry_after = max(1, math.ceil(oldest + lim.rate_window - now))
                    raise RateLimited(f"{count} sign-in codes were requested for {who} in the last "
                                      f"{lim.rate_window / 60:g} minutes", retry_after)
            db.execute("INSERT INTO code_sends (email, client_ip, sent_at) VALUES (?, ?, ?)", (email, client_ip, now))
            db.execute("INSERT OR REPLACE INTO codes (email, code_hash, expires_at, wrong_attempts) VALUES (?, ?, ?, 0)",
                       (email, self.registry.digest("code", f"{email}\0{code}"), now + lim.code_ttl))
        return code

    def redeem_code(self, email: str, code: str) -> str:
        """A new session token if ``code`` is ``email``'s current code, else :class:`CodeRefused`."""
        email, now = normalize_email(email), self.registry.clock()
        presented = self.registry.digest("code", f"{email}\0{(code or '').strip()}")
        with self.registry.transaction() as db:
            refusal = self._spend_code(db, email, presented, now)  # committed even when it refuses
            if refusal is None:
                token = secrets.token_urlsafe(32)
                db.execute("DELETE FROM sessions WHERE expires_at <= ?", (now,))
                db.execute("INSERT INTO sessions (token_hash, email, expires_at) VALUES (?, ?, ?)",
                           (self.registry.digest("session", token), email, now + self.limits.session_ttl))
        if refusal is not None:
            raise refusal
        return token

    def _spend_code(self, db, email: str, presented: str, now: float) -> CodeRefused | None:
        """Use up the code (right, expired or last wrong try) or count a wrong try; the refusal, if any."""
        row = db.execute("SELECT * FROM codes WHERE email = ?", (email,)).fetchone()
        if row is None:
            return CodeRefused("there is no sign-in code for this address (or it was already used)", True)
        if hmac.compare_digest(presented, row["code_hash"]) and now < row["expires_at"]:
            db.execute("DELETE FROM codes WHERE email = ?", (email,))
            return None
        if now >= row["expires_at"]:
            db.execute("DELETE FROM codes WHERE email = ?", (email,))
            return CodeRefused("this sign-in code has expired", True)
        left = self.limits.max_wrong_attempts - row["wrong_attempts"] - 1
        if left <= 0:
            db.execute("DELETE FROM codes WHERE email = ?", (email,))
            return CodeRefused("wrong code, and that was the last try for it", True)
        db.execute("UPDATE codes SET wrong_attempts = wrong_attempts + 1 WHERE email = ?", (email,))
        return CodeRefused(f"wrong code ({left} {'try' if left == 1 else 'tries'} left)", False)

    def session_email(self, token: str | None) -> str | None:
        """The address signed in with ``token``, while its session lasts."""
        if not token:
            return None
        with self.registry.transaction() as db:
            row = db.execute("SELECT email FROM sessions WHERE token_hash = ? AND expires_at > ?",
                             (self.registry.digest("session", token), self.registry.clock())).fetchone()
        return row["email"] if row else None

    def end_session(self, token: str | None) -> None:
        if token:
            with self.registry.transaction() as db:
                db.execute("DELETE FROM sessions WHERE token_hash = ?", (self.registry.digest("session", token),))
