"""Admission and authorization on an in-process lab node (``tests.inprocess``): who joins, as what, calling what.

Every peer below presents a real certificate of the lab's CA over mutual TLS, and workers
their signed tokens; ``test_grid`` and ``test_access_tls`` check the same with real processes.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import pytest
from distributed.core import rpc as connect_rpc

from goblin_dask.credentials import LabKeys
from goblin_dask.node import rpc
from goblin_dask.roles import LAB_RESOURCE, LAB_SLOTS, VOLUNTEER_RESOURCE
from goblin_dask.tls import LabCA
from scheduler_plugins.admission import REFUSALS_KEPT
from tests.inprocess import run_lab, volunteer_worker


def _as(lab, role: str, name: str):
    """A bare connection to the scheduler presenting ``role``/``name``'s certificate."""
    security = LabCA(lab.state_dir).issue(role, name).security()
    return connect_rpc(lab.scheduler.address, connection_args=security.get_connection_args("client"))


# -- joining ------------------------------------------------------------------------------


def test_roles_and_resources_come_from_the_credential_not_from_the_worker(tmp_path):
    async def body(lab):
        greedy = await lab.start_worker(lab.credential("volunteer", "greedy"), cls=volunteer_worker(), nthreads=2,
                                        resources={LAB_RESOURCE: LAB_SLOTS, VOLUNTEER_RESOURCE: 2})
        ws = lab.scheduler.workers[greedy.address]
        assert ws.resources == {VOLUNTEER_RESOURCE: 2.0} and ws.name == "greedy"  # no lab slots for it
        lab_ws = lab.scheduler.workers[lab.address_of("lab-worker")]
        assert lab_ws.resources == {LAB_RESOURCE: LAB_SLOTS}
        assert lab.admission.roles == {greedy.address: "volunteer", lab.address_of("alice"): "volunteer",
                                       lab_ws.address: "lab"}
        assert sorted(lab.admission.volunteers()) == sorted([greedy.address, lab.address_of("alice")])
        assert lab.admission.lab_workers() == [lab_ws.address]
        async with lab.client("admin", "root") as admin:
            workers = await getattr(admin.scheduler, rpc.WORKERS)()
        assert workers[greedy.address] == {"role": "volunteer", "name": "greedy"}
        assert workers[lab_ws.address] == {"role": "lab", "name": "lab-worker"}
        async with lab.client() as client:  # a researcher's function still runs on the lab worker only
            assert await client.submit(sum, [1, 2, 3]) == 6
        assert lab.recorder.workers_of(next(k for k, _ in lab.recorder.finished if str(k).startswith("sum")))\
            == [lab_ws.address]

    run_lab(tmp_path, body, volunteers=("alice",))


@pytest.mark.parametrize("case, reason", [
    ("forged", "not signed by this lab node"),
    ("another name", "does not match its token"),
    ("another role", "does not match its token"),
    ("no token", "malformed credential"),
    ("revoked", "was revoked"),
    ("connected twice", "is already connected"),
])
def test_a_worker_with_a_bad_credential_is_refused_with_the_reason(tmp_path, case, reason):
    async def body(lab):
        ca, keys = LabCA(lab.state_dir), LabKeys(lab.state_dir)
        good = lab.credentials["alice"]
        credential = {
            "forged": dataclasses.replace(good, token=good.token[:-4] + "0000"),
            "another name": ca.issue("volunteer", "mallory", token=good.token),  # alice's token, mallory's certificate
            "another role": ca.issue("volunteer", "alice", token=keys.issue("lab", "alice")),  # a lab token, stolen
            "no token": dataclasses.replace(good, token=""),
            "connected twice": good,
        }.get(case)
        if case == "revoked":
            credential = lab.credential("volunteer", "eve")
            keys.revoke("eve")
        before = set(lab.scheduler.workers)
        with pytest.raises(ValueError, match="goblin lab node refused this worker"):
            await lab.start_worker(credential, cls=volunteer_worker(), resources={VOLUNTEER_RESOURCE: 1})
        assert set(lab.scheduler.workers) == before
        refusal = lab.admission.refusals[-1]
        assert reason in refusal["reason"], refusal
        assert {"kind": "refused", **refusal} in lab.ledger.report()["refusals"]

    run_lab(tmp_path, body, volunteers=("alice",))


