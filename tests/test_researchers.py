"""Researcher registry, one-time codes and sessions, approval and the ``goblin researchers`` command.

The sign-in rules run against a clock the test moves, so expiry and rate windows are
exact; approval issues a real credential that connects to a real lab node, and codes are
e-mailed through a real SMTP server that requires STARTTLS.
"""

from __future__ import annotations

import dataclasses
import smtplib
import sqlite3
import ssl
import stat
from pathlib import Path

import dask
import numpy as np
import pytest
from click.testing import CliRunner

from goblin_dask import connect
from goblin_dask.access.mail import SmtpSettings, send_code
from goblin_dask.access.registry import AccessError, ResearcherRegistry, credential_name, normalize_email
from goblin_dask.access.signin import CodeRefused, RateLimited, SignIn, SignInLimits, admin_emails
from goblin_dask.cli import main as goblin
from goblin_dask.tls import Credential
from tests.access_helpers import localhost_tls, running_mailbox


class Clock:
    def __init__(self):
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def registry(tmp_path, clock):
    return ResearcherRegistry(tmp_path / "state", clock=clock)


@pytest.fixture
def signin(registry):
    return SignIn(registry)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _file(registry, email="ada@uni.example"):
    return registry.submit(email, name="Ada Lovelace", affiliation="Analytical Engines", purpose="Bernoulli numbers")


def test_registry_files_are_private(registry):
    assert _mode(registry.directory) == 0o700
    assert _mode(registry.path) == 0o600
    assert _mode(registry.directory / "signin-secret") == 0o600


def test_only_digests_of_codes_and_session_tokens_are_stored(registry, signin):
    code = signin.issue_code("ada@uni.example", "10.0.0.1")
    token = signin.redeem_code("ada@uni.example", code)
    signin.issue_code("ada@uni.example", "10.0.0.1")  # one code left in the store
    stored = b"".join(p.read_bytes() for p in registry.directory.glob("registry.sqlite3*"))
    assert code.encode() not in stored and token.encode() not in stored
    with sqlite3.connect(registry.path) as db:
        assert db.execute("SELECT token_hash FROM sessions").fetchall() == [(registry.digest("session", token),)]
        (code_hash,), = db.execute("SELECT code_hash FROM codes").fetchall()
    assert len(code_hash) == 64 and code not in code_hash


def test_a_code_signs_in_once(signin):
    code = signin.issue_code("Ada@Uni.Example ", "10.0.0.1")
    assert len(code) == 6 and code.isdigit()
    token = signin.redeem_code("ada@uni.example", code)
    assert signin.session_email(token) == "ada@uni.example"
    with pytest.raises(CodeRefused, match="already used") as refused:
        signin.redeem_code("ada@uni.example", code)
    assert refused.value.need_new_code


def test_a_code_expires_after_ten_minutes(signin, clock):
    code = signin.issue_code("ada@uni.example", "10.0.0.1")
    clock.advance(599)
    signin.redeem_code("ada@uni.example", code)
    code = signin.issue_code("ada@uni.example", "10.0.0.1")
    clock.advance(600)
    with pytest.raises(CodeRefused, match="expired") as refused:
        signin.redeem_code("ada@uni.example", code)
    assert refused.value.need_new_code


def test_five_wrong_tries_burn_the_code(signin):
    code = signin.issue_code("ada@uni.example", "10.0.0.1")
    wrong = f"{(int(code) + 1) % 10**6:06d}"
    for left in (4, 3, 2, 1):
        with pytest.raises(CodeRefused, match=f"{left} tr") as refused:
            signin.redeem_code("ada@uni.example", wrong, "10.0.0.1")
        assert not refused.value.need_new_code
    with pytest.raises(CodeRefused, match="last try"):
        signin.redeem_code("ada@uni.example", wrong, "10.0.0.1")
    with pytest.raises(CodeRefused, match="no sign-in code"):
        signin.redeem_code("ada@uni.example", code, "10.0.0.1")


def test_a_code_is_only_good_for_its_own_address(signin):
    code = signin.issue_code("ada@uni.example", "10.0.0.1")
    signin.issue_code("eve@evil.example", "10.0.0.2")
    with pytest.raises(CodeRefused, match="wrong code"):
        signin.redeem_code("eve@evil.example", code)


