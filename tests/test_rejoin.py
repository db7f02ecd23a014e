"""Rejoining: a refusal that can clear is retried, not the end of ``goblin volunteer`` (on 127.0.0.1).

The network cases (a link that drops, an agent restarted while its link is down, a lab node restarted)
are in tests/test_network.py, on the network testbed.
"""

from __future__ import annotations

import asyncio
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
        credential = str(node.state_dir / "credentials" / f"{name}.credential")  # the first agent's own file
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


def test_a_stale_registration_is_replaced_by_its_own_volunteers_connection_only(tmp_path):
    """In-process node: a live registration is not replaced; a stale one is not replaced by a connection with
    another volunteer's certificate, and is by one with its own (its worker removed, the swap recorded)."""
    import dataclasses

    import pytest

    from tests.inprocess import run_lab, volunteer_worker

    async def body(lab):
        alice = lab.workers["alice"]
        old, credential = alice.address, lab.credentials["alice"]
        with pytest.raises(ValueError, match="already connected"):
            await lab.start_worker(credential, cls=volunteer_worker())
        alice.periodic_callbacks["heartbeat"].stop()  # silent from now on, its connections still open
        await lab.wait_for(lambda: lab.admission.stale_registration("alice") is not None)
        forged = dataclasses.replace(lab.credentials["bob"], token=credential.token)  # bob's certificate
        with pytest.raises(ValueError, match="does not match its token"):
            await lab.start_worker(forged, cls=volunteer_worker())
        assert old in lab.scheduler.workers
        try:
            new = await lab.add_volunteer("alice", credential=credential)
            assert old not in lab.scheduler.workers and new.address in lab.scheduler.workers
            assert lab.admission.replaced[-1]["old"] == old and lab.admission.replaced[-1]["new"] == new.address
            assert "bob" in lab.connected()
        finally:
            await alice.close()

    run_lab(tmp_path, body)


def test_a_silent_volunteer_is_removed_and_a_stalled_scheduler_removes_nobody(tmp_path):
    """goblin.link.dead-after: a volunteer whose heartbeats stop is removed, the others stay; a check that
    runs long after the one before (the scheduler's loop stalled) counts everyone's silence afresh."""
    import time

    from goblin_dask.link import SilentVolunteers
    from tests.inprocess import run_lab

    async def body(lab):
        watch = SilentVolunteers(lab.scheduler, lab.admission)
        assert watch.dead_after == 1.0
        await watch.check()
        assert lab.connected() >= {"alice", "bob", "lab-worker"}
        lab.workers["alice"].periodic_callbacks["heartbeat"].stop()
        while "alice" in lab.connected():
            await watch.check()
            await asyncio.sleep(0.1)
        assert watch.removed[-1]["name"] == "alice" and {"bob", "lab-worker"} <= lab.connected()
        lab.workers["bob"].periodic_callbacks["heartbeat"].stop()
        await lab.wait_for(lambda: watch.silent())  # bob is past the limit now
        watch.last_check = time.time() - 10 * watch.interval  # as if the loop had stalled since
        await watch.check()
        assert "bob" in lab.connected()  # the stall's heartbeats may be unread: silence counts from now
        assert not watch.silent()

    run_lab(tmp_path, body, config={"goblin.link.dead-after": 1.0})


def test_a_volunteer_the_scheduler_holds_back_over_its_read_rate_is_not_silent(tmp_path, monkeypatch):
    """Issue 29: an honest volunteer that sent more than a burst of goblin.link.scheduler-read-rate has its next
    messages, heartbeats included, left unread until its debt is paid: it is not silent meanwhile, and its
    silence counts from when the scheduler last held it back."""
    from goblin_dask import link
    from goblin_dask.link import ReadRate, SilentVolunteers
    from tests.inprocess import run_lab

    async def body(lab):
        watch = SilentVolunteers(lab.scheduler, lab.admission)
        lab.workers["bob"].periodic_callbacks["heartbeat"].stop()
        await lab.wait_for(lambda: watch.silent())  # bob is past the limit now
        bob = lab.address_of("bob")
        pace = ReadRate(rate=1.0, burst=1.0)
        monkeypatch.setattr(link, "_read_rate", pace)
        pace.charge("bob", 10**6)  # in debt for days: the scheduler reads nothing more of bob
        assert bob not in watch.silent()
        monkeypatch.setattr(link, "_read_rate", ReadRate(rate=1.0, burst=1.0))  # debt paid
        assert bob not in watch.silent()  # silent from when it was last held back, not from its last heartbeat
        await lab.wait_for(lambda: bob in watch.silent())
        assert watch.held_back_at == {}

    run_lab(tmp_path, body, config={"goblin.link.dead-after": 1.0})