@pytest.mark.parametrize("claims, reason", [
    ({"nthreads": 100_000}, "task threads"),
    ({"memory_limit": 1024}, "memory limit"),
])
def test_a_volunteer_claiming_threads_or_memory_no_machine_has_is_refused(tmp_path, claims, reason):
    """The lab sizes every product's tiles from the volunteers' claims: a million threads or a few bytes
    of memory from one of them would cut every product into its smallest tiles.  Refused at joining, with
    the reason; the products are still sized from the honest volunteer."""
    from goblin_dask.array.linalg import product_blocks

    async def body(lab):
        before = set(lab.scheduler.workers)
        with pytest.raises(ValueError, match="goblin lab node refused this worker"):
            await lab.start_worker(lab.credential("volunteer", "liar"), cls=volunteer_worker(),
                                   resources={VOLUNTEER_RESOURCE: 1}, **claims)
        assert set(lab.scheduler.workers) == before
        assert reason in lab.admission.refusals[-1]["reason"]
        honest = [ws for ws in lab.scheduler.workers.values() if ws.name == "alice"]
        assert honest and honest[0].memory_limit >= 64 * 2**20 and honest[0].nthreads == 1
        assert product_blocks(4096, 4096, 4096, 8, honest[0].memory_limit / 4, 1)[0] > 64  # not the smallest tiles

    run_lab(tmp_path, body, volunteers=("alice",))


@pytest.mark.parametrize("nthreads, memory_limit", [
    (0, None), (-3, None), (True, None), ("4", None), (4.0, None), (257, None), (None, None),
    (1, 1), (1, -2**40), (1, float("nan")), (1, float("inf")), (1, "8GB"), (1, True), (1, [2**30]),
])
def test_what_a_registering_volunteer_may_claim(nthreads, memory_limit):
    """What a hostile volunteer can put in its ``register-worker`` message (any msgpack value), refused."""
    from goblin_dask.credentials import CredentialError
    from scheduler_plugins.admission import _check_volunteer_claims

    with pytest.raises(CredentialError, match="it claims"):
        _check_volunteer_claims(nthreads, memory_limit)


def test_what_an_honest_volunteer_claims_passes():
    from scheduler_plugins.admission import VOLUNTEER_MAX_THREADS, _check_volunteer_claims

    for nthreads, memory_limit in ((1, None), (1, 0), (VOLUNTEER_MAX_THREADS, 2**36), (8, 2**31), (1, 256 * 2**20),
                                   (2, 1.5e9)):
        _check_volunteer_claims(nthreads, memory_limit)


@pytest.mark.parametrize("nthreads, memory_limit", [(256, 64 * 2**20), (8, 2**31 - 1), (1, 256 * 2**20 - 1)])
def test_a_claim_of_less_memory_per_thread_than_the_setting_is_refused_naming_it(nthreads, memory_limit):
    """Issue 29: 256 threads in 64 MiB cut every product into tiles the lab computed itself."""
    import dask

    from goblin_dask.credentials import CredentialError
    from scheduler_plugins.admission import _check_volunteer_claims

    with pytest.raises(CredentialError, match="goblin.admission.min-memory-per-thread is 268435456 .*--nthreads"):
        _check_volunteer_claims(nthreads, memory_limit)
    with dask.config.set({"goblin.admission.min-memory-per-thread": "128KiB"}):  # a lab that allows less
        _check_volunteer_claims(nthreads, memory_limit)


