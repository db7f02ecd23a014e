"""Getting going (issue 31): a researcher's credential without e-mail, `goblin --version/info/doctor`, and
errors that say what to do, fatal ones ending the command at once with their own exit code.

Real processes throughout: the session's lab node (`goblin node`, its lab worker, two volunteer agents),
volunteer agents started as `goblin volunteer` is, and `goblin node` itself for its ports.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys

import dask
import numpy as np
import pytest
from click.testing import CliRunner

import goblin_dask
import goblin_dask.array as ga
from goblin_dask import connect
from goblin_dask.cli import main as goblin
from goblin_dask.node.local import LabNode
from goblin_dask.errors import (EXIT_GAVE_UP, EXIT_OTHER_LAB, EXIT_PORT_IN_USE, EXIT_REVOKED, EXIT_WRONG_ROLE,
                                EXIT_WRONG_SCHEME, FatalConnectError)
from goblin_dask.tls import Credential, LabCA
from tests.conftest import wait_for


def _tcp(address: str) -> str:
    return address.replace("tls://", "tcp://")


def _issue_researcher(lab, name: str):
    result = CliRunner().invoke(goblin, ["researchers", "issue", name, "--state-dir", str(lab.state_dir)])
    assert result.exit_code == 0, result.output
    return result


def _other_lab(tmp_path, role: str, name: str) -> Credential:
    return LabCA(tmp_path / "another-lab").issue(role, name)


# -- 1. a researcher's way in without e-mail -------------------------------------------------------------


def test_researchers_issue_writes_a_credential_that_computes_a_verified_product(lab):
    result = _issue_researcher(lab, "ada-issued")
    path = result.stdout.strip()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert f"goblin_dask.connect({lab.address!r}, credential={path!r})" in result.stderr  # the line to paste
    credential = Credential.load(path)
    assert (credential.role, credential.certificate_role(), credential.name) == ("researcher", "researcher", "ada-issued")

    rng = np.random.default_rng(31)
    a, b = rng.standard_normal((512, 384)), rng.standard_normal((384, 256))
    before = lab.report()["accepted"]
    with connect(lab.address, credential=path, timeout=30, set_as_default=False) as client:
        got = (ga.from_array(a, chunks=128) @ ga.from_array(b, chunks=128)).compute(scheduler=client.get)
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)
    assert lab.report()["accepted"] > before  # volunteers computed blocks of it and the lab accepted them

    again = CliRunner().invoke(goblin, ["researchers", "issue", "ada-issued", "--state-dir", str(lab.state_dir)])
    assert again.exit_code == 1 and "already has a credential" in again.output
    bad = CliRunner().invoke(goblin, ["researchers", "issue", "ada/../x", "--state-dir", str(lab.state_dir)])
    assert bad.exit_code == 2 and "letters, digits" in bad.output


def test_a_revoked_researcher_is_disconnected_and_refused_at_connect_with_what_to_do(lab):
    """``goblin revoke NAME`` works on a researcher's name too: its clients are disconnected, every call of theirs
    is refused saying why, and connecting again fails at once (exit code 6), saying to ask the lab's admin."""
    from goblin_dask.node import rpc

    path = _issue_researcher(lab, "revoked-researcher").stdout.strip()
    x = np.arange(12.0).reshape(3, 4)
    with connect(lab.address, credential=path, timeout=30, set_as_default=False) as client:
        np.testing.assert_array_equal((ga.from_array(x) + 1).compute(scheduler=client.get), x + 1)
        bans_before = lab.report()["bans"]
        done = CliRunner().invoke(goblin, ["revoke", "revoked-researcher", "--state-dir", str(lab.state_dir)])
        assert done.exit_code == 0 and "revoked revoked-researcher; disconnected 1" in done.output, done.output
        with pytest.raises(PermissionError, match="the credential of researcher revoked-researcher was revoked"):
            client.sync(getattr(client.scheduler, rpc.REPORT))
    with pytest.raises(FatalConnectError) as refused:
        connect(lab.address, credential=path, timeout=30, set_as_default=False)
    assert refused.value.exit_code == EXIT_REVOKED
    assert "this credential was revoked by the lab; ask the lab's admin for a new one" in str(refused.value)
    assert lab.report()["bans"] == bans_before  # bans are volunteers'
    doctor = _doctor(lab.address, path)
    assert doctor.exit_code == EXIT_REVOKED and "FAIL role" in doctor.output and "revoked" in doctor.output
    again = CliRunner().invoke(goblin, ["researchers", "issue", "revoked-researcher", "--state-dir", str(lab.state_dir)])
    assert again.exit_code == 1 and "was revoked on this lab node" in again.output


