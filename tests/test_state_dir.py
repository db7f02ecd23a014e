"""The lab admin's state directory: one node at a time, revocation that reaches the node, no accidental lab.

Real ``goblin node`` processes (TLS, 127.0.0.1) on one state directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from goblin_dask.credentials import LabKeys
from goblin_dask.node.process import stop_process
from goblin_dask.node.scheduler import NODE_FILE, read_node_file
from tests.conftest import wait_for

GOBLIN = [sys.executable, "-m", "goblin_dask.cli"]


def _node(state, log):
    with open(log, "ab") as f:
        return subprocess.Popen(GOBLIN + ["node", "--port", "0", "--no-dashboard", "--no-lab-worker",
                                          "--state-dir", str(state)],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _goblin(*args) -> subprocess.CompletedProcess:
    return subprocess.run(GOBLIN + list(args), capture_output=True, text=True)


def _ready(state, proc) -> bool:
    assert proc.poll() is None, f"the node exited with {proc.returncode}"
    try:
        return read_node_file(state).get("pid") == proc.pid
    except FileNotFoundError:
        return False


def test_a_second_node_on_a_state_directory_refuses_and_leaves_the_first_untouched(tmp_path):
    state = tmp_path / "lab"
    first = _node(state, tmp_path / "first.log")
    try:
        wait_for(lambda: _ready(state, first), "the first node")
        info = read_node_file(state)
        second = subprocess.run(GOBLIN + ["node", "--port", "0", "--no-dashboard", "--no-lab-worker",
                                          "--state-dir", str(state)], capture_output=True, text=True)
        assert second.returncode == 1, second.stderr
        assert f"in use by the lab node at {info['address']} (pid {first.pid})" in second.stderr
        assert "another --state-dir" in second.stderr
        assert first.poll() is None and read_node_file(state) == info  # its node file is still there, unchanged
        # and revoke still reaches the first node
        done = _goblin("revoke", "alice", "--state-dir", str(state))
        assert done.returncode == 0 and "revoked alice; disconnected 0 worker(s)" in done.stdout, done.stderr
    finally:
        stop_process(first)
    assert not (state / NODE_FILE).exists()  # the first removed its own node file when it stopped
    assert "alice" in LabKeys(state).revoked()


def test_revoke_never_reports_success_without_reaching_the_running_node(tmp_path):
    state = tmp_path / "lab"
    node = _node(state, tmp_path / "node.log")
    try:
        wait_for(lambda: _ready(state, node), "the node")
        info = read_node_file(state)
        # a node that does not answer (stopped): revoke says so, and fails
        os.kill(node.pid, signal.SIGSTOP)
        try:
            done = _goblin("revoke", "bob", "--state-dir", str(state))
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert done.returncode == 1 and "revoked bob;" not in done.stdout
        assert f"(pid {node.pid}) could not be reached" in done.stderr and "bob may still be connected" in done.stderr
        assert "bob" in LabKeys(state).revoked()  # written all the same: refused at its next admission
        # a node whose node file was removed (by hand, or by a second node of an older version)
        (state / NODE_FILE).unlink()
        done = _goblin("revoke", "carol", "--state-dir", str(state))
        assert done.returncode == 1 and "node file is missing" in done.stderr and "carol may still be connected" in done.stderr
        (state / NODE_FILE).write_text(json.dumps(info))
        done = _goblin("revoke", "dave", "--state-dir", str(state))
        assert done.returncode == 0 and "revoked dave; disconnected 0 worker(s)" in done.stdout
    finally:
        stop_process(node)
    # no node runs now, even though a stale node file from a killed one may remain: nothing to disconnect
    (state / NODE_FILE).write_text(json.dumps(info))
    done = _goblin("revoke", "erin", "--state-dir", str(state))
    assert done.returncode == 0 and "no lab node runs from" in done.stdout and "erin" in LabKeys(state).revoked()


def test_revoke_refuses_a_state_directory_that_holds_no_lab(tmp_path):
    typo = tmp_path / "lba"
    done = _goblin("revoke", "alice", "--state-dir", str(typo))
    assert done.returncode == 1 and "holds no lab node" in done.stderr and f"goblin node --state-dir {typo}" in done.stderr
    assert not (typo / "lab-secret").exists()
