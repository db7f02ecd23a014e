"""Sign-in by one-time code: codes, their limits, and the sessions they open.

A code is 6 digits, sent by e-mail, valid for 10 minutes and good for one sign-in.  Asking
for a new code does not cancel a pending one: an address may hold several (at most
``max_pending_codes``), each valid until it expires or signs in; a sign-in ends them all.
Every limit counts per requester (the client IP) as well as per address, so that a stranger
who knows an address cannot burn or block its owner's sign-in:

* code requests: ``codes_per_requester`` per (address, IP), ``codes_per_email`` per address
  (a higher ceiling) and ``codes_per_ip`` per IP, per ``rate_window``;
* wrong codes: ``max_wrong_attempts`` per (address, IP) since that IP's last code request,
  after which the codes that IP asked for are burnt (others' stay); ``max_wrong_per_email``
  per address and window burn every pending code of the address (after that, each new code
  gets one try).  Guessing is bounded by ``max_wrong_per_email + codes_per_email`` tries per
  address per window, each against at most ``max_pending_codes`` codes.

Limits come from dask config ``goblin.signin`` (keys as in :class:`SignInLimits`, with '-').
Behind a reverse proxy every client has the proxy's IP: the per-IP limits then act per address.
"""

from __future__ import annotations

import hmac
import math
import os
import secrets
from dataclasses import dataclass, fields

from goblin_dask import settings
from goblin_dask.access.registry import ResearcherRegistry, normalize_email


def _default(key: str):
    return settings.default(f"goblin.signin.{key}")


@dataclass(frozen=True)
class SignInLimits:
    """The limits; each field's default is goblin.yaml's ``goblin.signin`` key (its name with '-')."""

    code_ttl: float = float(_default("code-ttl"))  # seconds a code is valid
    max_wrong_attempts: int = int(_default("max-wrong-attempts"))  # per (address, client IP) since its last code
    max_wrong_per_email: int = int(_default("max-wrong-per-email"))  # per address per window: then all its codes burn
    codes_per_requester: int = int(_default("codes-per-requester"))  # code requests per (address, client IP)
    codes_per_email: int = int(_default("codes-per-email"))  # code requests per address, whoever asks
    codes_per_ip: int = int(_default("codes-per-ip"))  # per client IP (a lab's researchers may share one)
    max_pending_codes: int = int(_default("max-pending-codes"))  # codes of one address valid at once
    rate_window: float = float(_default("rate-window"))  # seconds
    session_ttl: float = float(_default("session-ttl"))  # seconds a sign-in lasts

    @classmethod
    def from_config(cls) -> "SignInLimits":
        return cls(**{f.name: type(f.default)(settings.get("goblin.signin." + f.name.replace("_", "-")))
                      for f in fields(cls)})


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
    configured = os.environ.get("GOBLIN_ADMINS") or settings.get("goblin.admins") or ()
    if isinstance(configured, str):
        configured = configured.split(",")
    return frozenset(normalize_email(e) for e in configured if e.strip())


