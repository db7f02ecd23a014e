"""A volunteer's credential never travels in a command line: another local user cannot read it.

``/proc/PID/cmdline`` is readable by every user of the machine; a credential there (its TLS key
included) let another local user be that volunteer to the lab, and one malformed message sent with it
got the honest volunteer banned (a ban is per credential: the lab cannot tell two holders of one key
apart, so the key must stay with its owner).  Credentials travel in a private file (0600) or the
environment (``/proc/PID/environ`` is readable by its owner only).  Real volunteer processes on a real
lab node (the session's ``lab``), and a real second user (``nobody``) where the tests run as root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from goblin_dask.credentials import LabKeys
from goblin_dask.tls import Credential, LabCA
from tests.conftest import wait_for

_OTHER_USER_READS = r"""
import json, sys
pid, credential_file = sys.argv[1], sys.argv[2]
out = {"cmdline": open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")}
for what, path in (("environ", f"/proc/{pid}/environ"), ("file", credential_file)):
    try:
        out[what] = open(path, "rb").read().decode(errors="replace")
    except OSError as e:
        out[what] = f"refused: {type(e).__name__}"
print(json.dumps(out))
"""


def _key_material(credential: Credential) -> list[str]:
    """Pieces any of which would let a reader act as this volunteer, or start to."""
    key_lines = [ln for ln in credential.key.splitlines() if ln and not ln.startswith("-----")]
    return [credential.encode()[:40], credential.token, credential.token.split(".")[-1], *key_lines[:3]]


def _volunteer(lab, *args, env=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "goblin_dask.cli", "volunteer", lab.address, *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, **kwargs)


def test_a_running_volunteers_command_line_holds_no_key_material(lab):
    for name in lab.volunteer_names():
        proc = lab.processes[name]
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        path = proc.args[proc.args.index("--token") + 1]
        credential = Credential.decode(Path(path).read_text())
        assert credential.name == name and oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert "goblin1:" not in argv
        for piece in _key_material(credential):
            assert piece not in argv


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to run a second user (setpriv)")
def test_another_local_user_cannot_read_a_running_volunteers_credential(lab):
    """As user nobody: the volunteer's command line is readable, and holds no key; its environment and
    its credential file are not readable."""
    name = lab.volunteer_names()[0]
    proc = lab.processes[name]
    path = proc.args[proc.args.index("--token") + 1]
    credential = Credential.decode(Path(path).read_text())
    seen = json.loads(subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", os.path.realpath(sys.executable), "-I", "-c",
         _OTHER_USER_READS, str(proc.pid), path], capture_output=True, text=True, check=True, cwd="/").stdout)
    assert "goblin_dask" in seen["cmdline"]  # it did read the command line
    for piece in _key_material(credential):
        assert piece not in seen["cmdline"]
    assert seen["environ"].startswith("refused") and seen["file"].startswith("refused")


def test_a_credential_on_the_command_line_is_refused_before_anything_runs(lab, tmp_path):
    inline = lab.enroll("inline-cred")
    done = _volunteer(lab, "--token", inline, "--max-attempts", "1", "--status-port", "-1")
    assert done.returncode == 2, done.stderr
    assert "can be read by every user of this machine" in done.stderr and "GOBLIN_TOKEN" in done.stderr
    assert "inline-cred" not in lab.volunteer_names()


def test_a_credential_file_others_can_read_is_refused_with_the_fix(lab, tmp_path):
    path = tmp_path / "shared.credential"
    path.write_text(lab.enroll("loose-file") + "\n")
    path.chmod(0o640)
    done = _volunteer(lab, "--token", str(path), "--max-attempts", "1", "--status-port", "-1")
    assert done.returncode == 2 and f"chmod 600 {path}" in done.stderr and "mode 0640" in done.stderr, done.stderr
    missing = _volunteer(lab, "--token", str(tmp_path / "nope.credential"), "--max-attempts", "1")
    assert missing.returncode == 2 and "cannot read the credential file" in missing.stderr


def test_a_credential_in_the_environment_joins(tmp_path):
    """GOBLIN_TOKEN may hold the credential itself (the environment is its owner's to read).  A grid of its
    own: the session's lab reports every volunteer that ever joined it."""
    from goblin_dask.node.local import LabNode

    with LabNode.local(volunteers=0, dashboard=False) as lab:
        _joins_from_the_environment(lab)


def _joins_from_the_environment(lab):
    credential = lab.enroll("env-cred")
    proc = subprocess.Popen([sys.executable, "-m", "goblin_dask.cli", "volunteer", lab.address,
                             "--status-port", "-1", "--host", "127.0.0.1"],
                            env={**os.environ, "GOBLIN_TOKEN": credential}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: "env-cred" in lab.volunteer_names() or proc.poll() is not None, "env-cred to join")
        assert proc.poll() is None and "env-cred" in lab.volunteer_names()
        assert "goblin1:" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    wait_for(lambda: "env-cred" not in lab.volunteer_names(), "env-cred to leave")


def _goblin(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "goblin_dask.cli", *args], capture_output=True, text=True, **kwargs)


def test_enroll_writes_a_private_file_and_prints_how_to_join_with_it(tmp_path):
    state = tmp_path / "lab"
    LabKeys(state), LabCA(state)  # what `goblin node` creates: the lab's secret and CA
    out = tmp_path / "alice.credential"
    done = _goblin("enroll", "--state-dir", str(state), "--name", "alice", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out) and oct(out.stat().st_mode & 0o777) == "0o600"
    credential = Credential.decode(out.read_text())
    assert (credential.role, credential.name) == ("volunteer", "alice")
    assert f"--token {out}" in done.stderr and "goblin1:" not in done.stdout + done.stderr
    again = _goblin("enroll", "--state-dir", str(state), "--name", "alice2", "--out", str(out))
    assert again.returncode == 1 and "exists" in again.stderr
    assert Credential.decode(out.read_text()).name == "alice"  # nothing overwritten
    default = _goblin("enroll", "--state-dir", str(state), "--name", "bob", cwd=tmp_path)
    assert default.returncode == 0 and (tmp_path / "bob.credential").stat().st_mode & 0o077 == 0


def test_enroll_refuses_a_state_directory_that_holds_no_lab(tmp_path):
    state = tmp_path / "lab"
    LabKeys(state), LabCA(state)
    typo = tmp_path / "lba"
    done = _goblin("enroll", "--state-dir", str(typo), "--name", "alice", cwd=tmp_path)
    assert done.returncode == 1
    assert "holds no lab node" in done.stderr and f"goblin node --state-dir {typo}" in done.stderr
    assert not (typo / "ca.pem").exists() and not (tmp_path / "alice.credential").exists()  # no new CA, no file
