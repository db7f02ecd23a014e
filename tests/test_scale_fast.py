"""Issue 19, scale: the plugins' per-task work does not scan every worker or every pinned key.

In-process lab nodes (tests/inprocess.py): a real distributed Scheduler with the goblin
plugins, a lab worker and volunteers over mutual TLS.
"""

from __future__ import annotations

from tests.inprocess import compute_product, matrices, run_lab
from tests.test_placement_fast import unverified_key


def _count_calls(monkeypatch, obj, names) -> dict:
    calls = {n: 0 for n in names}
    for n in names:
        original = getattr(obj, n)

        def counting(*args, _n=n, _original=original, **kwargs):
            calls[_n] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(obj, n, counting)
    return calls


def test_role_queries_answer_without_a_scan(tmp_path):
    async def body(lab):
        adm = lab.admission
        lab_worker, alice, bob = (lab.address_of(n) for n in ("lab-worker", "alice", "bob"))
        assert adm.is_lab(lab_worker) and not adm.is_lab(alice) and not adm.is_lab("tls://127.0.0.1:1")
        assert adm.has_volunteer_besides("alice") and adm.has_volunteer_besides("bob")
        assert adm.has_volunteer_besides(None)
        await lab.scheduler.remove_worker(bob, stimulus_id="test-bob-leaves")
        assert not adm.has_volunteer_besides("alice")  # alone now: a replica has nowhere to go
        assert adm.has_volunteer_besides("bob")
        assert adm.is_lab(lab_worker)

    run_lab(tmp_path, body)


def test_verdicts_and_placement_make_no_scan_of_the_workers_per_task(tmp_path, monkeypatch):
    """64 product tasks verified: the ledger never lists the lab workers or the volunteers per verdict."""

    async def body(lab):
        calls = _count_calls(monkeypatch, lab.admission, ("lab_workers", "volunteers"))
        a, b = matrices(11, n=128)
        async with lab.client() as client:
            keys = await compute_product(client, a, b, 32)  # 64 volunteer tasks, 64 checks
        report = lab.ledger.report()
        assert report["by_method"] == {"freivalds": len(keys)} and report["rejected"] == 0
        assert calls["lab_workers"] == 0, calls
        assert calls["volunteers"] <= 2, calls  # the deadline sweep may run meanwhile, never per task

    run_lab(tmp_path, body)


def test_the_pinned_index_follows_the_pins(tmp_path, monkeypatch):
    """max-exposure pins tasks to volunteers; the per-volunteer index of pins stays equal to the pins."""

    async def body(lab):
        exposure = lab.exposure
        seen = []
        original = exposure._pin

        def pin(key, addr):
            original(key, addr)
            index = {k: a for a, ks in exposure.pinned_keys.items() for k in ks}
            seen.append(index == exposure.pinned)

        monkeypatch.setattr(exposure, "_pin", pin)
        a, b = matrices(12, n=128)
        async with lab.client() as client:
            keys = await compute_product(client, a, b, 32, lab_arrays=True)
        assert seen and all(seen)
        assert exposure.pinned == {} and dict(exposure.pinned_keys) == {} and exposure.planned == {}
        for key in keys:
            assert len(lab.recorder.workers_of(unverified_key(key))) == 1
        assert all(f <= 0.5 + 1e-9 for fr in exposure.report().values() for f in fr.values())

    run_lab(tmp_path, body, config={"goblin.minimization.max-exposure": 0.5})


def test_replica_decisions_still_find_another_volunteer(tmp_path):
    """decide() replicates on another volunteer when there is one, and lets the lab check when alone."""

    async def body(lab):
        ledger = lab.ledger
        key = ("unverified-exp-0123456789abcdef", 0)
        ledger.computed_by[key] = "alice"  # untrusted (trust 0): always replicated when possible
        assert ledger.decide(key)["replica"] is not None
        await lab.scheduler.remove_worker(lab.address_of("bob"), stimulus_id="test-bob-leaves")
        got = ledger.decide(key)
        assert got["replica"] is None and got["sample"] is True

    run_lab(tmp_path, body)


def test_a_volunteer_holds_at_most_its_cap_and_waiting_tasks_are_placed_as_slots_free(tmp_path, monkeypatch):
    """goblin.placement.max-held-per-volunteer at 1: 64 volunteer tasks on two volunteers, each holding one at a
    time (counted at every placement, work stealing's included); the waiting ones are placed as slots free, none is
    left waiting or moved to the lab, and nothing lists the volunteers per task."""

    async def body(lab):
        held = lab.plugins["goblin-held-tasks"]
        calls = _count_calls(monkeypatch, lab.admission, ("lab_workers", "volunteers"))
        most: dict[str, int] = {}
        took = held._took

        def counting(ws):
            took(ws)
            most[ws.name] = max(most.get(ws.name, 0), len(ws.processing))

        monkeypatch.setattr(held, "_took", counting)
        a, b = matrices(13, n=128)
        async with lab.client() as client:
            keys = await compute_product(client, a, b, 32)  # 64 volunteer tasks
        assert set(held.caps.values()) == {1} and most == {"alice": 1, "bob": 1}, (held.caps, most)
        assert held.held_back == {} and held.full == set() and held.holder == {}
        assert lab.faults.to_lab == 0
        report = lab.ledger.report()
        assert report["accepted"] == len(keys) and report["holding"]["held_back"] == 0
        assert calls["lab_workers"] == 0 and calls["volunteers"] <= 2, calls

    run_lab(tmp_path, body, config={"goblin.placement.max-held-per-volunteer": 1})