# -- 2. version, info ------------------------------------------------------------------------------------


def test_version_and_info_print_the_stack_and_the_effective_settings():
    version = CliRunner().invoke(goblin, ["--version"])
    assert version.exit_code == 0 and version.output.strip() == f"goblin-dask {goblin_dask.__version__}"
    env = {**os.environ, "DASK_GOBLIN__LINK__STANDBY": "5", "DASK_GOBLIN__SMTP__PASSWORD": "hunter2"}
    out = subprocess.run([sys.executable, "-m", "goblin_dask.cli", "info"], capture_output=True, text=True,
                         env=env, check=True).stdout
    lines = dict(line.split(None, 1) for line in out.splitlines() if line and not line.startswith(("settings", " ")))
    import distributed
    import numba

    assert lines["goblin-dask"] == goblin_dask.__version__ and lines["dask"] == dask.__version__
    assert lines["distributed"] == distributed.__version__ and lines["numpy"] == np.__version__
    assert lines["numba"] == numba.__version__
    assert "  goblin.link.standby: 5" in out.splitlines()  # the effective value, not goblin.yaml's 2
    assert "  goblin.smtp.password: \"***\"" in out.splitlines() and "hunter2" not in out


# -- 2. doctor -------------------------------------------------------------------------------------------


def _doctor(address, credential_path):
    return CliRunner().invoke(goblin, ["doctor", address, "--credential", str(credential_path), "--timeout", "30"])


def test_doctor_passes_against_a_healthy_node(lab, tmp_path):
    path = _issue_researcher(lab, "doctor-ok").stdout.strip()
    result = _doctor(lab.address, path)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split(":")[0] for line in lines] == ["ok   credential", "ok   TLS", "ok   role", "ok   lab worker",
                                                       "ok   task"], result.output
    assert "researcher 'doctor-ok'" in lines[2] and "matches numpy" in lines[4]
    assert "volunteer result(s) verified, 0 rejected" in lines[4], lines[4]  # the session grid has volunteers
    volunteer = Credential.decode(lab.enroll("doctor-volunteer")).save(tmp_path / "v.credential")
    result = _doctor(lab.address, volunteer)
    assert result.exit_code == 0 and "the node sees volunteer 'doctor-volunteer'" in result.output, result.output


def test_doctor_names_each_broken_setup(lab, tmp_path):
    path = _issue_researcher(lab, "doctor-broken").stdout.strip()
    wrong_scheme = _doctor(_tcp(lab.address), path)
    assert wrong_scheme.exit_code == EXIT_WRONG_SCHEME
    assert f"FAIL address: {_tcp(lab.address)}: this lab node speaks TLS: use {lab.address}" in wrong_scheme.output

    other = _doctor(lab.address, _other_lab(tmp_path, "researcher", "mallory").save(tmp_path / "other.credential"))
    assert other.exit_code == EXIT_OTHER_LAB and "FAIL TLS" in other.output
    assert "issued by another lab node" in other.output

    revoked = Credential.decode(lab.enroll("doctor-revoked")).save(tmp_path / "revoked.credential")
    lab.revoke("doctor-revoked")
    result = _doctor(lab.address, revoked)
    assert result.exit_code == EXIT_REVOKED, result.output
    assert "FAIL role" in result.output and "revoked" in result.output and "ask the lab's admin" in result.output

    garbage = _doctor(lab.address, "not-a-credential")
    assert garbage.exit_code != 0 and "neither a goblin credential" in garbage.output


