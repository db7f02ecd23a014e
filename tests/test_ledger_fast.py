"""The verification ledger on an in-process lab node (``tests.inprocess``): verdicts, trust, replicas, bans, deadlines.

Real scheduler, real plugins, real lab worker and volunteer workers over mutual TLS, in this
process; the real-process grids (``test_verification_grid``, ``test_grid``) check the same
paths with separate processes.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from dask._task_spec import DataNode, Task, TaskRef

from goblin_dask.array.sources import lab_block
from goblin_dask.node import rpc
from goblin_dask.ops import CatalogTask, get
from goblin_dask.roles import VOLUNTEER_RESOURCE
from goblin_dask.validation.checks import is_unverified_key, unverified_key
from scheduler_plugins.verification import TrustPolicy
from tests.inprocess import (
    assemble,
    cheating_worker,
    compute_product,
    matrices,
    product_graph,
    random_graph,
    run_lab,
    stalling_worker,
)

BLOCK = 32


def _replica_keys(recorder, raw_keys) -> dict:
    """{block index: (worker of the result, worker of its replica)} from what the scheduler saw finish."""
    raw = {unverified_key(k) for k in raw_keys}
    firsts = {k[1:]: w for k, w in recorder.finished if k in raw}
    seconds = {k[1:]: w for k, w in recorder.finished if is_unverified_key(k) and k not in raw}
    return {i: (firsts.get(i), seconds.get(i)) for i in firsts}


# -- verdicts and trust -------------------------------------------------------------------


def test_verified_products_earn_each_volunteer_trust(tmp_path):
    async def body(lab):
        async with lab.client() as client:
            keys = await compute_product(client, *matrices(1), BLOCK)
        report = lab.ledger.report()
        computed = {lab.scheduler.workers[w].name for k, w in lab.recorder.finished if is_unverified_key(k)}
        assert report["by_method"] == {"freivalds": len(keys)} and report["accepted"] == len(keys)
        assert report["tasks"] == len(keys) and report["rejected"] == 0 and report["bans"] == []
        for name, record in report["volunteers"].items():
            assert record["trust"] == record["accepted"] and not record["banned"]
        assert computed <= set(report["volunteers"])
        assert sum(v["accepted"] for v in report["volunteers"].values()) == len(keys)
        assert report["seconds"]["check"] > 0 and report["overhead"] > 0

    run_lab(tmp_path, body)


def test_the_report_reaches_a_researcher_and_the_policy_only_the_lab_worker(tmp_path):
    async def body(lab):
        async with lab.client() as client:
            await compute_product(client, *matrices(2), BLOCK)
            report = await getattr(client.scheduler, rpc.REPORT)()
            assert report["accepted"] == 8 and set(report["volunteers"]) == {"alice", "bob"}
            with pytest.raises(PermissionError, match="not allowed for researcher ada"):
                await getattr(client.scheduler, rpc.POLICY)(key="unverified-x-00")
        async with lab.client("admin", "root") as admin:  # admins pass authorization, not the ledger's own check
            with pytest.raises(PermissionError, match="only the lab worker"):
                await getattr(admin.scheduler, rpc.POLICY)(key="unverified-x-00")

    run_lab(tmp_path, body)


def test_verdicts_count_only_from_the_lab_worker(tmp_path):
    async def body(lab):
        ledger, alice = lab.ledger, lab.address_of("alice")
        key = ("unverified-matmul-" + "ab" * 8, 0, 0, 0)
        ledger.transition(key, "processing", "memory", worker=alice)  # alice computed it
        ledger.on_verdicts(alice, verdicts=[[list(key), "freivalds", True]])  # she vouches for herself
        assert ledger.volunteers["alice"].accepted == 0 and ledger.by_method == {}
        ledger.on_verdicts(lab.address_of("lab-worker"), verdicts=[[list(key), "freivalds", True]], seconds=0.5)
        assert ledger.volunteers["alice"].accepted == 1 and ledger.volunteers["alice"].trust == 1
        assert ledger.check_seconds == 0.5

    run_lab(tmp_path, body)


def test_a_verdict_after_the_result_was_forgotten_still_finds_its_volunteer(tmp_path):
    async def body(lab):
        ledger, bob = lab.ledger, lab.address_of("bob")
        key = ("unverified-add-" + "cd" * 8, 3)
        ledger.transition(key, "processing", "memory", worker=bob)
        ledger.transition(key, "memory", "forgotten")
        assert key not in ledger.computed_by
        ledger.on_verdict(key, "replica", False, reason="disagrees with the lab")
        assert ledger.volunteers["bob"].rejected == 1
        last = ledger.rejections[-1]
        assert last["volunteer"] == "bob" and last["reason"] == "disagrees with the lab"
        assert key not in ledger._forgotten  # judged: nothing kept

    run_lab(tmp_path, body)


def test_trusted_results_earn_no_trust_and_a_rejection_resets_it(tmp_path):
    async def body(lab):
        ledger, alice = lab.ledger, lab.address_of("alice")
        keys = [("unverified-add-" + "ef" * 8, i) for i in range(6)]
        for key in keys:
            ledger.transition(key, "processing", "memory", worker=alice)
        for key in keys[:3]:
            ledger.on_verdict(key, "replica", True)
        ledger.on_verdict(keys[3], "trusted", True)  # accepted on trust: not verified
        record = ledger.volunteers["alice"]
        assert (record.accepted, record.trust) == (4, 3)
        ledger.on_verdict(keys[4], "sample", False)
        assert (record.accepted, record.rejected, record.trust, record.banned) == (4, 1, 0, False)
        assert "alice" in lab.connected()

    run_lab(tmp_path, body)


# -- bans -----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_rejections", [2, 3])
def test_a_volunteer_is_banned_at_max_rejections_and_refused_on_return(tmp_path, max_rejections):
    async def body(lab):
        ledger, alice = lab.ledger, lab.address_of("alice")
        assert ledger.max_rejections == max_rejections
        keys = [("unverified-add-" + "12" * 8, i) for i in range(max_rejections)]
        for key in keys:
            ledger.transition(key, "processing", "memory", worker=alice)
        for key in keys[:-1]:
            ledger.on_verdict(key, "replica", False)
        assert not ledger.volunteers["alice"].banned and "alice" in lab.connected()
        ledger.on_verdict(keys[-1], "replica", False, reason="the replicas disagree")
        await lab.wait_for(lambda: "alice" not in lab.connected())
        report = ledger.report()
        assert report["volunteers"]["alice"]["banned"] and not report["volunteers"]["bob"]["banned"]
        assert report["bans"] == [{"name": "alice", "time": report["bans"][0]["time"],
                                   "reason": f"{max_rejections} rejected results (last: the replicas disagree)"}]
        assert {"kind": "banned", "volunteer": "alice", "reason": report["bans"][0]["reason"]} in report["refusals"]
        assert "alice" in lab.admission.keys.revoked()
        with pytest.raises(ValueError, match="revoked"):  # her credential no longer admits her
            await lab.add_volunteer("alice", credential=lab.credentials["alice"])
        ledger.on_verdict(keys[0], "replica", False)  # a late verdict: no second ban
        assert len(ledger.report()["bans"]) == 1

    run_lab(tmp_path, body, config={"goblin.max-rejections": max_rejections})


def test_a_cheater_is_caught_by_freivalds_and_banned_while_the_answer_stays_right(tmp_path):
    async def body(lab):
        cheater = await lab.add_volunteer("mallory", cls=cheating_worker())
        async with lab.client() as client:
            for seed in range(6):  # each product gives every volunteer work, until mallory is caught twice
                await compute_product(client, *matrices(10 + seed), BLOCK)  # asserts every number
                if lab.ledger.volunteers["mallory"].banned:
                    break
        report = lab.ledger.report()
        mallory = report["volunteers"]["mallory"]
        assert mallory["banned"] and mallory["rejected"] >= 2 and mallory["trust"] == 0, report
        assert {r["method"] for r in report["rejections"]} == {"freivalds"}
        assert all(r["volunteer"] == "mallory" for r in report["rejections"])
        assert report["bans"][0]["name"] == "mallory" and "rejected results" in report["bans"][0]["reason"]
        await lab.wait_for(lambda: "mallory" not in lab.connected())
        assert cheater.status.name in ("closing", "closed")
        for honest in ("alice", "bob"):
            assert report["volunteers"][honest]["rejected"] == 0 and not report["volunteers"][honest]["banned"]
            assert honest in lab.connected()

    run_lab(tmp_path, body)


def test_a_cheater_that_was_honest_first_loses_its_trust_at_the_first_rejection(tmp_path):
    async def body(lab):
        cls = cheating_worker()
        cheater = await lab.add_volunteer("mallory", cls=cls)
        cheater.honest_first = 4
        async with lab.client() as client:
            for seed in range(8):
                await compute_product(client, *matrices(20 + seed), BLOCK)
                if lab.ledger.volunteers["mallory"].rejected:
                    break
        record = lab.ledger.volunteers["mallory"]
        assert record.accepted >= 4 and record.rejected >= 1 and record.trust == 0, record

    run_lab(tmp_path, body, volunteers=("bob",))


# -- replica policy ---------------------------------------------------------------------------


def test_random_blocks_are_replicated_on_another_volunteer_below_the_trust_threshold(tmp_path):
    async def body(lab):
        dsk, keys, expected = random_graph(6, seed=3)
        async with lab.client() as client:
            results = await client.gather(client.get(dsk, keys, sync=False))
        for got, want in zip(results, expected):
            np.testing.assert_array_equal(got, want)
        pairs = _replica_keys(lab.recorder, keys)
        assert len(pairs) == 6
        for first, second in pairs.values():  # every result replicated, each on the other volunteer
            assert first is not None and second is not None and first != second
        report = lab.ledger.report()
        # each pair replicated; the ones the lab drew for its audit say so (it recomputed them too)
        assert set(report["by_method"]) <= {"replica", "audit"} and sum(report["by_method"].values()) == 12, report
        assert report["accepted"] == 12
        assert lab.ledger.replicas == {}  # every replica judged
        assert report["seconds"]["replicas"] >= 0 and report["tasks"] == 12

    run_lab(tmp_path, body)


def test_a_replica_disagreement_is_decided_by_the_lab_against_the_cheater(tmp_path):
    async def body(lab):
        await lab.add_volunteer("mallory", cls=cheating_worker())
        async with lab.client() as client:
            for seed in range(6):
                dsk, keys, expected = random_graph(6, seed=40 + seed)
                results = await client.gather(client.get(dsk, keys, sync=False))
                for got, want in zip(results, expected):  # the lab's numbers, never the cheater's
                    np.testing.assert_array_equal(got, want)
                if lab.ledger.volunteers["mallory"].banned:
                    break
        report = lab.ledger.report()
        assert report["volunteers"]["mallory"]["banned"], report
        assert {r["method"] for r in report["rejections"]} == {"replica"}
        assert report["volunteers"]["bob"]["rejected"] == 0 and not report["volunteers"]["bob"]["banned"]

    run_lab(tmp_path, body, volunteers=("bob",))


def test_a_replica_computed_again_before_the_lab_released_it_blames_the_volunteer_whose_bytes_were_compared(
        tmp_path, monkeypatch):
    """Mallory's (wrong) replica is in the lab worker's hands when mallory is banned, and the replica, still
    wanted, is computed again by an honest volunteer, whom the scheduler then names as its computer: the
    disagreement is mallory's, never the honest one's (the lab worker notes whom it read the bytes from)."""
    import distributed
    from distributed.utils import sync

    raced = []
    release = distributed.Future.release

    async def body(lab):
        await lab.add_volunteer("mallory", cls=cheating_worker())

        def release_after_a_recomputation(future, *args, **kwargs):
            key = future.key
            if not raced and is_unverified_key(key) and lab.ledger._who(key) == "mallory":
                raced.append(key)

                async def recomputed_elsewhere():
                    lab.admission.ban("mallory", "tested: leaves while the lab holds its replica")
                    await lab.wait_for(lambda: lab.ledger._who(key) not in (None, "mallory"))

                sync(lab.scheduler.loop, recomputed_elsewhere)
            return release(future, *args, **kwargs)

        monkeypatch.setattr(distributed.Future, "release", release_after_a_recomputation)
        async with lab.client() as client:
            for seed in range(8):
                dsk, keys, expected = random_graph(6, seed=60 + seed)
                results = await client.gather(client.get(dsk, keys, sync=False))
                for got, want in zip(results, expected):
                    np.testing.assert_array_equal(got, want)
                if raced:
                    break
        report = lab.ledger.report()
        assert raced, "no replica of mallory's reached the lab worker"
        assert any(r["volunteer"] == "mallory" and r["key"] == repr(raced[0]) for r in report["rejections"]), report
        for name in ("alice", "bob"):
            assert report["volunteers"][name]["rejected"] == 0, report["rejections"]

    run_lab(tmp_path, body)


def test_decide_replicates_on_another_volunteer_and_falls_back_to_the_lab(tmp_path):
    async def body(lab):
        ledger, alice = lab.ledger, lab.address_of("alice")
        key = ("unverified-exp-" + "34" * 8, 2, 5)
        ledger.transition(key, "processing", "memory", worker=alice)
        decision = ledger.decide(key)
        replica = decision["replica"]
        assert decision["sample"] is False and decision["trust"] == 0
        assert replica[1:] == key[1:] and replica[0].startswith("unverified-exp-") and replica[0] != key[0]
        assert ledger.replicas[replica] == frozenset({"alice"})
        assert ledger.decide(key)["replica"] != replica  # a fresh key each time
        await lab.workers["bob"].close()  # nobody else to replicate on: the lab checks it itself
        await lab.wait_for(lambda: "bob" not in lab.connected())
        assert ledger.decide(key) == {"replica": None, "sample": True, "trust": 0}

    run_lab(tmp_path, body)


def test_trust_lowers_the_replica_and_sample_rates_but_never_to_zero(tmp_path):
    async def body(lab):
        ledger, alice = lab.ledger, lab.address_of("alice")
        ledger._rng = random.Random(1234)
        assert ledger.policy.accept_on_trust  # opted in (run_lab's config below)
        ledger.volunteers["alice"].trust = 1000  # replica rate max(0.05, 10/1000), sample rate max(0.01, 0.001)
        counts = {"replica": 0, "sample": 0, "trusted": 0}
        for i in range(3000):
            key = ("unverified-exp-" + "78" * 8, i)
            ledger.transition(key, "processing", "memory", worker=alice)
            d = ledger.decide(key)
            counts["replica" if d["replica"] else "sample" if d["sample"] else "trusted"] += 1
            assert d["trust"] == 1000
        assert 100 <= counts["replica"] <= 200, counts  # ~5 %
        assert 10 <= counts["sample"] <= 60, counts  # ~1 % of the rest
        ledger.volunteers["alice"].trust = 9  # below the threshold: every result replicated
        assert all(ledger.decide(("unverified-exp-" + "78" * 8, i))["replica"] for i in range(50))

    run_lab(tmp_path, body, config={"goblin.verification.accept-on-trust": True})


def test_trust_policy_rates_at_the_threshold():
    policy = TrustPolicy(threshold=10, min_replica_rate=0.05, sample_rate=0.1, min_sample_rate=0.01,
                         accept_on_trust=True)
    assert policy.replica_rate(9) == 1.0 and policy.replica_rate(10) == 1.0 and policy.replica_rate(20) == 0.5
    assert policy.sampling_rate(9) == 1.0 and policy.sampling_rate(20) == pytest.approx(0.05)
    assert policy.replica_rate(10**6) == 0.05 and policy.sampling_rate(10**6) == 0.01


def test_trust_policy_with_no_threshold_does_not_divide_by_zero():
    """``goblin.verification.trust-threshold: 0``: trusted from the start, at the floors."""
    policy = TrustPolicy(threshold=0, min_replica_rate=0.05, sample_rate=0.1, min_sample_rate=0.01,
                         accept_on_trust=True)
    assert policy.replica_rate(0) == 0.05 and policy.sampling_rate(0) == 0.01
    assert policy.replica_rate(5) == 0.05


# -- the lab's own checks: audits, and no acceptance on trust unless the lab opts in ---------------


def test_acceptance_on_trust_is_opt_in_and_off_by_default(tmp_path):
    """By default every replica-method result is replicated (or recomputed by the lab), whatever the trust."""
    policy = TrustPolicy.from_config()
    assert policy.accept_on_trust is False and policy.audit_rate == 0.05
    assert {policy.replica_rate(t) for t in (0, 10, 200, 10**6)} == {1.0}
    assert {policy.sampling_rate(t) for t in (0, 10, 200, 10**6)} == {1.0}

    async def body(lab):
        ledger, alice = lab.ledger, lab.address_of("alice")
        ledger.volunteers["alice"].trust = 10**6
        for i in range(500):
            key = ("unverified-exp-" + "9a" * 8, i)
            ledger.transition(key, "processing", "memory", worker=alice)
            assert ledger.decide(key)["replica"] is not None, i  # never "trusted", never only sampled

    run_lab(tmp_path, body)


@pytest.mark.parametrize("setting, value", [
    ("audit-rate", 0), ("audit-rate", -0.1), ("audit-rate", 1.5), ("audit-rate", float("nan")),
    ("audit-rate", "often"), ("accept-on-trust", "yes"), ("accept-on-trust", 1)])
def test_bad_verification_settings_are_refused_naming_the_setting(setting, value):
    import dask

    with dask.config.set({f"goblin.verification.{setting}": value}):
        with pytest.raises(ValueError, match=f"goblin.verification.{setting}"):
            TrustPolicy.from_config()


@pytest.mark.parametrize("rate", [0.05, 0.3])
def test_the_lab_audits_replica_pairs_at_the_configured_rate_from_its_own_generator(tmp_path, rate):
    """2000 decisions on one key: the audit is the lab's draw, at ``audit-rate`` (within 5 binomial standard
    deviations), not a function of the task (the same key is audited some times and not others)."""

    async def body(lab):
        ledger, alice = lab.ledger, lab.address_of("alice")
        assert ledger.policy.audit_rate == rate
        ledger._rng = random.Random(2026)  # the lab's seed, fixed for the test
        key = ("unverified-exp-" + "5c" * 8, 0)
        ledger.transition(key, "processing", "memory", worker=alice)
        n = 2000
        audits = sum(ledger.decide(key)["audit"] for _ in range(n))
        sd = (n * rate * (1 - rate)) ** 0.5
        assert abs(audits - n * rate) <= 5 * sd, (audits, n * rate, sd)
        ledger._rng = random.Random(2027)  # another lab's seed: other draws for the very same task
        other = [ledger.decide(key)["audit"] for _ in range(200)]
        ledger._rng = random.Random(2026)
        assert other != [ledger.decide(key)["audit"] for _ in range(200)]

    run_lab(tmp_path, body, config={"goblin.verification.audit-rate": rate})


def test_an_audit_of_honest_replicas_accepts_both_and_says_audit(tmp_path):
    async def body(lab):
        dsk, keys, expected = random_graph(6, seed=5)
        async with lab.client() as client:
            results = await client.gather(client.get(dsk, keys, sync=False))
        for got, want in zip(results, expected):
            np.testing.assert_array_equal(got, want)
        report = lab.ledger.report()
        assert report["by_method"] == {"audit": 12} and report["accepted"] == 12 and report["rejected"] == 0, report
        assert report["seconds"]["check"] > 0  # the lab recomputed

    run_lab(tmp_path, body, config={"goblin.verification.audit-rate": 1.0})


def test_two_colluding_volunteers_agreeing_on_wrong_blocks_are_caught_by_the_audit(tmp_path):
    """Both volunteers return zeros for every random block, so each replica confirms the other; the lab's
    audit (rate 1 here: at a lower rate each unaudited pair's zeros are accepted, with probability
    ``1 - rate``) recomputes, rejects both and bans them; every result the researcher gets is right."""

    async def body(lab):
        mallory = await lab.add_volunteer("mallory", cls=cheating_worker())
        await lab.add_volunteer("trudy", cls=cheating_worker())
        pair = ("mallory", "trudy")
        dsk, keys, expected = random_graph(16, seed=6)
        async with lab.client() as client:
            futures = client.get(dsk, keys, sync=False)
            await lab.wait_for(lambda: all(lab.ledger.volunteers[n].banned for n in pair))
            await lab.add_volunteer("carol")  # what the pair left undone needs a volunteer (none is left)
            results = await client.gather(futures)
        for got, want in zip(results, expected):  # the lab's numbers, never the pair's zeros
            np.testing.assert_array_equal(got, want)
        report = lab.ledger.report()
        assert report["by_method"].get("audit", 0) >= 2, report
        for name in pair:
            assert "audit" in {r["method"] for r in report["rejections"] if r["volunteer"] == name}, report
        assert report["volunteers"]["carol"]["rejected"] == 0
        assert mallory.status.name in ("closed", "closing", "closing_gracefully", "failed"), mallory.status

    run_lab(tmp_path, body, volunteers=(), config={"goblin.verification.audit-rate": 1.0})


# -- deadlines -----------------------------------------------------------------------------


def _past_due(ledger, address: str) -> None:
    """The tasks ``address`` holds are past their deadline (as if it had sat on them that long)."""
    for key, (held_by, _) in list(ledger._due.items()):
        if held_by == address:
            ledger._due[key] = (held_by, time.time() - 1)


def test_tasks_held_past_the_deadline_are_reissued_to_another_volunteer(tmp_path):
    async def body(lab):
        staller = await lab.add_volunteer("slow", cls=stalling_worker())
        ledger, slow = lab.ledger, staller.address
        ledger.volunteers["slow"].trust = 7
        async with lab.client() as client:
            a, b = matrices(5)
            dsk, keys, blocks = product_graph(a, b, BLOCK)
            futures = client.get(dsk, keys, sync=False)
            await lab.wait_for(lambda: staller.held)  # it holds one of them and sits on it
            held = [ts.key for ts in lab.scheduler.workers[slow].processing]
            assert held and all(is_unverified_key(k) for k in held)
            ledger.check_deadlines()  # within the deadline: nothing moves
            assert ledger.reissued == 0
            _past_due(ledger, slow)  # it has sat on them past their deadline
            ledger.check_deadlines()
            assert ledger.reissued == len(held)
            record = ledger.volunteers["slow"]
            assert record.late == 1 and record.trust == 0 and not record.banned and record.rejected == 0
            for key in held:
                ts = lab.scheduler.tasks[key]
                assert ts.worker_restrictions == {lab.address_of("bob")}
                assert ts.resource_restrictions == {VOLUNTEER_RESOURCE: 1}
            results = await client.gather(futures)
        np.testing.assert_allclose(assemble(results, keys, blocks), a @ b, rtol=1e-12, atol=1e-12)
        assert not [k for k in lab.recorder.keys_on(slow) if is_unverified_key(k)]  # it finished none of them
        assert ledger.report()["reissued"] == len(held) and "slow" in lab.connected()  # late is not wrong

    run_lab(tmp_path, body, volunteers=("bob",))


def test_a_late_volunteer_keeps_its_tasks_when_no_other_volunteer_can_take_them(tmp_path):
    async def body(lab):
        staller = await lab.add_volunteer("slow", cls=stalling_worker())
        ledger = lab.ledger
        async with lab.client() as client:
            a, b = matrices(6)
            dsk, keys, blocks = product_graph(a, b, BLOCK)
            futures = client.get(dsk, keys, sync=False)
            await lab.wait_for(lambda: staller.held)
            _past_due(ledger, staller.address)
            ledger.check_deadlines()
            assert ledger.reissued == 0 and ledger.volunteers["slow"].late == 0  # nowhere else to go
            assert lab.scheduler.workers[staller.address].processing
            staller.release.set()  # it finishes after all
            results = await client.gather(futures)
        np.testing.assert_allclose(assemble(results, keys, blocks), a @ b, rtol=1e-12, atol=1e-12)
        assert ledger.volunteers["slow"].accepted == len(keys)

    run_lab(tmp_path, body, volunteers=())


def test_with_no_trust_threshold_volunteers_results_are_checked_at_the_floor_rates(tmp_path):
    """``trust-threshold: 0`` once made the policy handler divide by zero, failing every replica-method check."""

    async def body(lab):
        dsk, keys, expected = random_graph(4, seed=77)
        async with lab.client() as client:
            results = await client.gather(client.get(dsk, keys, sync=False))
        for got, want in zip(results, expected):
            np.testing.assert_array_equal(got, want)
        assert sum(lab.ledger.by_method.values()) >= 4 and lab.ledger.report()["rejected"] == 0

    run_lab(tmp_path, body, config={"goblin.verification.trust-threshold": 0})


# -- replicas whose volunteers leave ----------------------------------------------------------


def _replica_of(lab, first: str, index: int = 0):
    """``first`` computed a random block; the ledger's replica key for it, and the replica's graph."""
    key = (f"unverified-random_standard_normal-{'9a' * 16}", index)
    lab.ledger.transition(key, "processing", "memory", worker=lab.address_of(first))
    replica = lab.ledger.decide(key)["replica"]
    assert replica is not None
    params = {"shape": (8, 8), "dtype": "float64", "seed": (5, index)}
    return replica, {replica: CatalogTask(replica, get("random_standard_normal"), **params)}, params


def test_a_replica_never_runs_on_the_volunteer_it_checks_even_when_the_others_left(tmp_path):
    """The other volunteer leaves between the ledger's decision and the replica's submission."""

    async def body(lab):
        replica, dsk, params = _replica_of(lab, "alice")
        await lab.workers["bob"].close()
        await lab.wait_for(lambda: "bob" not in lab.connected())
        async with lab.client("lab", "lab-worker") as client:  # as the lab worker's check submits it
            got = await client.get(dsk, replica, sync=False)
        np.testing.assert_array_equal(got, np.random.Generator(np.random.PCG64([5, 0])).standard_normal((8, 8)))
        assert lab.address_of("alice") not in lab.recorder.workers_of(replica)  # never its own check
        assert lab.recorder.workers_of(replica) == [lab.address_of("lab-worker")]

    run_lab(tmp_path, body)


def test_a_replica_whose_only_eligible_volunteer_leaves_goes_elsewhere(tmp_path):
    """Before, it waited in no-worker (restricted to a gone address) until the check gave up (4 x deadline)."""

    async def body(lab):
        staller = await lab.add_volunteer("slow", cls=stalling_worker())
        replica, dsk, params = _replica_of(lab, "alice")
        assert lab.ledger.replicas[replica] == frozenset({"alice"})
        await lab.workers["alice"].close()  # alice leaves too: only "slow" may replicate her result
        await lab.wait_for(lambda: "alice" not in lab.connected())
        async with lab.client("lab", "lab-worker") as client:
            future = client.get(dsk, replica, sync=False)
            await lab.wait_for(lambda: replica in staller.held)
            lab.admission.ban("slow", "tested")  # the volunteer running the replica is gone
            await lab.wait_for(lambda: "slow" not in lab.connected())
            assert lab.scheduler.tasks[replica].state != "no-worker"
            got = await future
        np.testing.assert_array_equal(got, np.random.Generator(np.random.PCG64([5, 0])).standard_normal((8, 8)))
        assert lab.recorder.workers_of(replica) == [lab.address_of("lab-worker")]

    run_lab(tmp_path, body, volunteers=("alice",))


def test_a_replica_whose_volunteer_leaves_goes_to_another_eligible_one(tmp_path):
    """carol joins after the replica was restricted (to "slow" only): she is eligible when "slow" leaves."""

    async def body(lab):
        staller = await lab.add_volunteer("slow", cls=stalling_worker())
        replica, dsk, params = _replica_of(lab, "alice")
        async with lab.client("lab", "lab-worker") as client:
            future = client.get(dsk, replica, sync=False)
            await lab.wait_for(lambda: replica in staller.held)
            await lab.add_volunteer("carol")
            lab.admission.ban("slow", "tested")
            await lab.wait_for(lambda: "slow" not in lab.connected())
            await future
        assert lab.recorder.workers_of(replica) == [lab.address_of("carol")]

    run_lab(tmp_path, body, volunteers=("alice",))


def test_a_replica_lost_with_its_volunteer_is_computed_again_elsewhere(tmp_path):
    async def body(lab):
        replica, dsk, params = _replica_of(lab, "alice")
        bob = lab.address_of("bob")
        async with lab.client("lab", "lab-worker") as client:
            future = client.get(dsk, replica, sync=False)
            await future  # bob computed it and holds the only copy
            assert lab.recorder.workers_of(replica) == [bob]
            lab.admission.ban("bob", "tested")
            await lab.wait_for(lambda: "bob" not in lab.connected())
            assert lab.scheduler.tasks[replica].state != "no-worker"
            got = await future
        np.testing.assert_array_equal(got, np.random.Generator(np.random.PCG64([5, 0])).standard_normal((8, 8)))
        assert lab.recorder.workers_of(replica) == [bob, lab.address_of("lab-worker")]  # never alice's

    run_lab(tmp_path, body)


@pytest.mark.parametrize("carol", [False, True], ids=["no-other-volunteer", "carol-joined"])
def test_with_max_exposure_a_replica_replanned_after_its_volunteer_left_never_goes_to_the_first(tmp_path, carol):
    """The exposure plugin pins each volunteer task (``max-exposure``) and plans it again when its volunteer
    leaves: a replica must keep the ledger's exclusion then, or it lands on the volunteer it checks."""
    async def body(lab):
        staller = await lab.add_volunteer("slow", cls=stalling_worker())
        x = np.random.default_rng(0).standard_normal((128, 128))
        src = ("source-" + "ab" * 8, 0, 0)
        key = (f"unverified-exp-{'cd' * 16}", 0, 0)
        lab.ledger.transition(key, "processing", "memory", worker=lab.address_of("alice"))
        replica = lab.ledger.decide(key)["replica"]
        dsk = {src: Task(src, lab_block, DataNode(None, x[:32, :32]), lab_array=("a" + "ef" * 7, (128, 128),
                                                                                  ((0, 32), (0, 32)))),
               replica: CatalogTask(replica, get("exp"), TaskRef(src))}
        async with lab.client("lab", "lab-worker") as client:
            future = client.get(dsk, replica, sync=False)
            await lab.wait_for(lambda: replica in staller.held)
            assert lab.exposure.pinned == {replica: staller.address}
            if carol:
                await lab.add_volunteer("carol")
            lab.admission.ban("slow", "tested")
            await lab.wait_for(lambda: "slow" not in lab.connected())
            ts = lab.scheduler.tasks[replica]
            assert ts.state != "no-worker"
            assert lab.address_of("alice") not in (ts.worker_restrictions or ())
            np.testing.assert_array_equal(await future, np.exp(x[:32, :32]))
        assert lab.recorder.workers_of(replica) == [lab.address_of("carol" if carol else "lab-worker")]

    run_lab(tmp_path, body, volunteers=("alice",), config={"goblin.minimization.max-exposure": 0.5})
