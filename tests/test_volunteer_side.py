"""The volunteer's side, with real processes on 127.0.0.1: pause and resume through the volunteer's control
page (``goblin volunteer pause|resume|status``), and credit (flops of accepted results, computed by the lab,
kept in the node's state directory across restarts).

The tests of this module run in order on one grid; the last one restarts its lab node.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from goblin_dask.node.local import LabNode
from goblin_dask.ops import get
from goblin_dask.volunteer import CONTROL_FILE, TOKEN_FILE
from tests.conftest import blocked_product_graph, read_log, wait_for

BLOCK = 48
#: the work of one block product of the tests' graphs, by the catalog's cost model
FLOPS = get("matmul").cost_of(np.zeros((BLOCK, BLOCK)), np.zeros((BLOCK, BLOCK))).flops
#: products run until a volunteer that should get work got some (each run gives every running volunteer work)
MAX_ROUNDS = 8


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """A lab node with two honest volunteers, each with its own state directory."""
    root = tmp_path_factory.mktemp("volunteer-side")
    node = LabNode.local(volunteers=0, dashboard=False, state_dir=root / "lab")
    try:
        vols = {}
        for label in ("alice", "bob"):
            credential = node.enroll()
            name = node.add_volunteer(credential, extra_args=("--state-dir", str(root / label)))
            vols[label] = {"name": name, "credential": credential, "dir": root / label}
        yield node, vols, root
    finally:
        node.close()


def _goblin_volunteer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "goblin_dask.cli", "volunteer", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def _product(node, seed: int, n_blocks: int = 4) -> None:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((n_blocks * BLOCK, n_blocks * BLOCK)), rng.standard_normal((n_blocks * BLOCK, BLOCK))
    dsk, keys, blocks = blocked_product_graph(a, b, BLOCK)
    results = node.client.get(dsk, keys)
    for key, r in zip(keys, results):
        i, j, k = key[1:]
        want = a[i * BLOCK:(i + 1) * BLOCK, k * BLOCK:(k + 1) * BLOCK] @ b[k * BLOCK:(k + 1) * BLOCK, :]
        np.testing.assert_allclose(r, want, rtol=1e-12, atol=1e-12)


def _volunteers(node) -> dict:
    return node.report()["volunteers"]


def _status(node, address: str) -> str:
    return node.client.scheduler_info(n_workers=-1)["workers"][address]["status"]


def _page(vdir, path: str, method: str = "GET", token: str | None = None, host: str | None = None):
    url = json.loads((vdir / CONTROL_FILE).read_text())["url"]
    token = (vdir / TOKEN_FILE).read_text().strip() if token is None else token
    req = urllib.request.Request(url + path, method=method, headers={"Authorization": f"Bearer {token}"})
    if host is not None:
        req.add_header("Host", host)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_pause_stops_new_tasks_reaching_the_volunteer_and_resume_restores_them(grid):
    node, vols, _ = grid
    alice, bob = vols["alice"], vols["bob"]
    address = node.volunteer_addresses()[alice["name"]]

    out = _goblin_volunteer("pause", "--state-dir", str(alice["dir"]))
    assert out.returncode == 0, out.stderr
    assert f"{alice['name']}: paused" in out.stdout
    wait_for(lambda: _status(node, address) == "paused", "the scheduler to see alice paused")

    before = _volunteers(node)
    for seed in range(3):
        _product(node, seed)
    after = _volunteers(node)
    assert after[alice["name"]]["accepted"] == before.get(alice["name"], {}).get("accepted", 0)
    assert after[bob["name"]]["accepted"] >= before.get(bob["name"], {}).get("accepted", 0) + 3 * 16
    assert json.loads(_page(alice["dir"], "/api/status")[1])["state"] == "paused"

    out = _goblin_volunteer("resume", "--state-dir", str(alice["dir"]))
    assert out.returncode == 0 and f"{alice['name']}: computing" in out.stdout, (out.stdout, out.stderr)
    wait_for(lambda: _status(node, address) == "running", "the scheduler to see alice running again")
    for seed in range(10, 10 + MAX_ROUNDS):
        _product(node, seed)
        if _volunteers(node)[alice["name"]]["accepted"] > after[alice["name"]]["accepted"]:
            break
    else:
        pytest.fail(f"alice got no work after resuming: {_volunteers(node)}")


def test_the_control_page_listens_on_loopback_only_and_wants_the_token(grid):
    node, vols, _ = grid
    vdir = vols["bob"]["dir"]
    assert stat.S_IMODE(vdir.stat().st_mode) == 0o700
    for f in (CONTROL_FILE, TOKEN_FILE):
        assert stat.S_IMODE((vdir / f).stat().st_mode) == 0o600
    assert json.loads((vdir / CONTROL_FILE).read_text())["url"].startswith("http://127.0.0.1:")
    assert _page(vdir, "/api/status")[0] == 200
    assert _page(vdir, "/api/status", token="")[0] == 403
    assert _page(vdir, "/api/pause", method="POST", token="not-the-token")[0] == 403
    assert _page(vdir, "/api/status", host="evil.example")[0] == 403  # a rebound DNS name
    assert json.loads(_page(vdir, "/api/status")[1])["state"] == "computing"  # the refused pause did nothing
    status, body = _page(vdir, "/")
    assert status == 200 and vols["bob"]["name"].encode() in body and b"credit" in body


def test_credit_is_the_flops_of_accepted_results_and_the_volunteer_learns_it(grid):
    node, vols, _ = grid
    _product(node, 30)
    report = node.report()
    for v in vols.values():
        record = report["volunteers"][v["name"]]
        assert record["accepted"] > 0 and record["credit"] == record["accepted"] * FLOPS, record
    assert report["credit"] == sum(r["credit"] for r in report["volunteers"].values())
    bob = vols["bob"]
    want = report["volunteers"][bob["name"]]["credit"]
    wait_for(lambda: json.loads(_page(bob["dir"], "/api/status")[1])["credit_flops"] == want,
             "bob's status page to show the credit the lab computed")
    out = _goblin_volunteer("status", "--state-dir", str(bob["dir"]))
    assert out.returncode == 0 and "credit" in out.stdout and f"verified {report['volunteers'][bob['name']]['accepted']}" in out.stdout
    wait_for(lambda: "credit" in read_log(node._log_path(bob["name"])), "bob's status line")


def test_a_rejected_result_adds_no_credit(grid):
    node, vols, _ = grid
    cheater = node.add_volunteer(module="tests.cheaters", extra_args=("--cheat", "element", "--honest-first", "2"))
    for seed in range(40, 40 + MAX_ROUNDS):
        _product(node, seed)
        record = _volunteers(node)[cheater]
        if record["banned"]:
            break
    else:
        pytest.fail(f"the cheater was not banned: {_volunteers(node)}")
    assert record["rejected"] >= 1 and record["credit"] == record["accepted"] * FLOPS, record
    for v in vols.values():  # honest volunteers: every accepted result, nothing else
        honest = _volunteers(node)[v["name"]]
        assert honest["rejected"] == 0 and honest["credit"] == honest["accepted"] * FLOPS


def test_pausing_mid_computation_gives_queued_tasks_back_and_the_computation_completes(grid):
    """Tasks given to the volunteer but not started go back to the lab, which places them elsewhere."""
    node, vols, _ = grid
    alice = vols["alice"]
    address = node.volunteer_addresses()[alice["name"]]
    rng = np.random.default_rng(70)
    a, b = rng.standard_normal((8 * BLOCK, 8 * BLOCK)), rng.standard_normal((8 * BLOCK, 8 * BLOCK))
    dsk, keys, _ = blocked_product_graph(a, b, BLOCK)
    futures = node.client.get(dsk, keys, sync=False)
    wait_for(lambda: node.client.processing().get(address), "alice to be given tasks", interval=0.01)
    out = _goblin_volunteer("pause", "--state-dir", str(alice["dir"]))
    assert out.returncode == 0, out.stderr
    results = node.client.gather(futures)
    for key, r in zip(keys, results):
        i, j, k = key[1:]
        want = a[i * BLOCK:(i + 1) * BLOCK, k * BLOCK:(k + 1) * BLOCK] @ b[k * BLOCK:(k + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
        np.testing.assert_allclose(r, want, rtol=1e-12, atol=1e-12)
    assert not node.client.processing().get(address)
    paused_at = _volunteers(node)[alice["name"]]["accepted"]
    _product(node, 71)
    assert _volunteers(node)[alice["name"]]["accepted"] == paused_at
    assert _goblin_volunteer("resume", "--state-dir", str(alice["dir"])).returncode == 0
    wait_for(lambda: _status(node, address) == "running", "alice running again")


def test_only_when_idle_pauses_while_the_machine_is_busy_and_your_resume_does_not_override_it(grid):
    node, vols, root = grid
    vdir = root / "idle"
    # a threshold of 0 %: whatever the other processes use is "busy", so it pauses at its first look
    name = node.add_volunteer(extra_args=("--state-dir", str(vdir), "--only-when-idle", "--idle-threshold", "0"))
    address = node.volunteer_addresses()[name]
    wait_for(lambda: _status(node, address) == "paused", "the idle-only volunteer to pause itself")
    state = json.loads(_page(vdir, "/api/status")[1])["state"]
    assert state == "paused (the machine is busy)", state
    out = _goblin_volunteer("resume", "--state-dir", str(vdir))
    assert out.returncode == 0 and f"{name}: paused (the machine is busy)" in out.stdout, out.stdout
    accepted = _volunteers(node).get(name, {}).get("accepted", 0)
    _product(node, 80)
    assert _status(node, address) == "paused" and _volunteers(node).get(name, {}).get("accepted", 0) == accepted
    node.processes[name].terminate()  # (SIGTERM: it closes as on Ctrl-C)
    assert node.processes[name].wait(60) == 0
    assert not (vdir / CONTROL_FILE).exists() and not (vdir / TOKEN_FILE).exists()  # nothing left behind


def test_credit_survives_a_restart_of_the_lab_node(grid):
    node, vols, root = grid
    before = {n: r["credit"] for n, r in _volunteers(node).items()}
    assert before[vols["alice"]["name"]] > 0
    node.close()
    kept = json.loads((root / "lab" / "credit.json").read_text())["credit"]
    assert kept == {n: c for n, c in before.items() if c}
    with LabNode.local(volunteers=0, dashboard=False, state_dir=root / "lab") as again:
        assert {n: r["credit"] for n, r in again.report()["volunteers"].items()} == {n: c for n, c in before.items() if c}
        alice = vols["alice"]
        again.add_volunteer(alice["credential"], extra_args=("--state-dir", str(alice["dir"])))
        _product(again, 60)
        record = again.report()["volunteers"][alice["name"]]
        assert record["credit"] == before[alice["name"]] + record["accepted"] * FLOPS  # accepted: since the restart


def test_a_task_that_reaches_a_volunteer_after_its_pause_goes_back_and_the_computation_completes(tmp_path):
    """The scheduler may send a task while the volunteer's pause (worker-status-change) is still on the wire:
    the task reached the paused volunteer after it had handed back what it held, and a paused worker never
    starts it, so the computation waited for the lab's deadline and the honest volunteer was marked late
    (a hang of test_pausing_mid_computation_gives_queued_tasks_back_and_the_computation_completes under load,
    most often with goblin.placement.max-held-per-volunteer on: it sends tasks as slots free, all along).
    Now a task that reaches a paused volunteer goes back at once, like those it held at the pause."""
    import dask

    from tests.pausing import MARK

    # the deadline is what ended the wait before: short enough that the old code marks the volunteer late
    with dask.config.set({"goblin.verification.deadline": 30.0}), \
            LabNode.local(volunteers=1, dashboard=False, state_dir=tmp_path / "lab") as node:
        pausing = node.add_volunteer(module="tests.pausing")
        address = node.volunteer_addresses()[pausing]
        for seed in range(90, 90 + MAX_ROUNDS):
            _product(node, seed, n_blocks=6)
            if MARK in read_log(node._log_path(pausing)):
                break
        else:
            pytest.fail(f"the pausing volunteer was given no task: {_volunteers(node)}")
        wait_for(lambda: _status(node, address) == "paused", "the scheduler to see the volunteer paused")
        _product(node, 99, n_blocks=6)  # (the old code: each waited for the deadline)
        assert not node.client.processing().get(address)  # it holds nothing
        record = _volunteers(node).get(pausing, {})
        assert record.get("late", 0) == 0 and record.get("rejected", 0) == 0, record
        assert not record.get("banned"), record
