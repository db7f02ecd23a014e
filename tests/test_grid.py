"""The embedded grid: real lab node, lab worker and volunteer processes on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import dask
import numpy as np
import pytest

import goblin_dask.array as ga

from goblin_dask.credentials import admin_credential, issue_credential
from goblin_dask.errors import EXIT_REVOKED
from goblin_dask.node.local import LabNode, LabNodeStartError
from goblin_dask.node import rpc
from goblin_dask.node.scheduler import read_node_file
from goblin_dask.roles import LAB_WORKER_NAME
from goblin_dask.tls import Credential
from tests.conftest import assemble, blocked_product_graph, wait_for


def _product(client, a, b, block):
    dsk, keys, blocks = blocked_product_graph(a, b, block)
    results = client.get(dsk, keys)
    return assemble({k[1:]: r for k, r in zip(keys, results)}, (a.shape[0], b.shape[1]), blocks)


def test_verified_product_with_volunteers_taking_part(lab):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((300, 250)), rng.standard_normal((250, 200))
    before = lab.report()
    c = _product(lab.client, a, b, block=64)
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)
    after = lab.report()
    n_tasks = 5 * 4 * 4
    assert after["accepted"] - before["accepted"] == n_tasks
    assert after["rejected"] == before["rejected"]
    assert after["by_method"]["freivalds"] - before["by_method"].get("freivalds", 0) == n_tasks
    assert len(after["volunteers"]) == 2
    assert all(v["accepted"] > 0 and not v["banned"] for v in after["volunteers"].values())


def test_report_is_served_over_http(lab):
    base = lab.dashboard_link.rsplit("/status", 1)[0]
    with urllib.request.urlopen(base + "/goblin/report.json", timeout=30) as resp:
        served = json.loads(resp.read())
    assert {"tasks", "accepted", "rejected", "by_method", "volunteers", "overhead"} <= set(served)
    assert set(served["volunteers"]) == set(lab.volunteer_names())


@pytest.mark.slow
def test_the_lab_worker_and_volunteers_run_distributeds_monitors_at_the_grids_quiet_intervals(lab):
    """The event-loop monitor every 500 ms, not 20 ms (most of an idle process's CPU), the system monitor
    every 2 s; what each volunteer reports in its heartbeats, and the lab worker's own callbacks."""
    worker = lab.lab_worker_address()
    tick, monitor = lab.client.run(lambda dask_worker: (dask_worker._tick_interval,
                                                        dask_worker.periodic_callbacks["monitor"].callback_time),
                                   workers=[worker])[worker]
    assert (tick, monitor) == (0.5, 2000)
    volunteers = set(lab.volunteer_addresses().values())
    workers = lab.client.scheduler_info()["workers"]
    assert volunteers <= set(workers)
    for address in volunteers:  # the mean interval its loop was seen at: 0.5 s, and never distributed's 0.02 s
        assert workers[address]["metrics"]["event_loop_interval"] >= 0.4, workers[address]["metrics"]


def test_a_volunteer_heartbeats_every_goblin_link_heartbeat_seconds_not_distributeds_half_second(lab):
    """Each heartbeat costs the scheduler about 1 ms: a volunteer's come every 2 s (``goblin.link.heartbeat``) on a
    grid where distributed asks every 0.5 s; the lab worker keeps distributed's."""
    import time

    from goblin_dask.link import volunteer_heartbeat

    assert volunteer_heartbeat(3) == 2.0 and volunteer_heartbeat(1000) == 6.0  # distributed's where longer
    volunteer = next(iter(lab.volunteer_addresses().values()))
    beats, worker_beats, t0 = set(), set(), time.monotonic()
    while time.monotonic() - t0 < 6.0:  # sampled 10 times a second: about 3 heartbeats, not 12
        workers = lab.client.scheduler_info()["workers"]
        beats.add(workers[volunteer]["last_seen"])
        worker_beats.add(workers[lab.lab_worker_address()]["last_seen"])
        time.sleep(0.1)
    assert 2 <= len(beats) <= 5, sorted(beats)
    assert len(worker_beats) >= 8, sorted(worker_beats)


def test_a_bad_heartbeat_setting_stops_the_node_at_its_start_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DASK_GOBLIN__LINK__HEARTBEAT", "0")
    with pytest.raises(LabNodeStartError, match=r"goblin\.link\.heartbeat must be between 0 and 60 seconds, got 0\.0"):
        LabNode.local(volunteers=0, state_dir=tmp_path / "lab", timeout=60)


def test_the_quiet_monitors_keep_an_interval_the_admin_set():
    from goblin_dask.node.process import quiet_monitors

    keys = ("distributed.admin.tick.interval", "distributed.admin.system-monitor.interval")
    with dask.config.set(dict(zip(keys, ("50ms", "500ms")))):  # (leaves this process's settings as they were)
        quiet_monitors()
        assert [dask.config.get(k) for k in keys] == ["50ms", "2s"]
    with dask.config.set(dict(zip(keys, ("20ms", "1s")))):
        quiet_monitors()
        assert [dask.config.get(k) for k in keys] == ["500ms", "1s"]


def test_a_volunteer_killed_mid_product_loses_nothing():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((480, 480)), rng.standard_normal((480, 480))
    with LabNode.local(volunteers=2) as node:
        victim = node.volunteer_names()[0]
        dsk, keys, blocks = blocked_product_graph(a, b, block=40)
        futures = node.client.get(dsk, keys, sync=False)
        wait_for(lambda: node.report()["volunteers"].get(victim, {}).get("accepted", 0) >= 5, "the victim to be busy")
        node.kill_volunteer(victim)
        assert not all(f.done() for f in futures)  # killed mid-product
        results = node.client.gather(futures)
        c = assemble({k[1:]: r for k, r in zip(keys, results)}, a.shape, blocks)
        np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)
        assert victim not in node.volunteer_names()
        assert node.report()["rejected"] == 0


