"""What the lab accepts from a volunteer: its worker stream, and its results (real processes, real TLS).

Each attack is a volunteer process of :mod:`tests.hostile` holding nothing but a volunteer
credential.  On a plain dask scheduler each of them works (the researcher reads the
volunteer's number, an honest volunteer is banned, the grid stalls); on a lab node the
forged message is refused, the attacker banned at once with the reason in
``report()["bans"]``, and the computation goes on with numpy's numbers.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

import goblin_dask.array as ga
from goblin_dask.node.local import LabNode
from tests.conftest import read_log, wait_for
from tests.hostile import FAKE

RNG = np.random.default_rng(14)


@pytest.fixture(scope="module")
def grid():
    """A lab node with two honest volunteers; each test adds its hostile one."""
    with LabNode.local(volunteers=2) as node:
        yield node


def _hostile(node, attack: str, tmp_path=None, **args) -> tuple[str, object]:
    trigger = tmp_path / f"go-{uuid.uuid4().hex}" if tmp_path is not None else None
    extra = ["--attack", attack]
    for k, v in args.items():
        extra += [f"--{k}", str(v)]
    if trigger is not None:
        extra += ["--trigger", str(trigger)]
    return node.add_volunteer(module="tests.hostile", extra_args=tuple(extra)), trigger


def _ban_of(node, name: str) -> dict | None:
    return next((b for b in node.report()["bans"] if b["name"] == name), None)


def _banned(node, name: str) -> dict:
    wait_for(lambda: _ban_of(node, name) is not None, f"{name} to be banned")
    wait_for(lambda: name not in node.volunteer_names(), f"{name} to be disconnected")
    return _ban_of(node, name)


def _product(node, n: int = 300, chunks: int = 150) -> None:
    a, b = RNG.standard_normal((n, n)), RNG.standard_normal((n, n))
    got = (ga.from_array(a, chunks=chunks) @ ga.from_array(b, chunks=chunks)).compute()
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)


def _honest_not_banned(node, honest: list[str]) -> None:
    report = node.report()
    banned = {b["name"] for b in report["bans"]}
    assert not banned & set(honest), report["bans"]
    for name in honest:
        assert not report["volunteers"].get(name, {}).get("banned"), report["volunteers"]
    assert set(honest) <= set(node.volunteer_names())


def _value(x: float) -> np.float64:
    return np.float64(x)


def test_honest_volunteers_are_never_refused(grid):
    honest = grid.volunteer_names()
    for n, chunks in ((300, 150), (400, 100)):
        _product(grid, n, chunks)
    x = ga.random.standard_normal((300, 300), chunks=150, seed=5)
    np.testing.assert_array_equal(x.compute(), x.compute(scheduler="sync"))
    report = grid.report()
    _honest_not_banned(grid, honest)
    assert not report["bans"] and not report["refusals"], report["refusals"]
    assert sum(report["volunteers"][n]["accepted"] for n in honest) > 0


def test_a_volunteer_cannot_take_over_a_key_of_the_lab(grid, tmp_path):
    honest = grid.volunteer_names()
    key = f"lab-number-{uuid.uuid4().hex}"
    fut = grid.client.submit(_value, 42.0, key=key)
    assert fut.result() == 42.0
    thief, trigger = _hostile(grid, "add-keys-steal", tmp_path, target=key, lab=grid.lab_worker_address())
    trigger.touch()
    ban = _banned(grid, thief)
    assert "add-keys" in ban["reason"], ban
    for _ in range(5):
        assert fut.result() == np.float64(42.0) and grid.client.gather(fut) == 42.0
    assert set(grid.client.who_has([fut])[key]) == {grid.lab_worker_address()}
    assert f"refused 'add-keys' from volunteer {thief}" in read_log(grid._log_path("scheduler"))
    _honest_not_banned(grid, honest)


def test_a_volunteer_cannot_claim_a_task_it_was_not_given(grid, tmp_path):
    honest = grid.volunteer_names()
    key = f"lab-number-{uuid.uuid4().hex}"
    fut = grid.client.submit(_value, 7.0, key=key)
    assert fut.result() == 7.0
    claimer, trigger = _hostile(grid, "foreign-task-finished", tmp_path, target=key)
    trigger.touch()
    ban = _banned(grid, claimer)
    assert "task-finished" in ban["reason"] and "not given" in ban["reason"], ban
    for _ in range(5):
        assert grid.client.gather(fut) == 7.0
    assert set(grid.client.who_has([fut])[key]) == {grid.lab_worker_address()}
    _honest_not_banned(grid, honest)


def test_verdicts_count_only_from_the_lab_workers_own_connection(grid, tmp_path):
    honest = grid.volunteer_names()
    victim = honest[0]
    key = f"lab-sleep-{uuid.uuid4().hex}"
    fut = grid.client.submit(time.sleep, 2.0, key=key)  # a task processing on the lab worker
    wait_for(lambda: grid.client.processing().get(grid.lab_worker_address()), "the lab task to run")
    forger, trigger = _hostile(grid, "forge-verdict", tmp_path, target=key, lab=grid.lab_worker_address(),
                               victim=grid.volunteer_addresses()[victim])
    trigger.touch()
    ban = _banned(grid, forger)
    assert "names another worker" in ban["reason"], ban
    fut.result()
    report = grid.report()
    assert report["volunteers"][victim]["rejected"] == 0, report["volunteers"]
    _honest_not_banned(grid, honest)
    _product(grid)  # the victim still computes and is credited


def test_a_volunteer_cannot_pause_the_lab_worker(grid, tmp_path):
    honest = grid.volunteer_names()
    pauser, trigger = _hostile(grid, "pause-lab-worker", tmp_path, lab=grid.lab_worker_address())
    trigger.touch()
    ban = _banned(grid, pauser)
    assert "worker-status-change" in ban["reason"], ban
    info = grid.client.scheduler_info(n_workers=-1)["workers"][grid.lab_worker_address()]
    assert info["status"] == "running", info
    _product(grid)  # the grid does not stall
    _honest_not_banned(grid, honest)


@pytest.mark.parametrize("attack", ["result-list", "result-shape", "result-dtype", "result-scalar"])
def test_a_result_of_the_wrong_form_is_rejected(grid, attack):
    honest = grid.volunteer_names()
    before = grid.report()
    liar, _ = _hostile(grid, attack)
    # products until the liar has been given some (it computes everything wrongly)
    for _ in range(10):
        _product(grid, 400, 100)  # numpy's numbers, whatever it returned
        if grid.report()["volunteers"].get(liar, {}).get("rejected", 0) >= 2:
            break
    ban = _banned(grid, liar)
    assert "rejected results" in ban["reason"] and "the result" in ban["reason"], ban
    report = grid.report()
    assert report["rejected"] > before["rejected"]
    reasons = [r["reason"] for r in report["rejections"] if r["volunteer"] == liar]
    assert reasons and all(r.startswith("the result") for r in reasons), reasons
    _honest_not_banned(grid, honest)


def test_a_flood_of_refresh_requests_is_charged_by_its_keys_and_dropped_over_the_budget(grid, tmp_path):
    """Issue 29: worker-stream messages that report on no task (``request-refresh-who-has`` with any number of
    keys, ``goblin-cached``, ``keep-alive``) were budgeted nowhere.  Now each costs one call plus one per 100
    keys (and per 16 KiB of their text) from the volunteer's call budget: of 40 messages of 2,000 keys of 100
    characters (33 calls each, a burst of 500) about 15 pass, the rest are dropped (each counted), without a
    ban (a flood, not yet a ban), and the grid computes on."""
    from tests.hostile import FLOOD_MESSAGES

    honest = grid.volunteer_names()
    flooder, trigger = _hostile(grid, "refresh-flood", tmp_path)
    trigger.touch()
    wait_for(lambda: grid.report()["over_budget"].get(flooder, 0) > 0, "the flood to be charged to its budget")
    report = grid.report()
    assert FLOOD_MESSAGES // 4 <= report["over_budget"][flooder] < FLOOD_MESSAGES, report["over_budget"]
    assert _ban_of(grid, flooder) is None
    _product(grid)
    _honest_not_banned(grid, honest)
    assert not any(report["over_budget"].get(name) for name in honest), report["over_budget"]


def test_an_honest_volunteer_that_stops_is_not_banned(grid):
    name = grid.add_volunteer()
    _product(grid)
    from goblin_dask.node.process import stop_process

    stop_process(grid.processes[name])  # SIGTERM: it closes as `goblin volunteer` does on Ctrl-C
    wait_for(lambda: name not in grid.volunteer_names(), f"{name} to leave")
    assert _ban_of(grid, name) is None and not grid.report()["volunteers"].get(name, {}).get("banned")


def test_ban_api_and_handler_roles(grid):
    name = grid.add_volunteer()
    closed = grid.client.sync(grid.client.scheduler.goblin_ban, name=name, reason="the admin said so")
    assert closed["closed"]
    ban = _banned(grid, name)
    assert ban["reason"] == "the admin said so" and ban["time"] > 0
    assert {"kind": "banned", "volunteer": name, "reason": "the admin said so"} in grid.report()["refusals"]
