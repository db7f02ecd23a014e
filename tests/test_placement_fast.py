"""Placement on an in-process lab node (``tests.inprocess``): what goes to volunteers, what stays on the lab.

* :func:`goblin_dask.array.placement.placement_for`: volunteer or lab, from an op's cost and verification;
* ``scheduler_plugins.catalog_only``: only catalog tasks under checks reach volunteers, a
  non-catalog task pinned to a volunteer is refused, the handlers that reach workers stay on the lab;
* ``scheduler_plugins.minimization``: a volunteer task whose key names data is refused;
* ``scheduler_plugins.exposure``: the max-share cap per task, the account, the max-exposure cap;
* ``scheduler_plugins.faults``: a volunteer's failures go elsewhere, never to the researcher.

``test_catalog_only``, ``test_exposure``, ``test_faults`` and ``test_minimization`` check the
same with real processes.
"""

from __future__ import annotations

import dask
import numpy as np
import pytest
from dask._task_spec import DataNode, Task, TaskRef

from goblin_dask.array.placement import KEPT_AT_LAB, placement_for, placement_reason
from goblin_dask.ops import CatalogTask, get
from goblin_dask.ops.spec import Aval
from goblin_dask.roles import LAB_RESOURCE, VOLUNTEER_RESOURCE
from goblin_dask.validation.checks import insert_checks, is_unverified_key, unverified_key
from tests.inprocess import (
    assemble,
    compute_product,
    failing_worker,
    matrices,
    product_graph,
    run_lab,
)

F64 = np.dtype("float64")
HEX = "0123456789abcdeffedcba9876543210"
A_KEY, B_KEY = "source-" + HEX[:16], "source-" + HEX[16:]


def _aval(*shape):
    return Aval(tuple(shape), F64)


# -- placement_for ------------------------------------------------------------------------------


def test_products_go_to_volunteers_once_they_are_worth_the_round_trip():
    matmul = get("matmul")
    assert placement_for(matmul, _aval(256, 256), _aval(256, 256)) == "volunteer"  # 3.4e7 flops
    assert placement_for(matmul, _aval(16, 16), _aval(16, 16)) == "lab"  # 8e3 flops: checking costs as much
    with dask.config.set({"goblin.placement.min-flops": 1e9}):
        assert placement_for(matmul, _aval(256, 256), _aval(256, 256)) == "lab"
    with dask.config.set({"goblin.placement.min-flops": 0, "goblin.placement.min-product-intensity": 0}):
        assert placement_for(matmul, _aval(2, 2), _aval(2, 2)) == "volunteer"


def test_products_whose_check_costs_about_as_much_stay_on_the_lab():
    matmul = get("matmul")
    f32 = np.dtype("float32")
    heads = Aval((64, 128, 64), f32), Aval((64, 64, 128), f32)  # attention scores: 64 flops per element
    assert placement_for(matmul, *heads) == "lab"
    assert placement_for(matmul, Aval((2048, 256), f32), Aval((256, 192), f32)) == "volunteer"  # ~208
    assert placement_for(matmul, _aval(128, 128), _aval(128, 128)) == "volunteer"  # float64: ~85 >= 64
    assert placement_for(matmul, Aval((128, 128), f32), Aval((128, 128), f32)) == "lab"  # float32: ~85 < 128
    with dask.config.set({"goblin.placement.min-product-intensity": 0}):
        assert placement_for(matmul, *heads) == "volunteer"


def test_elementwise_ops_stay_on_the_lab_unless_compute_dense_enough():
    big = _aval(1000, 1000)
    assert placement_for(get("add"), big, big) == "lab"  # 1 flop per 24 bytes shipped
    assert placement_for(get("exp"), big) == "lab"  # 1.25 flops per byte, under the default 4
    with dask.config.set({"goblin.placement.min-intensity": 1.0}):
        assert placement_for(get("exp"), big) == "volunteer"
        assert placement_for(get("add"), big, big) == "lab"
        assert placement_for(get("exp"), _aval(10, 10)) == "lab"  # dense but too small