def _run_volunteer(address, token, *extra, timeout=120):
    # the credential in the environment, never on a command line (tests/test_credential_files.py)
    return subprocess.run([sys.executable, "-m", "goblin_dask.volunteer", address, *extra], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "GOBLIN_TOKEN": token})


def test_forged_and_revoked_credentials_are_refused(lab):
    real = Credential.decode(lab.enroll("mallory"))
    forged = dataclasses.replace(real, token=real.token[:-4] + "0000").encode()
    proc = _run_volunteer(lab.address, forged)
    assert proc.returncode == 2 and "not signed by this lab node" in proc.stderr
    name = lab.add_volunteer(lab.enroll("eve"))
    assert name == "eve" and "eve" in lab.volunteer_names()
    assert lab.revoke("eve")
    wait_for(lambda: "eve" not in lab.volunteer_names(), "eve to be disconnected")
    lab.processes["eve"].wait(60)
    proc = _run_volunteer(lab.address, _credential_of(lab, "eve"))
    assert proc.returncode == EXIT_REVOKED and "revoked" in proc.stderr  # its own code: no retry clears it
    with pytest.raises(Exception, match="revoked"):
        lab.enroll("eve")


def _credential_of(lab, name):
    path = lab.processes[name].args[lab.processes[name].args.index("--token") + 1]
    return open(path).read().strip()


def test_volunteer_that_cannot_reach_the_node_retries_and_says_why(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    token = issue_credential(tmp_path, "volunteer", "x").encode()
    proc = _run_volunteer(f"tls://127.0.0.1:{port}", token, "--max-attempts", "2")
    assert proc.returncode == 3
    assert "cannot reach lab node" in proc.stderr
    assert re.search(r"retrying in (0\.[5-9]|1\.0) s", proc.stderr), proc.stderr  # the first wait, with jitter
    assert "gave up after 2 attempts" in proc.stderr


def test_local_node_that_fails_to_start_names_the_part_and_cleans_up(tmp_path):
    with pytest.raises(LabNodeStartError, match=r"part 'volunteer-\w+'") as info:
        LabNode.local(volunteers=1, memory_limit="not-a-size", state_dir=tmp_path / "state", timeout=60)
    assert "memory" in str(info.value).lower()
    assert not (tmp_path / "state" / "node.json").exists()
    _assert_no_process_left(tmp_path / "state")


def _assert_no_process_left(marker: str) -> None:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    left = [line for line in out.splitlines() if str(marker) in line and "ps -eo" not in line]
    assert not left, left


def test_close_leaves_no_process_behind(tmp_path):
    node = LabNode.local(volunteers=1, state_dir=tmp_path / "grid")
    procs = list(node.processes.values())
    assert len(procs) == 3 and all(p.poll() is None for p in procs)
    node.close()
    assert all(p.poll() is not None for p in procs)
    _assert_no_process_left(tmp_path / "grid")


def test_cli_node_enroll_volunteer_revoke(tmp_path):
    """The commands a lab admin and a volunteer type, each in its own process."""
    from distributed import Client

    state = tmp_path / "node"
    env = dict(os.environ, GOBLIN_STATE_DIR=str(state))
    goblin = [sys.executable, "-m", "goblin_dask.cli"]
    node = subprocess.Popen(goblin + ["node", "--port", "0", "--dashboard-port", "0"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    volunteer = None
    try:
        banner = [node.stdout.readline() for _ in range(5)]
        assert banner[0].startswith("goblin lab node at tls://127.0.0.1:")
        assert "goblin volunteer" in "".join(banner)
        address = read_node_file(state)["address"]
        token = subprocess.run(goblin + ["enroll", "--name", "alice", "--out", str(tmp_path / "alice.credential")],
                               env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert token == str(tmp_path / "alice.credential")
        volunteer = subprocess.Popen(goblin + ["volunteer", address, "--token", token, "--host", "127.0.0.1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        with Client(address, timeout=60, security=admin_credential(state).security()) as client:
            def names():
                return sorted(w["name"] for w in client.scheduler_info(n_workers=-1)["workers"].values())

            wait_for(lambda: names() == sorted(["alice", LAB_WORKER_NAME]), "alice and the node's lab worker to join")
            # the node's own lab worker holds the data and checks alice's products
            rng = np.random.default_rng(5)
            a, b = rng.standard_normal((600, 500)), rng.standard_normal((500, 400))
            with dask.config.set({"goblin.product.volunteer-memory": 2_000_000}):
                c = ga.from_array(a, chunks=200) @ ga.from_array(b, chunks=200)
            np.testing.assert_allclose(c.compute(), a @ b, rtol=1e-10, atol=1e-10)
            report = client.sync(getattr(client.scheduler, rpc.REPORT))
            assert report["volunteers"]["alice"]["accepted"] > 0, report
            out = subprocess.run(goblin + ["revoke", "alice"], env=env, capture_output=True, text=True, check=True)
            assert "disconnected 1" in out.stdout
            wait_for(lambda: names() == [LAB_WORKER_NAME], "alice to be disconnected")
            # the node starts its lab worker again when it dies
            (lab_address,) = client.scheduler_info(n_workers=-1)["workers"]
            os.kill(client.run(os.getpid, workers=[lab_address])[lab_address], signal.SIGKILL)
            wait_for(lambda: list(client.scheduler_info(n_workers=-1)["workers"]) not in ([], [lab_address])
                     and names() == [LAB_WORKER_NAME], "the lab worker to be started again")
        assert volunteer.wait(60) is not None
    finally:
        for p in (node, volunteer):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