def test_an_honest_volunteers_register_worker_is_far_below_the_limits(tmp_path, monkeypatch):
    """Issue 29: the limits on what a joining volunteer's ``register-worker`` carries must pass the real agent with
    margin.  Its message, as its worker class sends it (distributed's versions and metrics, its credential as
    startup information), measured field by field by the check itself: each at most a tenth of its limit."""
    from scheduler_plugins import admission

    measured: list[dict] = []
    check = admission._check_volunteer_hello
    monkeypatch.setattr(admission, "_check_volunteer_hello", lambda fields: measured.append(check(fields)) or
                        measured[-1])

    async def body(lab):
        await lab.start_worker(lab.credential("volunteer", "bob"), cls=volunteer_worker(), nthreads=4,
                               resources={VOLUNTEER_RESOURCE: 4})
        assert sorted(ws.name for ws in lab.scheduler.workers.values()) == ["alice", "bob", "lab-worker"]

    run_lab(tmp_path, body, volunteers=("alice",))
    assert len(measured) == 2  # alice and bob; the lab worker is not measured
    for sizes in measured:
        assert {"versions", "metrics", "extra", "name", "address", "server_id", "local_directory"} <= set(sizes)
        for field, (entries, text) in sizes.items():
            most_entries, most_text = admission.hello_limits(field)
            assert entries * 10 <= most_entries and text * 10 <= most_text, (field, entries, text)
    versions = measured[0]["versions"]
    assert 10 <= versions[0] <= 64 and 100 <= versions[1] <= 2048  # about 20 entries, a few hundred bytes


def _honest_hello() -> dict:
    from distributed.versions import get_versions

    return {"address": "nat://alice:1", "name": "alice", "server_id": "Worker-0123", "versions": get_versions(),
            "metrics": {"task_counts": {}, "cpu": 1.0, "memory": 2**30}, "extra": {"goblin": {"credential": "x" * 900}},
            "local_directory": "/tmp/dask-scratch-space/worker-abc", "status": "running", "pid": 7}


@pytest.mark.parametrize("field, value, reason", [
    ("versions", {"host": {}, "packages": {f"p{i}": "1.0" for i in range(300)}}, "'versions' is larger"),
    ("versions", {"host": {}, "packages": {"numpy": "1" * 9000}}, "'versions' is larger"),
    ("versions", [["numpy", "2.0"]], "is not distributed's"),
    ("versions", {"packages": ["numpy"]}, "is not distributed's"),
    ("versions", {"packages": {1: "2.0", "numpy": "2.0"}}, "names package '1'"),
    ("versions", {"packages": {"numpy": 2}}, "with version '2'"),
    ("extra", {"goblin": {"credential": "x" * 70_000}}, "startup information ('extra') is larger"),
    ("extra", [[]] * 9000, "startup information ('extra') is larger"),
    ("extra", ["goblin"], "is not a mapping"),
    ("metrics", {"digests": list(range(5000))}, "'metrics' is larger"),
    ("name", "a" * 5000, "'name' is larger"),
    ("server_id", "s" * 5000, "'server_id' is larger"),
    ("address", "nat://" + "a" * 5000, "'address' is larger"),
    ("services", {f"s{i}": i for i in range(20)}, "'services' is larger"),
    ("anything-else", [0] * 100, "'anything-else' is larger"),
])
def test_a_register_worker_carrying_more_than_a_volunteer_sends_is_refused_naming_the_field(field, value, reason):
    """What a hostile volunteer can put in its ``register-worker`` (any msgpack value): refused, naming the field,
    before distributed reads it (its version comparison sorts every worker's package names together)."""
    from goblin_dask.credentials import CredentialError
    from scheduler_plugins.admission import _check_volunteer_hello

    _check_volunteer_hello(_honest_hello())
    with pytest.raises(CredentialError, match=re.escape(reason)):
        _check_volunteer_hello({**_honest_hello(), field: value})


def test_the_size_of_a_huge_value_is_not_walked_past_the_limit():
    """What the limits count (entries; bytes of text, a number counts 8), and where the walk stops: a container
    with more entries than are left is refused before any of them is visited, so refusing 16 MiB of versions
    costs what the limit costs, not what the value costs."""
    from scheduler_plugins.admission import measure

    assert measure({"a": ["bc", 1.5, None], "d": {}}, 10, 100) == (5, 1 + 2 + 8 + 8 + 1)
    huge = {f"goblin-test-package-{i:012d}": f"{i:024d}" for i in range(250_000)}
    assert measure(huge, 256, 8192) is None
    assert measure(["x" * 100] * 1000, 10_000, 8192) is None
    assert measure([[[]]] * 200, 256, 8192) is None  # 400 empty lists: no text, but entries
    assert measure({"x" * 9000: 1}, 10, 8192) is None