def test_doctor_names_a_node_without_a_lab_worker(tmp_path):
    """`goblin node --no-lab-worker`: volunteers would have no lab process to keep standby connections to."""
    state = tmp_path / "state"
    node = subprocess.Popen([sys.executable, "-m", "goblin_dask.cli", "node", "--host", "127.0.0.1", "--port", "0",
                             "--no-dashboard", "--no-lab-worker", "--state-dir", str(state)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: (state / "node.json").exists() or node.poll() is not None, "the node to start", 120)
        assert node.poll() is None, node.returncode
        address = json.loads((state / "node.json").read_text())["address"]
        result = _doctor(address, state / "admin.credential")
        assert result.exit_code == EXIT_GAVE_UP, result.output
        assert [line.split(":")[0] for line in result.output.splitlines()] == [
            "ok   credential", "ok   TLS", "ok   role", "FAIL lab worker"], result.output
        assert "the node has no lab worker: run `goblin node` with --lab-worker" in result.output
    finally:
        node.terminate()
        node.wait(60)


# -- 3. fatal errors end the command at once, with their own exit code ------------------------------------


def _volunteer(address, token, *extra):
    """`goblin volunteer` as a volunteer runs it, with no --max-attempts: a fatal error must end it by itself.
    ``token``: the credential's text, handed over as a private file (never on the command line)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "volunteer.credential")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return subprocess.run([sys.executable, "-m", "goblin_dask.volunteer", address, "--token", path,
                               "--status-port", "-1", *extra], capture_output=True, text=True, timeout=600)


def test_a_volunteer_with_a_tcp_address_is_told_to_use_tls(lab):
    proc = _volunteer(_tcp(lab.address), lab.enroll("scheme-volunteer"))
    assert proc.returncode == EXIT_WRONG_SCHEME, proc.stderr
    assert f"this lab node speaks TLS: use {lab.address}" in proc.stderr and "retrying" not in proc.stderr


def test_a_volunteer_with_another_labs_credential_stops_at_once(lab, tmp_path):
    stranger = LabCA(tmp_path / "another-lab").issue("volunteer", "stranger", token="gv1.volunteer.stranger.0.0")
    proc = _volunteer(lab.address, stranger.encode())
    assert proc.returncode == EXIT_OTHER_LAB, proc.stderr
    assert "issued by another lab node" in proc.stderr and "retrying" not in proc.stderr


def test_a_revoked_volunteer_is_told_so_and_stops(lab):
    token = lab.enroll("revoked-volunteer")
    lab.revoke("revoked-volunteer")
    proc = _volunteer(lab.address, token)
    assert proc.returncode == EXIT_REVOKED, proc.stderr
    assert "this credential was revoked by the lab; ask the lab's admin for a new one" in proc.stderr


def test_a_garbage_token_is_not_reported_as_a_missing_file():
    """A credential file holding something else is named as such, not as a file that is missing."""
    proc = _volunteer("tls://127.0.0.1:9", "garbage")
    assert proc.returncode == 2 and "credential" in proc.stderr and "No such file" not in proc.stderr, proc.stderr


def test_connect_refuses_at_once_what_cannot_succeed(lab, tmp_path):
    path = _issue_researcher(lab, "connect-errors").stdout.strip()
    with pytest.raises(FatalConnectError, match=f"this lab node speaks TLS: use {lab.address}") as e:
        connect(_tcp(lab.address), credential=path, timeout=30)
    assert e.value.exit_code == EXIT_WRONG_SCHEME
    with pytest.raises(FatalConnectError, match="'register-client' is not allowed for a volunteer credential.*"
                                                "goblin researchers issue NAME") as e:
        connect(lab.address, credential=lab.enroll("volunteer-as-researcher"), timeout=30)
    assert e.value.exit_code == EXIT_WRONG_ROLE
    # a credential whose role field is edited still carries its certificate's role, which the node goes by
    forged = Credential(**{**Credential.decode(lab.enroll("forged-role")).__dict__, "role": "researcher"})
    with pytest.raises(FatalConnectError, match="not allowed for a volunteer credential"):
        connect(lab.address, credential=forged.encode(), timeout=30)
    with pytest.raises(FatalConnectError, match="issued by another lab node") as e:
        connect(lab.address, credential=_other_lab(tmp_path, "researcher", "eve").encode(), timeout=30)
    assert e.value.exit_code == EXIT_OTHER_LAB


def _handshake(address: str, credential: Credential) -> str:
    """One TLS handshake with ``credential`` at ``address``, the way the volunteer agent opens its connection;
    returns why it failed (a credential of another lab never gets through)."""
    import ssl

    from distributed.comm.addressing import parse_address, parse_host_port

    context = credential.security().get_connection_args("worker")["ssl_context"]
    with socket.create_connection(parse_host_port(parse_address(address)[1]), timeout=30) as raw:
        try:
            context.wrap_socket(raw).close()
        except ssl.SSLError as e:
            return str(e)
    raise AssertionError(f"a credential of another lab got through the TLS handshake at {address}")


HELD = re.compile(r"\((\d+) more since the last such line, from 1 address\(es\)\)")


def assert_once_per_interval(lines: list[str], interval: float, attempts: int) -> None:
    """The node's lines about ``attempts`` failed handshakes from one address: at least ``interval`` seconds apart
    (by their own timestamps), the first alone, later ones counting those held back since the one before (some
    did), never more counted than made, whatever the pace of the attempts."""
    import datetime

    stamps = [datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") for line in lines]
    assert all((b - a).total_seconds() >= interval - 0.05 for a, b in zip(stamps, stamps[1:])), lines
    held = [HELD.search(line) for line in lines]
    assert held[0] is None, lines[0]
    counted = len(lines) + sum(int(h.group(1)) for h in held if h)
    assert len(lines) < counted <= attempts, (lines, attempts)


def test_the_node_logs_a_credential_of_another_lab_once_per_interval_with_its_address(lab):
    """A volunteer enrolled at lab A joins lab B: it stops at once with its reason, and B says on its log what
    happened, with the peer's address, in one WARNING line; a flood of such handshakes is counted in B's next
    line, not written one by one.  A and B both keep serving."""
    token = lab.enroll("wanderer")  # lab A: the session's lab
    with dask.config.set({"goblin.link.handshake-log-interval": 2.0}):
        lab_b = LabNode.local(volunteers=0, dashboard=False)
    with lab_b:
        log = lab_b.state_dir / "logs" / "scheduler.log"

        def lines() -> list[str]:
            return [line for line in log.read_text(errors="replace").splitlines() if "refused a TLS connection" in line]

        proc = _volunteer(lab_b.address, token)
        assert proc.returncode == EXIT_OTHER_LAB and "issued by another lab node" in proc.stderr, proc.stderr
        wait_for(lambda: lines(), "lab B's line about the refused handshake")
        (first,) = lines()
        assert "goblin node WARNING refused a TLS connection from tls://127.0.0.1:" in first, first
        assert "its certificate is not signed by this lab's CA" in first and "another lab's credential" in first
        assert "more since the last such line" not in first

        wanderer = Credential.decode(token)
        flood = 40
        for _ in range(flood):
            assert "certificate verify failed" in _handshake(lab_b.address, wanderer)
        attempts = 1 + flood

        def next_line() -> bool:
            nonlocal attempts
            _handshake(lab_b.address, wanderer)
            attempts += 1
            return any(HELD.search(line) for line in lines())

        wait_for(next_line, "lab B's line counting those held back, once its interval has passed", interval=0.5)
        assert_once_per_interval(lines(), 2.0, attempts)

        rng = np.random.default_rng(5)
        a, b = rng.standard_normal((256, 192)), rng.standard_normal((192, 128))
        for node in (lab, lab_b):  # both labs keep serving
            path = _issue_researcher(node, "after-the-wanderer").stdout.strip()
            with connect(node.address, credential=path, timeout=30, set_as_default=False) as client:
                got = (ga.from_array(a, chunks=64) @ ga.from_array(b, chunks=64)).compute(scheduler=client.get)
            np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)


def _no_tls(address: str) -> str:
    """Distributed's own tcp:// client at the TLS port ``address``, as a `tcp://` address in the README made
    researchers and volunteers do; returns how it failed."""
    import asyncio

    from distributed.comm import connect as comm_connect

    async def dial():
        comm = await comm_connect(_tcp(address), timeout=30)
        try:
            await comm.read()
        finally:
            comm.abort()

    try:
        asyncio.run(dial())
    except OSError as e:
        return str(e)
    raise AssertionError(f"a tcp:// client got a message from the TLS port {address}")


def _no_certificate(address: str) -> str:
    """A TLS client with no certificate at ``address``: the handshake fails on the node's side."""
    import ssl

    from distributed.comm.addressing import parse_address, parse_host_port

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(parse_host_port(parse_address(address)[1]), timeout=30) as raw:
        try:
            with context.wrap_socket(raw) as tls:
                tls.sendall(b"hello")
                if tls.recv(1):
                    raise AssertionError(f"a TLS client without a certificate got a byte from {address}")
        except (ssl.SSLError, OSError) as e:  # TLS 1.3: the node's refusal comes after the client's handshake
            return str(e) or type(e).__name__
    return "closed"


def _closed(address: str) -> str:
    """A client (a port scan, a load balancer's probe) that connects and closes before any handshake."""
    from distributed.comm.addressing import parse_address, parse_host_port

    socket.create_connection(parse_host_port(parse_address(address)[1]), timeout=30).close()
    return "closed"


@pytest.mark.parametrize("kind", ["no TLS", "no certificate", "closed"])
def test_the_node_logs_a_failed_handshake_once_per_interval_with_what_to_do(kind):
    """A client that keeps failing the TLS handshake for the same reason (a tcp:// address, no credential, a
    probe that connects and closes) gets one line on the node's log per goblin.link.handshake-log-interval,
    naming its address and what to do; the ones in between are counted in the next line."""
    if kind == "no TLS":
        fail, says = _no_tls, ["goblin node WARNING refused a TLS connection from tls://127.0.0.1:",
                               "it does not speak TLS (", "never tcp://"]
    elif kind == "no certificate":
        fail, says = _no_certificate, ["goblin node WARNING refused a TLS connection from tls://127.0.0.1:",
                                       "it sent no certificate (", "`goblin enroll`", "credential=PATH"]
    else:
        fail, says = _closed, ["goblin node INFO a TLS handshake from tls://127.0.0.1:", "failed (",
                               "nothing to do unless a volunteer or researcher cannot connect", "goblin doctor"]
    with dask.config.set({"goblin.link.handshake-log-interval": 2.0}):
        node = LabNode.local(volunteers=0, dashboard=False)
    with node:
        log = node.state_dir / "logs" / "scheduler.log"

        def lines() -> list[str]:
            return [line for line in log.read_text(errors="replace").splitlines()
                    if "refused a TLS connection from" in line or "a TLS handshake from" in line]

        fail(node.address)
        wait_for(lambda: lines(), "the node's line about the failed handshake")
        (first,) = lines()
        assert all(part in first for part in says), first
        assert "more since the last such line" not in first

        flood = 30
        for _ in range(flood):
            fail(node.address)
        attempts = 1 + flood

        def next_line() -> bool:
            nonlocal attempts
            fail(node.address)
            attempts += 1
            return any(HELD.search(line) for line in lines())

        wait_for(next_line, "the node's line counting those held back, once its interval has passed", interval=0.5)
        assert_once_per_interval(lines(), 2.0, attempts)
        assert all(part in line for line in lines() for part in says), lines()


@pytest.mark.parametrize("which", ["--port", "--dashboard-port"])
def test_goblin_node_names_the_port_in_use(tmp_path, which):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--dashboard-port" if which == "--port" else "--port"
        proc = subprocess.run([sys.executable, "-m", "goblin_dask.cli", "node", "--host", "127.0.0.1", which, str(port),
                               other, "0", "--no-lab-worker", "--state-dir", str(tmp_path / "state")],
                              capture_output=True, text=True, timeout=600)
    what = "the scheduler" if which == "--port" else "the dashboard"
    assert proc.returncode == EXIT_PORT_IN_USE, proc.stderr
    assert f"{what} port {port} on 127.0.0.1 is in use" in proc.stderr and f"pick another with {which}" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "state" / "node.json").exists()


