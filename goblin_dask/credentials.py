"""Credentials of a lab node: the lab secret in its state directory, and what it signs.

A credential is ``gv1.<role>.<name>.<nonce>.<mac>``: the HMAC of role, name and nonce
under the lab secret.  With the node's address it is all a volunteer needs to join;
the node keeps no copy of it (it re-derives the MAC), only the names it has revoked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

ROLES = ("volunteer", "lab")  # roles that join as workers and carry an admission token
_PREFIX = "gv1"
#: The lab's volunteer registry in its state directory: each volunteer credential's person (owner).
VOLUNTEERS_FILE = "volunteers.json"
#: The persons banned on the lab (one credential cheated): ``{person: {"credential", "reason"}}``.
BANNED_PERSONS_FILE = "banned-persons.json"


class CredentialError(PermissionError):
    """A credential that is malformed, forged, or revoked."""


@dataclass(frozen=True)
class Identity:
    role: str
    name: str


def valid_name(name: str) -> bool:
    """A credential's name: ASCII letters, digits, '-' and '_' (it goes into tokens, file names and certificates)."""
    return bool(name) and name.isascii() and name.replace("-", "").replace("_", "").isalnum()


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` (mode 0600) so that a reader in another process sees the old file or the new, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class LabKeys:
    """The signing secret and revocation list kept in a lab node's state directory."""

    def __init__(self, state_dir: str | os.PathLike):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        secret_path = self.state_dir / "lab-secret"
        if not secret_path.exists():
            _write_private(secret_path, secrets.token_hex(32))
        self._secret = bytes.fromhex(secret_path.read_text().strip())
        self._revoked_path = self.state_dir / "revoked.json"
        self._volunteers_path = self.state_dir / VOLUNTEERS_FILE
        self._banned_persons_path = self.state_dir / BANNED_PERSONS_FILE
        self._json_cache: dict[Path, tuple[tuple, object]] = {}

    def _read_json(self, path: Path, default, parse=lambda data: data):
        """``parse`` of ``path``'s JSON, read again only when the file changed (some are asked for every
        volunteer call); ``default`` when there is no file, a CredentialError when it cannot be read."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return default
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = self._json_cache.get(path)
        if cached is None or cached[0] != stamp:
            try:
                cached = (stamp, parse(json.loads(path.read_text())))
            except ValueError as e:
                raise CredentialError(f"{path} is unreadable: {e}") from None
            self._json_cache[path] = cached
        return cached[1]

    def _mac(self, role: str, name: str, nonce: str) -> str:
        msg = f"{role}.{name}.{nonce}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:40]

    def issue(self, role: str = "volunteer", name: str | None = None, person: str | None = None) -> str:
        """A signed token; a volunteer's is recorded in the registry with its ``person`` (default: ``name``)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        name = name or f"{role}-{secrets.token_hex(3)}"
        if not valid_name(name):
            raise ValueError(f"credential name {name!r}: use letters, digits, '-' and '_' only")
        if person is not None and (role != "volunteer" or not valid_name(person)):
            raise ValueError(f"person {person!r}: a volunteer's owner, in letters, digits, '-' and '_' only")
        if name in self.revoked():
            raise CredentialError(f"name {name!r} was revoked on this lab node")
        if role == "volunteer":
            self.check_person(person or name)
        nonce = secrets.token_hex(8)
        if role == "volunteer":
            self.record_volunteer(name, person or name)
        return f"{_PREFIX}.{role}.{name}.{nonce}.{self._mac(role, name, nonce)}"

    def volunteers(self) -> dict[str, dict]:
        """The volunteer registry, ``{name: {"person": WHO}}``.  A lab older than the registry has no file,
        and an entry may lack ``person``: :meth:`person` is then the name.  Unreadable: a CredentialError,
        never a guess (who holds what decides where replicas run and whom a ban reaches)."""
        def parse(data) -> dict[str, dict]:
            entries = data.get("volunteers", {}) if isinstance(data, dict) else {}
            return {str(n): e for n, e in entries.items() if isinstance(e, dict)}

        try:
            return self._read_json(self._volunteers_path, {}, parse)
        except CredentialError as e:
            raise CredentialError(f"the volunteer registry {e}") from None

    def person(self, name: str) -> str:
        """Who holds volunteer credential ``name``, as the admin enrolled it (``goblin enroll --person``): the
        exposure cap counts per person, and a replica never runs on the person whose result it checks."""
        person = self.volunteers().get(name, {}).get("person")
        return person if isinstance(person, str) and valid_name(person) else name

    def credentials_of(self, person: str) -> set[str]:
        """The volunteer credentials enrolled for ``person`` (a credential without a recorded person is its own)."""
        return {name for name in self.volunteers() if self.person(name) == person}

    def banned_persons(self) -> dict[str, dict]:
        """``{person: {"credential": the one that cheated, "reason": why}}`` (:meth:`ban_person`)."""
        return self._read_json(self._banned_persons_path, {}, lambda data: data if isinstance(data, dict) else {})

    def ban_person(self, person: str, credential: str, reason: str) -> None:
        """Record that ``person`` is banned because their ``credential`` was (kept across restarts, as the
        revocations are): no credential is enrolled for them again, and any of theirs is refused."""
        banned = dict(self.banned_persons())
        banned.setdefault(person, {"credential": credential, "reason": reason})
        _write_private(self._banned_persons_path, json.dumps(banned, sort_keys=True, indent=1))

    def check_person(self, person: str) -> None:
        """CredentialError when ``person`` is banned on this lab, naming the credential that got them banned."""
        ban = self.banned_persons().get(person)
        if ban is not None:
            raise CredentialError(f"person {person!r} is banned from this lab node: their credential "
                                  f"{ban.get('credential')!r} was banned ({ban.get('reason')})")

    def record_volunteer(self, name: str, person: str) -> None:
        entries = dict(self.volunteers())
        entries[name] = {**entries.get(name, {}), "person": person}
        _write_private(self._volunteers_path, json.dumps({"volunteers": entries}, sort_keys=True, indent=1))

    def verify(self, credential: str) -> Identity:
        parts = (credential or "").strip().split(".")
        if len(parts) != 5 or parts[0] != _PREFIX or parts[1] not in ROLES:
            raise CredentialError("malformed credential")
        _, role, name, nonce, mac = parts
        if not hmac.compare_digest(mac, self._mac(role, name, nonce)):
            raise CredentialError("credential not signed by this lab node")
        if name in self.revoked():
            raise CredentialError(f"credential of {name!r} was revoked")
        if role == "volunteer":
            self.check_person(self.person(name))
        return Identity(role, name)

    def revoked(self) -> frozenset[str]:
        """The revoked names (asked for every volunteer call)."""
        return self._read_json(self._revoked_path, frozenset(), frozenset)

    def revoke(self, name: str) -> None:
        names = self.revoked() | {name}
        _write_private(self._revoked_path, json.dumps(sorted(names)))


def revoked_names(state_dir: str | os.PathLike) -> frozenset[str]:
    """The names revoked on the lab of ``state_dir`` (read only: unlike :class:`LabKeys`, creates nothing)."""
    try:
        return frozenset(json.loads((Path(state_dir) / "revoked.json").read_text()))
    except FileNotFoundError:
        return frozenset()


def issue_credential(state_dir: str | os.PathLike, role: str, name: str | None = None, person: str | None = None):
    """A full credential (TLS certificate under the lab CA, plus admission token for workers); ``person``: who
    holds a volunteer credential (default: its name; :meth:`LabKeys.person`)."""
    from goblin_dask.tls import LabCA

    token = ""
    if role in ROLES:
        token = LabKeys(state_dir).issue(role, name, person)
        name = token.split(".")[2]
    elif not name:
        raise ValueError(f"a {role} credential needs a name")
    return LabCA(state_dir).issue(role, name, token=token)


#: The environment variable a volunteer's credential (or the path of its file) may travel in.
CREDENTIAL_ENV = "GOBLIN_TOKEN"


def read_credential_file(path: str | os.PathLike) -> str:
    """The text of a credential file that only its owner can read.

    A credential holds the holder's TLS key: a file that its group or other users can read is refused
    (anyone who reads it is that volunteer to the lab, and can get it banned), with the command that
    fixes it.  Credentials never travel in a command line (``/proc/PID/cmdline`` is readable by every
    local user): a file, or the environment variable :data:`CREDENTIAL_ENV`.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
    except OSError as e:
        raise CredentialError(f"cannot read the credential file {path}: {e.strerror or e}") from None
    if mode & 0o077:
        raise CredentialError(f"the credential file {path} can be read by other users of this machine "
                              f"(mode {mode:04o}): make it private with `chmod 600 {path}`")
    try:
        return path.read_text()
    except OSError as e:
        raise CredentialError(f"cannot read the credential file {path}: {e.strerror or e}") from None


def has_lab(state_dir: str | os.PathLike) -> bool:
    """Does ``state_dir`` hold a lab (its secret and CA, which ``goblin node`` creates)?"""
    state_dir = Path(state_dir)
    return (state_dir / "lab-secret").is_file() and (state_dir / "ca.pem").is_file()


def require_lab(state_dir: str | os.PathLike) -> Path:
    """``state_dir`` if it holds a lab, else a CredentialError saying how to create one (never a new CA:
    a typo in ``--state-dir`` must not start a second lab whose credentials the real node refuses)."""
    if not has_lab(state_dir):
        raise CredentialError(f"{state_dir} holds no lab node (no lab-secret and ca.pem): check --state-dir "
                              f"(or GOBLIN_STATE_DIR), or create a lab there by starting "
                              f"`goblin node --state-dir {state_dir}` once")
    return Path(state_dir)


ADMIN_CREDENTIAL = "admin.credential"


def admin_credential(state_dir: str | os.PathLike):
    """The lab admin's credential, created with the node's state directory."""
    from goblin_dask.tls import Credential

    path = Path(state_dir) / ADMIN_CREDENTIAL
    if not path.exists():
        issue_credential(state_dir, "admin", "lab-admin").save(path)
    return Credential.load(path)