def test_a_heartbeat_carrying_more_metrics_than_a_volunteer_sends_is_refused(tmp_path):
    """A volunteer's heartbeats carry the same ``metrics`` as its register-worker, every half second: beyond their
    limit a heartbeat is refused and recorded, and the scheduler keeps the metrics it had."""
    from scheduler_plugins.admission import VOLUNTEER_HELLO_LIMITS

    async def body(lab):
        bob = await lab.start_worker(lab.credential("volunteer", "bob"), cls=volunteer_worker(),
                                     resources={VOLUNTEER_RESOURCE: 1})
        ws = lab.scheduler.workers[bob.address]
        honest = dict(ws.metrics)
        huge = {**honest, "digests": {f"d{i}": float(i) for i in range(VOLUNTEER_HELLO_LIMITS["metrics"][0] + 1)}}
        async with connect_rpc(lab.scheduler.address,
                               connection_args=lab.credentials["bob"].security().get_connection_args("worker")) as r:
            with pytest.raises(PermissionError, match="its heartbeat's 'metrics' is larger"):
                await r.heartbeat_worker(address=bob.address, now=time.time(), metrics=huge, executing={},
                                         extensions={})
            honest_beat = await r.heartbeat_worker(address=bob.address, now=time.time(), metrics=honest,
                                                   executing={}, extensions={})
            assert honest_beat["status"] == "OK"
        assert "its heartbeat's 'metrics' is larger" in lab.admission.refusals[-1]["reason"]
        assert "digests" not in ws.metrics or len(ws.metrics["digests"]) <= len(honest.get("digests", {}))
        assert bob.address in lab.scheduler.workers and not lab.admission.banned

    run_lab(tmp_path, body, volunteers=("alice",))


def test_a_volunteer_that_left_may_come_back_but_a_banned_one_may_not(tmp_path):
    async def body(lab):
        alice, bob = lab.credentials["alice"], lab.credentials["bob"]
        await lab.workers["alice"].close()
        await lab.wait_for(lambda: "alice" not in lab.connected())
        assert lab.admission.roles.get(lab.workers["alice"].address) is None  # forgotten when it left
        await lab.add_volunteer("alice", credential=alice)
        assert "alice" in lab.connected()
        closed = lab.admission.ban("bob", "tested")
        assert closed == [lab.address_of("bob")]
        await lab.wait_for(lambda: "bob" not in lab.connected())
        with pytest.raises(ValueError, match="revoked"):
            await lab.add_volunteer("bob", credential=bob)
        keys = LabKeys(lab.state_dir)
        with pytest.raises(PermissionError, match="revoked"):  # nobody enrolls under a banned name again
            keys.issue("volunteer", "bob")
        assert lab.admission.banned == {"bob"}

    run_lab(tmp_path, body)


def test_a_ban_is_recorded_once_with_its_first_reason(tmp_path):
    async def body(lab):
        lab.admission.ban("alice", "first reason")
        lab.admission.ban("alice", "second reason")
        await lab.wait_for(lambda: "alice" not in lab.connected())
        bans = lab.ledger.report()["bans"]
        assert [(b["name"], b["reason"]) for b in bans] == [("alice", "first reason")]
        assert lab.ledger.report()["volunteers"]["alice"]["banned"]

    run_lab(tmp_path, body)


def test_refusals_kept_for_the_report_are_bounded(tmp_path):
    async def body(lab):
        for i in range(REFUSALS_KEPT + 25):
            lab.admission.refuse_volunteer(f"v{i}", f"reason {i}", ban=False)
        refusals = lab.admission.refusals
        assert len(refusals) == REFUSALS_KEPT
        assert refusals[0] == {"address": "v25", "reason": "reason 25"}  # the oldest went first
        assert lab.admission.bans == [] and lab.admission.banned == set()
        lab.admission.refuse_volunteer("alice", "sent a pickled function")  # ban=True by default
        await lab.wait_for(lambda: "alice" not in lab.connected())
        assert lab.admission.bans[0]["reason"] == "sent a pickled function"

    run_lab(tmp_path, body)