def test_a_new_code_request_keeps_the_pending_code(signin):
    first = signin.issue_code("ada@uni.example", "10.0.0.1")
    second = signin.issue_code("ada@uni.example", "10.0.0.1")
    assert signin.session_email(signin.redeem_code("ada@uni.example", first)) == "ada@uni.example"
    with pytest.raises(CodeRefused, match="already used"):  # a sign-in ends every code of the address
        signin.redeem_code("ada@uni.example", second)


def test_a_stranger_cannot_burn_or_block_an_addresss_sign_in(signin, clock):
    """The attack of issue 14: a stranger asks for codes for the admin's address, and guesses."""
    mine = signin.issue_code("admin@lab.example", "10.0.0.1")
    for _ in range(3):
        signin.issue_code("admin@lab.example", "203.0.113.9")  # the stranger's requests
    with pytest.raises(RateLimited, match="from your network address"):
        signin.issue_code("admin@lab.example", "203.0.113.9")
    for _ in range(5):
        with pytest.raises(CodeRefused, match="wrong code"):
            signin.redeem_code("admin@lab.example", "000000" if mine != "000000" else "000001", "203.0.113.9")
    with pytest.raises(CodeRefused, match="too many wrong codes"):
        signin.redeem_code("admin@lab.example", "000002", "203.0.113.9")
    again = signin.issue_code("admin@lab.example", "10.0.0.1")  # the admin may still ask
    assert signin.session_email(signin.redeem_code("admin@lab.example", mine, "10.0.0.1")) == "admin@lab.example"
    with pytest.raises(CodeRefused, match="already used"):
        signin.redeem_code("admin@lab.example", again, "10.0.0.1")


def test_code_requests_are_rate_limited_per_requester_and_per_address(signin, clock):
    for _ in range(3):
        signin.issue_code("ada@uni.example", "10.0.0.1")
        clock.advance(60)
    with pytest.raises(RateLimited, match="this address from your network address") as limited:
        signin.issue_code("ada@uni.example", "10.0.0.1")
    assert limited.value.retry_after == 600 - 180
    for i in range(7):  # others still may, up to the address's ceiling
        signin.issue_code("ada@uni.example", f"10.0.1.{i}")
    with pytest.raises(RateLimited, match="for this address in the last") as limited:
        signin.issue_code("ada@uni.example", "10.0.2.1")
    assert limited.value.retry_after == 600 - 180
    clock.advance(limited.value.retry_after)
    signin.issue_code("ada@uni.example", "10.0.0.1")


def test_many_wrong_codes_from_everywhere_burn_every_code(registry, clock):
    signin = SignIn(registry, SignInLimits(max_wrong_per_email=6))
    code = signin.issue_code("ada@uni.example", "10.0.0.1")
    wrong = f"{(int(code) + 1) % 10**6:06d}"
    for i in range(5):
        with pytest.raises(CodeRefused, match=r"\(4 tries left\)"):
            signin.redeem_code("ada@uni.example", wrong, f"10.0.1.{i}")
    with pytest.raises(CodeRefused, match="last try for this address"):
        signin.redeem_code("ada@uni.example", wrong, "10.0.1.9")
    with pytest.raises(CodeRefused, match="no sign-in code"):
        signin.redeem_code("ada@uni.example", code, "10.0.0.1")


def test_code_requests_are_rate_limited_per_client_ip(signin, clock):
    for i in range(10):
        signin.issue_code(f"r{i}@uni.example", "10.0.0.1")
    with pytest.raises(RateLimited, match="network address"):
        signin.issue_code("another@uni.example", "10.0.0.1")
    signin.issue_code("another@uni.example", "10.0.0.2")
    clock.advance(600)
    signin.issue_code("yet-another@uni.example", "10.0.0.1")


def test_sessions_expire_and_end(signin, clock):
    token = signin.redeem_code("ada@uni.example", signin.issue_code("ada@uni.example", "10.0.0.1"))
    clock.advance(8 * 3600 - 1)
    assert signin.session_email(token) == "ada@uni.example"
    clock.advance(1)
    assert signin.session_email(token) is None
    token = signin.redeem_code("ada@uni.example", signin.issue_code("ada@uni.example", "10.0.0.1"))
    signin.end_session(token)
    assert signin.session_email(token) is None
    assert signin.session_email("forged-token") is None and signin.session_email(None) is None