def test_goblin_node_no_dashboard_listens_on_its_scheduler_port_only(tmp_path):
    """`goblin node --no-dashboard` serves no HTTP at all: distributed's scheduler would still listen on the
    dashboard port (or 8787) for /health and /metrics."""
    import psutil

    with socket.socket() as probe:  # a port free now, given as the dashboard port that must stay closed
        probe.bind(("127.0.0.1", 0))
        dashboard_port = probe.getsockname()[1]
    state = tmp_path / "state"
    node = subprocess.Popen([sys.executable, "-m", "goblin_dask.cli", "node", "--host", "127.0.0.1", "--port", "0",
                             "--dashboard-port", str(dashboard_port), "--no-dashboard", "--no-lab-worker",
                             "--state-dir", str(state)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: (state / "node.json").exists() or node.poll() is not None, "the node to start", 120)
        assert node.poll() is None, node.returncode
        info = json.loads((state / "node.json").read_text())
        assert info["dashboard_link"] is None, info
        scheduler_port = int(info["address"].rsplit(":", 1)[1])
        listening = {c.laddr.port for c in psutil.Process(node.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {scheduler_port}, (listening, scheduler_port)
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", dashboard_port))
    finally:
        node.terminate()
        node.wait(60)


# -- 4. small ones ---------------------------------------------------------------------------------------


def test_a_revocation_is_in_the_reports_bans(lab):
    lab.enroll("revoked-for-report")
    lab.revoke("revoked-for-report")
    lab.revoke("revoked-for-report")  # once per name
    bans = [b for b in lab.report()["bans"] if b["name"] == "revoked-for-report"]
    assert [b["reason"] for b in bans] == ["revoked by the lab's admin"]


def test_expected_refusals_log_no_alarm(lab):
    """A volunteer skipping distributed's shuffle plugin says so calmly; a researcher's refused call is one
    warning line on the node, not an ERROR traceback (and the researcher still gets the node's reason)."""
    for name in lab.volunteer_names():
        log = (lab.state_dir / "logs" / f"{name}.log").read_text()
        assert "skipped worker plugin 'shuffle'" in log and "WARNING refused worker plugin" not in log
    path = _issue_researcher(lab, "refused-call").stdout.strip()
    scheduler_log = lab.state_dir / "logs" / "scheduler.log"
    start = scheduler_log.stat().st_size
    with connect(lab.address, credential=path, timeout=30, set_as_default=False) as client:
        with pytest.raises(PermissionError, match="'goblin_revoke' is not allowed for researcher refused-call"):
            client.sync(client.scheduler.goblin_revoke, name="nobody")
    with open(scheduler_log, "rb") as f:
        f.seek(start)
        log = f.read().decode(errors="replace")
    assert "refused 'goblin_revoke'" in log
    assert "Exception while handling op" not in log and "goblin node ERROR" not in log and "Traceback" not in log


def test_the_package_shows_its_public_names_only():
    assert dir(goblin_dask) == sorted(goblin_dask.__all__) == ["Graph", "LabNode", "__version__", "capture", "connect"]


def test_troubleshooting_lists_every_exit_code_of_goblin_dask_errors():
    """The docs' troubleshooting table and goblin_dask.errors agree: every fatal cause, its code, its message."""
    from pathlib import Path

    import goblin_dask.errors as errors

    page = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text()
    table = page.split("# Troubleshooting", 1)[1].split("\n## ", 1)[0]
    listed = {int(line.split("|")[1]) for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()}
    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    assert listed == codes
    assert "this lab node speaks TLS: use tls://HOST:PORT" in table and "was revoked by the lab" in table