# -- handlers --------------------------------------------------------------------------------


def test_a_volunteer_may_call_only_the_volunteer_handlers(tmp_path):
    async def body(lab):
        async with _as(lab, "volunteer", "alice") as r:
            assert (await r.identity())["type"] == "Scheduler"
            for op in ("gather", rpc.REPORT, rpc.REVOKE, "register-client", "terminate"):
                with pytest.raises(PermissionError, match=f"'{op}' is not allowed for volunteer alice"):
                    await getattr(r, op)()
        assert "alice" in lab.connected() and lab.scheduler.status.name == "running"

    run_lab(tmp_path, body, volunteers=("alice",))


def test_a_researcher_may_call_its_allow_list_only(tmp_path):
    async def body(lab):
        async with lab.client() as client:
            assert (await getattr(client.scheduler, rpc.REPORT)())["tasks"] == 0
            assert await client.submit(max, [4, 2]) == 4
            for op in (rpc.REVOKE, rpc.BAN, rpc.WORKERS, rpc.POLICY, "register-worker", "heartbeat_worker",
                       "retire_workers", "terminate", "set_resources"):
                with pytest.raises(PermissionError, match=f"'{op}' is not allowed for researcher ada"):
                    await getattr(client.scheduler, op)()
        assert lab.connected() == {"lab-worker", "alice", "bob"} and lab.admission.bans == []

    run_lab(tmp_path, body)


def test_only_client_roles_open_a_client_session(tmp_path):
    async def body(lab):
        async with _as(lab, "volunteer", "alice") as r:
            with pytest.raises(PermissionError, match="'register-client' is not allowed"):
                await getattr(r, "register-client")(client="c-1", versions={})
        async with _as(lab, "researcher", "ada") as r:
            assert (await r.identity())["type"] == "Scheduler"

    run_lab(tmp_path, body, volunteers=())


def test_a_volunteer_heartbeating_for_another_worker_is_banned(tmp_path):
    async def body(lab):
        bob = lab.address_of("bob")
        async with _as(lab, "volunteer", "alice") as r:
            with pytest.raises(PermissionError, match="sent a heartbeat for another worker"):
                await r.heartbeat_worker(address=bob, now=time.time(), metrics={})
        await lab.wait_for(lambda: "alice" not in lab.connected())
        bans = lab.admission.bans
        assert [b["name"] for b in bans] == ["alice"] and f"(bob at {bob})" in bans[0]["reason"]
        assert "bob" in lab.connected()

    run_lab(tmp_path, body)


def test_nobody_sets_worker_resources_not_even_the_admin(tmp_path):
    async def body(lab):
        alice = lab.address_of("alice")
        async with lab.client("admin", "root") as admin:
            with pytest.raises(PermissionError, match="set by role at admission"):
                await admin.scheduler.set_resources(resources={LAB_RESOURCE: 1}, worker=alice)
        assert lab.scheduler.workers[alice].resources == {VOLUNTEER_RESOURCE: 1.0}

    run_lab(tmp_path, body, volunteers=("alice",))


def test_the_admin_revokes_and_bans_by_handler_and_the_report_says_why(tmp_path):
    async def body(lab):
        alice, bob = lab.address_of("alice"), lab.address_of("bob")
        async with lab.client("admin", "root") as admin:
            assert list((await getattr(admin.scheduler, rpc.REVOKE)(name="alice"))["closed"]) == [alice]
            banned = await getattr(admin.scheduler, rpc.BAN)(name="bob", reason="answered a fetch with garbage")
            assert list(banned["closed"]) == [bob]
            await lab.wait_for(lambda: lab.connected() == {"lab-worker"})
            report = await getattr(admin.scheduler, rpc.REPORT)()
        assert [(b["name"], b["reason"]) for b in report["bans"]] == [("alice", "revoked by the lab's admin"),
                                                                      ("bob", "answered a fetch with garbage")]
        assert "alice" not in lab.admission.banned  # revoked, not banned: it may be enrolled under another name
        assert LabKeys(lab.state_dir).revoked() == {"alice", "bob"}
        async with _as(lab, "lab", "lab-worker") as r:  # the lab's own processes ban too, with a default reason
            assert list((await getattr(r, rpc.BAN)(name="carol"))["closed"]) == []
        assert lab.admission.bans[-1] == {"name": "carol", "reason": "banned by lab lab-worker",
                                          "time": lab.admission.bans[-1]["time"]}

    run_lab(tmp_path, body)