def test_layout_and_exact_ops_never_leave_the_lab():
    x = _aval(1000, 1000)
    with dask.config.set({"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0}):
        assert placement_for(get("transpose"), x, axes=(1, 0)) == "lab"
        assert placement_for(get("getitem"), x, index=(slice(0, 10),)) == "lab"
        assert placement_for(get("equal"), x, x) == "lab"
        assert placement_for(get("zeros"), shape=(1000, 1000)) == "lab"
        assert placement_for(get("add"), x, x) == "volunteer"  # the same thresholds let a Replica op go


def test_each_task_kept_at_the_lab_says_why_and_names_the_setting_that_would_send_it_out():
    matmul, f32 = get("matmul"), np.dtype("float32")
    assert placement_reason(matmul, _aval(16, 16), _aval(16, 16)) == ("lab", "min-flops")  # 8e3 flops
    # 4e6 flops, but 2*512*16*512 / (512*16 + 16*512 + 512*512) = 30 flops per element < 64
    assert placement_reason(matmul, _aval(512, 16), _aval(16, 512)) == ("lab", "min-product-intensity")
    assert placement_reason(matmul, Aval((128, 128), f32), Aval((128, 128), f32)) == ("lab", "min-product-intensity")
    assert placement_reason(matmul, _aval(256, 256), _aval(256, 256)) == ("volunteer", None)
    assert placement_reason(get("add"), _aval(1000, 1000), _aval(1000, 1000)) == ("lab", "min-intensity")
    assert placement_reason(get("exp"), _aval(10, 10)) == ("lab", "min-flops")
    assert placement_reason(get("transpose"), _aval(1000, 1000), axes=(1, 0)) == ("lab", "lab-only")
    assert placement_reason(get("random_uniform"), shape=(4, 4), seed=1) == ("volunteer", None)
    for why in ("min-flops", "min-product-intensity", "min-intensity", "max-share", "max-exposure"):
        assert dask.config.get(KEPT_AT_LAB[why]) is not None or why == "max-exposure"  # a real setting
    # the reason travels with the task (a copy, a substitution and a pickle keep it) and a volunteer's never has one
    import pickle

    task = CatalogTask("k", matmul, TaskRef("a"), TaskRef("b"), placement="lab", why="min-flops")
    assert task.copy().why == "min-flops" and task.substitute({"a": "c"}).why == "min-flops"
    assert pickle.loads(pickle.dumps(task)).why == "min-flops"
    assert CatalogTask("k", matmul, TaskRef("a"), TaskRef("b"), placement="volunteer", why="min-flops").why is None
    assert CatalogTask("k", get("transpose"), TaskRef("a"), axes=(1, 0)).why == "lab-only"


def test_random_blocks_ship_nothing_and_go_to_volunteers_at_any_size():
    assert placement_for(get("random_standard_normal"), shape=(4, 4), seed=1) == "volunteer"
    assert placement_for(get("random_uniform"), shape=(2000, 2000), seed=(1, 2)) == "volunteer"


# -- catalog-only placement -----------------------------------------------------------------------


def test_volunteers_get_the_unverified_products_and_the_lab_everything_else(tmp_path):
    async def body(lab):
        volunteers = {lab.address_of("alice"), lab.address_of("bob")}
        async with lab.client() as client:
            keys = await compute_product(client, *matrices(1), 32)
        placed = {k: w for k, w in lab.recorder.finished}
        for key in keys:
            assert placed[unverified_key(key)] in volunteers  # computed by a volunteer
            assert placed[key] == lab.address_of("lab-worker")  # checked by the lab
        assert all(w == lab.address_of("lab-worker") for k, w in placed.items() if not is_unverified_key(k))
        assert lab.catalog_only.placed == {"volunteer": len(keys), "lab": len(placed) - len(keys), "refused": 0}

    run_lab(tmp_path, body)


def test_restrictions_set_when_the_graph_arrives(tmp_path):
    async def body(lab):
        async with lab.client() as client:
            a, b = matrices(2)
            dsk, keys, blocks = product_graph(a, b, 32)
            futures = client.get(dsk, keys, sync=False)
            await lab.wait_for(lambda: all(unverified_key(k) in lab.scheduler.tasks for k in keys))
            for key in keys:
                assert lab.scheduler.tasks[unverified_key(key)].resource_restrictions == {VOLUNTEER_RESOURCE: 1}
                assert lab.scheduler.tasks[key].resource_restrictions == {LAB_RESOURCE: 1}
            results = await client.gather(futures)
        np.testing.assert_allclose(assemble(results, keys, blocks), a @ b, rtol=1e-12)

    run_lab(tmp_path, body)


def test_a_catalog_task_without_a_check_runs_on_the_lab_even_when_pinned_to_a_volunteer(tmp_path):
    async def body(lab):
        alice = lab.address_of("alice")
        a, b = matrices(3, n=16)
        key = f"matmul-{HEX}"
        async with lab.client() as client:
            future = client.get({A_KEY: DataNode(None, a), B_KEY: DataNode(None, b),
                                 key: CatalogTask(key, get("matmul"), TaskRef(A_KEY),
                                                  TaskRef(B_KEY))}, key, sync=False,
                                workers=[alice])
            np.testing.assert_allclose(await future, a @ b)
        assert lab.recorder.workers_of(key) == [lab.address_of("lab-worker")]
        assert lab.recorder.keys_on(alice) == [] and lab.catalog_only.placed["volunteer"] == 0

    run_lab(tmp_path, body)


def test_a_reason_the_lab_does_not_know_counts_as_other_and_never_stops_placement(tmp_path):
    """A graph is the researcher's to write: a lab-placed task's ``why`` that is no known reason (a long string,
    a list) is counted as ``other``, and the task is placed on the lab worker all the same."""
    async def body(lab):
        x = np.arange(12.0).reshape(3, 4)
        keys = [f"transpose-{HEX[:-1]}{i}" for i in range(3)]
        dsk = {A_KEY: DataNode(None, x)}
        for key, why in zip(keys, ("x" * 10_000, ["not", "hashable"], "min-flops")):
            task = CatalogTask(key, get("exp"), TaskRef(A_KEY), placement="lab")
            task.why = why  # as an unpickled graph may carry it
            dsk[key] = task
        async with lab.client() as client:
            results = await client.gather(client.get(dsk, keys, sync=False))
        for got in results:
            np.testing.assert_allclose(got, np.exp(x), rtol=1e-15)
        for key in keys:
            assert lab.recorder.workers_of(key) == [lab.address_of("lab-worker")]
        total, _ = lab.catalog_only.count.report()
        assert total == {"volunteer": 0, "lab": 3, "kept": {"min-flops": 1, "other": 2}}

    run_lab(tmp_path, body)


def test_lab_only_ops_and_non_catalog_tasks_stay_on_the_lab_even_under_unverified_keys(tmp_path):
    async def body(lab):
        x = np.arange(12.0).reshape(3, 4)
        transpose_key = (f"unverified-transpose-{HEX}", 0, 0)
        python_key = (f"unverified-matmul-{HEX}", 0, 0)
        dsk = {A_KEY: DataNode(None, x),
               transpose_key: CatalogTask(transpose_key, get("transpose"), TaskRef(A_KEY),
                                          axes=(1, 0), placement="volunteer"),
               python_key: Task(python_key, np.dot, TaskRef(A_KEY), x.T)}
        async with lab.client() as client:
            t, p = await client.gather(client.get(dsk, [transpose_key, python_key], sync=False))
        np.testing.assert_array_equal(t, x.T)
        np.testing.assert_array_equal(p, x @ x.T)
        assert lab.recorder.workers_of(transpose_key) == lab.recorder.workers_of(python_key) \
            == [lab.address_of("lab-worker")]
        assert lab.catalog_only.placed["volunteer"] == 0

    run_lab(tmp_path, body)


ran_here: list = []


def _researchers_function(x):
    ran_here.append(x)
    return x + 1


def test_a_researchers_function_pinned_to_a_volunteer_is_refused_and_never_runs(tmp_path):
    async def body(lab):
        ran_here.clear()
        alice = lab.address_of("alice")
        async with lab.client() as client:
            pinned = client.submit(_researchers_function, 1, workers=[alice], key="pinned-1")
            with pytest.raises(PermissionError, match="it cannot run on volunteer alice"):
                await pinned
            assert await client.submit(_researchers_function, 2, key="unpinned-2") == 3
        assert ran_here == [2]  # only the unpinned one ran, on the lab worker
        assert lab.recorder.workers_of("unpinned-2") == [lab.address_of("lab-worker")]
        assert lab.catalog_only.placed["refused"] == 1
        assert "pinned-1" not in lab.workers["alice"].state.tasks

    run_lab(tmp_path, body, volunteers=("alice",))


def test_handlers_that_reach_workers_reach_the_lab_worker_only(tmp_path):
    async def body(lab):
        alice, lab_worker = lab.address_of("alice"), lab.address_of("lab-worker")
        async with lab.client() as client:
            assert set(await client.run(lambda: 1)) == {lab_worker}
            with pytest.raises(PermissionError, match="refused for volunteer alice"):
                await client.run(lambda: 1, workers=[alice])
            [future] = await client.scatter([np.arange(3)])
            assert (await client.who_has([future]))[future.key] == (lab_worker,)
            with pytest.raises(PermissionError, match="scatter refused for volunteer alice"):
                await client.scatter([np.arange(3)], workers=[alice])
            with pytest.raises(PermissionError, match="'run_function' is not allowed for researcher ada"):
                await client.run_on_scheduler(lambda: 1)
        async with lab.client("admin", "root") as admin:  # past authorization, the lab node still refuses
            [mine] = await admin.scatter([np.arange(3)])
            for call, match in [(admin.run_on_scheduler(lambda: 1), "refuses 'run_function'"),
                                (admin.replicate([mine]), "refuses 'replicate'"),
                                (admin.rebalance(workers=[alice]), "rebalance refused for volunteer alice"),
                                (admin.retire_workers([alice]), "refuses 'retire_workers'"),
                                (admin.scheduler.register_worker_plugin(plugin=b"", name="x", idempotent=False),
                                 "refuses 'register_worker_plugin'")]:
                with pytest.raises(PermissionError, match=match):
                    await call
        assert "amm" not in lab.scheduler.extensions
        assert lab.connected() == {"lab-worker", "alice"} and lab.admission.bans == []

    run_lab(tmp_path, body, volunteers=("alice",))


def test_a_volunteer_task_whose_key_names_data_is_refused_before_it_is_sent(tmp_path):
    async def body(lab):
        a, b = matrices(4, n=16)
        key = ("patient-records", 0)
        dsk = insert_checks({A_KEY: DataNode(None, a), B_KEY: DataNode(None, b),
                             key: CatalogTask(key, get("matmul"), TaskRef(A_KEY),
                                              TaskRef(B_KEY))})
        async with lab.client() as client:
            with pytest.raises(PermissionError, match="data minimization"):
                await client.get(dsk, key, sync=False)
        assert lab.recorder.keys_on(lab.address_of("alice")) == []
        [message] = lab.plugins["goblin-minimization"].refused
        assert "key 'unverified-patient-records' is not an opaque" in message

    run_lab(tmp_path, body, volunteers=("alice",))


# -- exposure ---------------------------------------------------------------------------------


def test_a_task_that_would_send_more_than_max_share_is_computed_by_the_lab(tmp_path):
    """128 x 128 lab arrays cut at 96: blocks of 96 x 96 hold 56 % of an array, the others at most 19 %."""

    async def body(lab):
        a, b = matrices(7, n=128)
        async with lab.client() as client:
            keys = await compute_product(client, a, b, 96, lab_arrays=True)
        over = {unverified_key(k) for k in keys if k[3] == 0 and (k[1] == 0 or k[2] == 0)}  # A(0,0) or B(0,0)
        assert len(over) == 3
        volunteers = {lab.address_of("alice"), lab.address_of("bob")}
        for key in keys:
            [worker] = lab.recorder.workers_of(unverified_key(key))
            assert (worker == lab.address_of("lab-worker")) == (unverified_key(key) in over)
            assert (worker in volunteers) == (unverified_key(key) not in over)
        report = lab.ledger.report()
        assert report["tasks"] == len(keys) - len(over)  # the lab's stand-ins are nobody's results
        assert report["by_method"] == {"freivalds": len(keys) - len(over)}
        for fractions in report["exposure"].values():
            assert all(0 < f <= 1 for f in fractions.values())

    run_lab(tmp_path, body)


def test_the_exposure_account_counts_distinct_elements_each_volunteer_received(tmp_path):
    async def body(lab):
        a, b = matrices(8, n=128)
        async with lab.client() as client:
            keys = await compute_product(client, a, b, 32, lab_arrays=True)  # 64 tasks, each 1/16 of A and of B
        lab_worker = lab.address_of("lab-worker")
        assert all(lab.recorder.workers_of(unverified_key(k)) != [lab_worker] for k in keys)  # none over the cap
        exposure = lab.exposure.report()
        assert set(exposure) == {"alice", "bob"}
        array_ids = {aid for fractions in exposure.values() for aid in fractions}
        assert len(array_ids) == 2
        for aid in array_ids:
            shares = [exposure[name].get(aid, 0.0) for name in exposure]
            assert all(s * 16 == pytest.approx(round(s * 16)) and s <= 1.0 for s in shares)  # whole blocks, once
            assert sum(shares) >= 1.0  # every block went to some volunteer
        # no cap per volunteer: each received half of each operand's blocks (its run, held_tasks' "Runs"); before
        # runs, distributed's placement spread them and one received more
        assert max(f for fractions in exposure.values() for f in fractions.values()) >= 0.5

    run_lab(tmp_path, body)


def test_max_exposure_keeps_each_volunteer_under_its_cap(tmp_path):
    async def body(lab):
        a, b = matrices(9, n=128)
        async with lab.client() as client:
            keys = await compute_product(client, a, b, 32, lab_arrays=True)
        exposure = lab.exposure.report()
        assert set(exposure) == {"alice", "bob"}
        assert all(f <= 0.5 + 1e-9 for fractions in exposure.values() for f in fractions.values()), exposure
        for key in keys:  # each computed once, by a volunteer within its cap or by the lab
            assert len(lab.recorder.workers_of(unverified_key(key))) == 1
        assert lab.exposure.pinned == {} and lab.exposure.planned == {}  # all received: nothing left planned

    run_lab(tmp_path, body, config={"goblin.minimization.max-exposure": 0.5})


# -- faults ----------------------------------------------------------------------------------------


def test_a_failing_volunteers_tasks_go_to_another_one_and_never_fail_the_researcher(tmp_path):
    async def body(lab):
        faulty = await lab.add_volunteer("faulty", cls=failing_worker())
        async with lab.client() as client:
            for seed in range(4):
                await compute_product(client, *matrices(30 + seed), 32)  # asserts the answer
                if faulty.failed:
                    break
        assert faulty.failed, "the faulty volunteer got work"
        faults = lab.faults.report()
        errors = [f for f in faults["faults"] if f["kind"] == "error"]
        # each failure reported for a task it was running counts (a report for one already moved away does not)
        assert 1 <= faults["rescheduled"] == len(errors) <= len(faulty.failed)
        assert {f["volunteer"] for f in errors} == {"faulty"} and all("out of memory" in f["reason"] for f in errors)
        report = lab.ledger.report()
        assert report["volunteers"]["faulty"]["failed"] == len(errors) and report["rejected"] == 0
        assert not report["volunteers"]["faulty"]["banned"]  # failing is not cheating
        for key in faulty.failed:  # each went to the honest volunteer, or to the lab when it rested
            assert lab.faults.failed_on.get(key) is None
            assert lab.address_of("faulty") not in lab.recorder.workers_of(key)

    run_lab(tmp_path, body, volunteers=("bob",))


def test_with_only_a_failing_volunteer_the_lab_computes_and_the_volunteer_rests(tmp_path):
    async def body(lab):
        faulty = await lab.add_volunteer("faulty", cls=failing_worker())
        async with lab.client() as client:
            keys = await compute_product(client, *matrices(40), 32)
        lab_worker = lab.address_of("lab-worker")
        assert all(lab.recorder.workers_of(unverified_key(k)) == [lab_worker] for k in keys)
        faults = lab.faults.report()
        assert faults["to_lab"] == len(keys) and "faulty" in faults["cooling"]
        record = lab.ledger.volunteers["faulty"]
        assert record.cooldowns == 1 and record.failed == 3 and len(faulty.failed) >= 3  # then it rested
        assert lab.ledger.report()["tasks"] == 0  # nobody is credited for the lab's work

    run_lab(tmp_path, body, volunteers=(), config={"goblin.faults.max-consecutive": 3})
