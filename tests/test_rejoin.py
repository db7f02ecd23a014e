"""Rejoining: a refusal that can clear is retried, not the end of ``goblin volunteer`` (on 127.0.0.1).

The network cases (a link that drops, an agent restarted while its link is down, a lab node restarted)
are in tests/test_network.py, on the network testbed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from goblin_dask.node.local import LabNode
from goblin_dask.volunteer import refusal_can_clear
from tests.conftest import read_log, wait_for


def test_which_refusals_the_agent_retries():
    assert refusal_can_clear("'vol1' is already connected")
    for fatal in ("'vol1' is banned from this lab node", "credential revoked", "not signed by this lab node",
                  "it claims 0 task threads (1 to 256)"):
        assert not refusal_can_clear(fatal)


def test_a_second_agent_with_a_live_agents_credential_waits_and_joins_once_the_first_is_gone(tmp_path):
    """Not a stale registration (the first agent heartbeats): refused with "already connected", which the
    second agent retries; when the first agent dies, the second one is admitted, never having exited."""
    with LabNode.local(volunteers=1, dashboard=False) as node:
        name = node.volunteer_names()[0]
        first = node.volunteer_addresses()[name]
        credential = next(a for a in node.processes[name].args if a.startswith("goblin1:"))
        log = tmp_path / "second.log"
        with open(log, "wb") as f:
            second = subprocess.Popen([sys.executable, "-m", "goblin_dask.volunteer", node.address, "--token",
                                       credential, "--status-port", "-1", "--state-dir", str(tmp_path / "state")],
                                      stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: "already connected" in read_log(log) and "retrying in" in read_log(log),
                     "the second agent to be refused and retry", 120)
            assert second.poll() is None
            assert node.volunteer_addresses() == {name: first}  # the live registration stays
            node.kill_volunteer(name)
            wait_for(lambda: node.volunteer_addresses().get(name) not in (None, first),
                     "the second agent's admission", 120)
            assert second.poll() is None
            assert "refused this volunteer for now" in read_log(log)
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
            second.wait()