def test_the_call_budget_passes_a_burst_refills_at_its_rate_and_counts_refusals():
    from scheduler_plugins.admission import CallBudget

    now = [100.0]
    budget = CallBudget(rate=10.0, burst=5, clock=lambda: now[0])
    assert [budget.spend("v1") for _ in range(7)] == [True] * 5 + [False] * 2
    assert budget.refused == {"v1": 2}
    assert budget.spend("v2")  # each volunteer its own bucket
    now[0] += 0.25  # 2.5 calls' worth
    assert [budget.spend("v1") for _ in range(3)] == [True, True, False]
    now[0] += 60.0  # never more than the burst, however long it waited
    assert sum(budget.spend("v1") for _ in range(10)) == 5
    assert budget.refused["v1"] == 8


def test_refusals_spread_over_weeks_do_not_add_up_to_a_flood_but_a_flood_does():
    """Before, every refusal in the node's lifetime counted toward the flood ban: an honest agent refused a few
    calls after each reconnection was banned after about 1000 of them, however many weeks apart.  Now the count
    decays (a factor e a minute): only refusals close together make a flood."""
    from scheduler_plugins.admission import VOLUNTEER_FLOOD_BAN, VOLUNTEER_FLOOD_MEMORY, CallBudget

    now = [0.0]
    budget = CallBudget(rate=10.0, burst=5, clock=lambda: now[0])
    for day in range(2 * VOLUNTEER_FLOOD_BAN // 10):  # ten refused calls, every hour
        assert sum(budget.spend("honest") for _ in range(15)) == 5
        now[0] += 3600.0
    assert budget.refused["honest"] == 2 * VOLUNTEER_FLOOD_BAN and budget.recent_refusals("honest") < 1.0
    flood = [budget.spend("flood") for _ in range(VOLUNTEER_FLOOD_BAN + 5)]
    assert flood.count(False) == VOLUNTEER_FLOOD_BAN and budget.recent_refusals("flood") >= VOLUNTEER_FLOOD_BAN
    now[0] += VOLUNTEER_FLOOD_MEMORY
    assert budget.recent_refusals("flood") == pytest.approx(VOLUNTEER_FLOOD_BAN / math.e)


def test_a_costly_call_leaves_the_budget_in_debt_until_it_is_paid_back():
    """Issue 29: calls are charged what they cost (:func:`call_cost`: keys named, their text), not one each."""
    from scheduler_plugins.admission import CallBudget, call_cost

    assert call_cost() == call_cost(["k"] * 0) == 1.0 and call_cost("not a list") == 1.0
    assert call_cost([f"{i:0100d}" for i in range(10_000)]) == pytest.approx(1 + 100 + 10_000 * 100 / 16384)
    assert call_cost([("x" * 100, 1, 2)] * 100) == pytest.approx(1 + 1 + 100 * 116 / 16384)
    now = [0.0]
    budget = CallBudget(rate=10.0, burst=5, clock=lambda: now[0])
    assert budget.spend("v", cost=12.0)  # one call's worth was there: it runs, 7 in debt
    assert not budget.spend("v") and not budget.spend("v", cost=0.5)  # nothing until the debt is paid back
    now[0] += 0.75  # 7.5 refilled: 0.5 left, under one call
    assert not budget.spend("v")
    now[0] += 0.05
    assert budget.spend("v") and budget.refused == {"v": 3}