def test_settings_come_from_dask_config_and_environment(monkeypatch):
    with dask.config.set({"goblin.signin": {"code-ttl": 60, "codes-per-ip": 2},
                          "goblin.smtp": {"host": "mail.lab.example", "starttls": True, "from": "lab@lab.example",
                                          "ca_file": "/etc/lab-ca.pem"},
                          "goblin.admins": ["Boss@Lab.Example"]}):
        limits = SignInLimits.from_config()
        assert (limits.code_ttl, limits.codes_per_ip, limits.codes_per_email, limits.codes_per_requester) == (60.0, 2, 10, 3)
        assert SmtpSettings.from_config() == SmtpSettings(host="mail.lab.example", port=587, sender="lab@lab.example",
                                                          starttls=True, ca_file="/etc/lab-ca.pem")
        assert admin_emails() == {"boss@lab.example"}
        monkeypatch.setenv("GOBLIN_SMTP_HOST", "127.0.0.1")
        monkeypatch.setenv("GOBLIN_SMTP_PORT", "2525")
        monkeypatch.setenv("GOBLIN_ADMINS", "a@lab.example, b@lab.example")
        smtp = SmtpSettings.from_config()
        assert (smtp.host, smtp.port) == ("127.0.0.1", 2525)
        assert admin_emails() == {"a@lab.example", "b@lab.example"}
    monkeypatch.delenv("GOBLIN_SMTP_HOST")
    assert SmtpSettings.from_config() is None


def test_codes_are_e_mailed_over_starttls_to_a_verified_server(tmp_path):
    tls = localhost_tls(tmp_path)
    with running_mailbox(starttls=tls) as box:
        smtp = SmtpSettings(host="127.0.0.1", port=box.port, sender="goblin lab <signin@lab.example>", starttls=True,
                            ca_file=str(tls.cert))
        send_code(smtp, "ada@uni.example", "042917", 10)
        (message,) = box.to("ada@uni.example")
        assert box.over_tls == [True] and message["From"] == "goblin lab <signin@lab.example>"
        assert box.code_in(message) == "042917" and "valid for 10 minutes" in message.get_payload()
        with pytest.raises(ssl.SSLCertVerificationError):  # a server the configured CAs do not vouch for
            send_code(dataclasses.replace(smtp, ca_file=None), "ada@uni.example", "111111", 10)
        with pytest.raises(smtplib.SMTPSenderRefused) as refused:  # this server takes mail over TLS only
            send_code(dataclasses.replace(smtp, starttls=False), "ada@uni.example", "222222", 10)
        assert refused.value.smtp_code == 530
        assert len(box.messages) == 1


@pytest.mark.parametrize("text", ["", "ada", "ada@", "@uni.example", "ada@uni", "a b@uni.example",
                                  "ada@uni.example\r\nBcc: eve@evil.example", "<ada@uni.example>", "x" * 250 + "@a.bc"])
def test_malformed_addresses_are_refused(signin, text):
    with pytest.raises(ValueError):
        signin.issue_code(text, "10.0.0.1")


def test_addresses_and_credential_names():
    assert normalize_email("  Ada.Lovelace@Uni.Example ") == "ada.lovelace@uni.example"
    assert credential_name("Ada.Lovelace+grid@Uni.Example") == "ada-lovelace-grid-uni-example"


def test_an_approved_request_gets_a_credential_that_connects(lab):
    registry = ResearcherRegistry(lab.state_dir)
    request = _file(registry, "grace@navy.example")
    assert request.status == "pending" and request.credential_path is None
    path = registry.approve("Grace@Navy.Example")
    assert path == lab.state_dir / "researchers" / "grace-navy-example.credential" and _mode(path) == 0o600
    credential = Credential.load(path)
    assert (credential.role, credential.name) == ("researcher", "grace-navy-example")
    approved = registry.get("grace@navy.example")
    assert (approved.status, approved.credential_path) == ("approved", str(path))
    with connect(lab.address, credential=path, timeout=30) as client:
        assert client.submit(np.add, 2, 3).result() == 5
    for decide in (registry.approve, registry.refuse):
        with pytest.raises(AccessError, match="already approved"):
            decide("grace@navy.example")
    with pytest.raises(AccessError, match="already approved"):
        _file(registry, "grace@navy.example")


def test_unfiled_and_refused_requests_get_nothing(registry):
    with pytest.raises(AccessError, match="no access request"):
        registry.approve("nobody@uni.example")
    _file(registry)
    assert registry.refuse("ada@uni.example").status == "refused"
    assert not list(registry.directory.glob("*.credential"))
    with pytest.raises(AccessError, match="already refused"):
        _file(registry)
    with pytest.raises(AccessError, match="only a pending"):
        registry.refuse("ada@uni.example")
    assert registry.approve("ada@uni.example").exists()  # the admin may change their mind