class SignIn:
    def __init__(self, registry: ResearcherRegistry, limits: SignInLimits | None = None):
        self.registry = registry
        self.limits = limits or SignInLimits()

    def issue_code(self, email: str, client_ip: str) -> str:
        """A new code for ``email`` (to be e-mailed; only its digest is kept), or :class:`RateLimited`.

        The address's pending codes stay valid.
        """
        email, now, lim = normalize_email(email), self.registry.clock(), self.limits
        code = f"{secrets.randbelow(10**6):06d}"
        with self.registry.transaction() as db:
            db.execute("DELETE FROM code_sends WHERE sent_at <= ?", (now - lim.rate_window,))
            db.execute("DELETE FROM wrong_codes WHERE at <= ?", (now - lim.rate_window,))
            db.execute("DELETE FROM codes WHERE expires_at <= ?", (now,))
            for where, values, limit, who in (
                    ("email = ? AND client_ip = ?", (email, client_ip), lim.codes_per_requester,
                     "this address from your network address"),
                    ("email = ?", (email,), lim.codes_per_email, "this address"),
                    ("client_ip = ?", (client_ip,), lim.codes_per_ip, "your network address")):
                count, oldest = db.execute(f"SELECT COUNT(*), MIN(sent_at) FROM code_sends WHERE {where}",
                                           values).fetchone()
                if count >= limit:
                    retry_after = max(1, math.ceil(oldest + lim.rate_window - now))
                    raise RateLimited(f"{count} sign-in codes were requested for {who} in the last "
                                      f"{lim.rate_window / 60:g} minutes", retry_after)
            db.execute("INSERT INTO code_sends (email, client_ip, sent_at) VALUES (?, ?, ?)", (email, client_ip, now))
            db.execute("UPDATE wrong_codes SET cleared = 1 WHERE email = ? AND client_ip = ?", (email, client_ip))
            db.execute("INSERT INTO codes (email, client_ip, code_hash, expires_at) VALUES (?, ?, ?, ?)",
                       (email, client_ip, self.registry.digest("code", f"{email}\0{code}"), now + lim.code_ttl))
            db.execute("DELETE FROM codes WHERE email = ? AND id NOT IN (SELECT id FROM codes WHERE email = ? "
                       "ORDER BY id DESC LIMIT ?)", (email, email, lim.max_pending_codes))
        return code

    def redeem_code(self, email: str, code: str, client_ip: str = "") -> str:
        """A new session token if ``code`` is one of ``email``'s pending codes, else :class:`CodeRefused`.

        ``client_ip``: who presents it (wrong codes count per address and IP).
        """
        email, now = normalize_email(email), self.registry.clock()
        presented = self.registry.digest("code", f"{email}\0{(code or '').strip()}")
        with self.registry.transaction() as db:
            refusal = self._spend_code(db, email, presented, client_ip, now)  # committed even when it refuses
            if refusal is None:
                token = secrets.token_urlsafe(32)
                db.execute("DELETE FROM sessions WHERE expires_at <= ?", (now,))
                db.execute("INSERT INTO sessions (token_hash, email, expires_at) VALUES (?, ?, ?)",
                           (self.registry.digest("session", token), email, now + self.limits.session_ttl))
        if refusal is not None:
            raise refusal
        return token

    def _spend_code(self, db, email: str, presented: str, client_ip: str, now: float) -> CodeRefused | None:
        """Sign in with a matching code (ending every code of ``email``) or count a wrong try; the refusal, if any."""
        lim = self.limits
        rows = db.execute("SELECT * FROM codes WHERE email = ?", (email,)).fetchall()
        live = [r for r in rows if now < r["expires_at"]]
        if len(live) < len(rows):
            db.execute("DELETE FROM codes WHERE email = ? AND expires_at <= ?", (email, now))
        if any(hmac.compare_digest(presented, r["code_hash"]) for r in live):
            db.execute("DELETE FROM codes WHERE email = ?", (email,))
            db.execute("DELETE FROM wrong_codes WHERE email = ?", (email,))
            return None
        if not live:
            if rows:
                return CodeRefused("this sign-in code has expired", True)
            return CodeRefused("there is no sign-in code for this address (or it was already used)", True)
        mine = db.execute("SELECT COUNT(*) FROM wrong_codes WHERE email = ? AND client_ip = ? AND cleared = 0",
                          (email, client_ip)).fetchone()[0]
        if mine >= lim.max_wrong_attempts:
            return CodeRefused("too many wrong codes were entered from your network address", True)
        db.execute("INSERT INTO wrong_codes (email, client_ip, at) VALUES (?, ?, ?)", (email, client_ip, now))
        everyone = db.execute("SELECT COUNT(*) FROM wrong_codes WHERE email = ? AND at > ?",
                              (email, now - lim.rate_window)).fetchone()[0]
        if everyone >= lim.max_wrong_per_email:
            db.execute("DELETE FROM codes WHERE email = ?", (email,))
            return CodeRefused("wrong code, and that was the last try for this address's codes", True)
        left = lim.max_wrong_attempts - mine - 1
        if left <= 0:
            db.execute("DELETE FROM codes WHERE email = ? AND client_ip = ?", (email, client_ip))
            return CodeRefused("wrong code, and that was the last try for it", True)
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