def test_a_request_needs_every_field_and_may_be_amended_while_pending(registry):
    with pytest.raises(AccessError, match="affiliation, purpose"):
        registry.submit("ada@uni.example", name="Ada", affiliation=" ", purpose="")
    _file(registry)
    amended = registry.submit("ada@uni.example", name="Ada L.", affiliation="Royal Society", purpose="tables")
    assert (amended.name, amended.affiliation, amended.status) == ("Ada L.", "Royal Society", "pending")
    assert [r.email for r in registry.list()] == ["ada@uni.example"]


def test_credential_names_stay_unique(registry):
    for email in ("a.b@uni.example", "a-b@uni.example"):
        _file(registry, email)
    first, second = registry.approve("a.b@uni.example"), registry.approve("a-b@uni.example")
    assert first.name == "a-b-uni-example.credential"
    assert second.name.startswith("a-b-uni-example-") and second != first
    assert Credential.load(first).name != Credential.load(second).name


def test_approving_never_overwrites_a_credential_issued_or_revoked_under_the_same_name(registry):
    """``goblin researchers issue NAME`` and ``approve`` write into the same directory: an approval whose name is
    taken by an issued credential, or was revoked, gets a name of its own, and the issued file stays as it was."""
    from click.testing import CliRunner

    from goblin_dask.cli import main as goblin

    state = ["--state-dir", str(registry.state_dir)]
    issued = CliRunner().invoke(goblin, ["researchers", "issue", "ada-uni-example", *state])
    assert issued.exit_code == 0, issued.output
    before = Path(issued.stdout.strip()).read_bytes()
    _file(registry)
    path = registry.approve("ada@uni.example")
    assert path.name.startswith("ada-uni-example-") and path.name != "ada-uni-example.credential"
    assert Path(issued.stdout.strip()).read_bytes() == before
    assert Credential.load(path).name != "ada-uni-example"

    (registry.state_dir / "revoked.json").write_text('["grace-navy-example"]')
    _file(registry, "grace@navy.example")
    assert registry.approve("grace@navy.example").name.startswith("grace-navy-example-")
    again = CliRunner().invoke(goblin, ["researchers", "issue", "grace-navy-example", *state])
    assert again.exit_code == 1 and "was revoked on this lab node" in again.output and "pick another name" in again.output


def test_the_researchers_command(registry):
    state = ["--state-dir", str(registry.state_dir)]
    runner = CliRunner()

    def researchers(args):
        return runner.invoke(goblin, ["researchers", *args])

    assert "no access requests" in researchers(["list", *state]).output
    _file(registry)
    _file(registry, "eve@evil.example")
    listed = researchers(["list", *state])
    assert listed.exit_code == 0
    assert "pending   ada@uni.example  Ada Lovelace (Analytical Engines)" in listed.output
    assert "purpose: Bernoulli numbers" in listed.output

    approved = researchers(["approve", "ada@uni.example", *state])
    assert approved.exit_code == 0, approved.output
    path = approved.stdout.strip()
    assert path == str(registry.directory / "ada-uni-example.credential")
    assert Credential.load(path).role == "researcher" and "goblin_dask.connect" in approved.stderr

    refused = researchers(["refuse", "eve@evil.example", *state])
    assert refused.exit_code == 0 and "refused eve@evil.example" in refused.output
    assert not (registry.directory / "eve-evil-example.credential").exists()
    assert "eve@evil.example" in researchers(["list", "--status", "refused", *state]).output

    unknown = researchers(["approve", "nobody@uni.example", *state])
    assert unknown.exit_code == 1 and "no access request" in unknown.output


def test_a_registry_of_the_one_code_per_address_schema_opens(tmp_path, clock):
    directory = tmp_path / "state" / "researchers"
    directory.mkdir(parents=True, mode=0o700)
    with sqlite3.connect(directory / "registry.sqlite3") as db:
        db.execute("CREATE TABLE codes (email TEXT PRIMARY KEY, code_hash TEXT NOT NULL, expires_at REAL NOT NULL, "
                   "wrong_attempts INTEGER NOT NULL DEFAULT 0)")
        db.execute("INSERT INTO codes VALUES ('ada@uni.example', 'x', 0, 0)")
    db.close()
    signin = SignIn(ResearcherRegistry(tmp_path / "state", clock=clock))
    code = signin.issue_code("ada@uni.example", "10.0.0.1")
    assert signin.session_email(signin.redeem_code("ada@uni.example", code, "10.0.0.1")) == "ada@uni.example"
