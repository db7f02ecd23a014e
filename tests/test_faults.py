"""Faulty volunteers, each a real volunteer process, against a real lab node.

A volunteer whose kernel raises, or whose process dies, never fails or stalls the
researcher's computation: its tasks go to another volunteer or to the lab worker, its
failures are counted (and, after a few in a row, it rests), the error's text is in the
lab node's log, and no pickled exception of a volunteer reaches the researcher.
"""

from __future__ import annotations

import numpy as np
import pytest
from dask._task_spec import DataNode, TaskRef

from goblin_dask.node.local import LabNode
from goblin_dask.ops import CatalogTask, get
from goblin_dask.validation.checks import insert_checks
from tests.conftest import assemble, blocked_product_graph, read_log, wait_for
from tests.faulty import MARK

N, BLOCK = 1024, 256


@pytest.fixture(scope="module")
def grid():
    """A lab node with one honest volunteer; each test adds its faulty ones."""
    with LabNode.local(volunteers=1) as node:
        yield node


@pytest.fixture
def lonely(tmp_path):
    """A lab node with no honest volunteer at all."""
    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab") as node:
        yield node


class ErredMessages:
    """Every ``task-erred`` message the researcher's client receives (none should come from a volunteer)."""

    def __init__(self, client):
        self.client, self.messages = client, []
        self._original = client._stream_handlers["task-erred"]

    def __enter__(self):
        def record(**msg):
            self.messages.append(msg)
            return self._original(**msg)

        self.client._stream_handlers["task-erred"] = record
        return self

    def __exit__(self, *exc):
        self.client._stream_handlers["task-erred"] = self._original


def _product(node, seed: int):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((N, N)), rng.standard_normal((N, N))
    dsk, keys, blocks = blocked_product_graph(a, b, BLOCK)
    with ErredMessages(node.client) as erred:
        results = node.client.get(dsk, keys)
    c = assemble({k[1:]: r for k, r in zip(keys, results)}, (N, N), blocks)
    np.testing.assert_allclose(c, a @ b, rtol=1e-10, atol=1e-10)
    assert erred.messages == []  # the researcher never heard of the volunteers' failures
    return node.report()


def _faulty(node, kind: str, *extra: str) -> str:
    return node.add_volunteer(module="tests.faulty", extra_args=("--fault", kind, *extra))


def _scheduler_log(node) -> str:
    return read_log(node._log_path("scheduler"))


def _retire(node, name: str) -> None:
    if node.processes[name].poll() is None:
        node.kill_volunteer(name)
    wait_for(lambda: name not in node.volunteer_names(), f"{name} to leave")


def test_a_volunteer_whose_kernel_raises_beside_an_honest_one(grid):
    honest = grid.volunteer_names()
    before = grid.report()["volunteers"]
    faulty = _faulty(grid, "raise")
    report = _product(grid, seed=1)
    volunteers = report["volunteers"]
    assert volunteers[faulty]["failed"] >= 1, report
    assert volunteers[faulty]["accepted"] == 0 and not volunteers[faulty]["banned"]
    for name in honest:  # the honest volunteer computed (most of) the product, and was not blamed
        assert volunteers[name]["accepted"] > before.get(name, {}).get("accepted", 0)
        assert volunteers[name]["failed"] == before.get(name, {}).get("failed", 0)
    faults = [f for f in report["faults"]["faults"] if f["volunteer"] == faulty]
    assert faults and all(MARK in f["reason"] for f in faults if f["kind"] == "error"), faults
    assert report["faults"]["rescheduled"] >= 1
    log = _scheduler_log(grid)
    assert f"volunteer {faulty} failed task" in log and MARK in log
    # three failures in a row: it rests (its tasks went elsewhere)
    assert volunteers[faulty]["cooldowns"] >= 1 and faulty in report["faults"]["cooling"], report["faults"]
    assert any(f["kind"] == "cooldown" and f["volunteer"] == faulty for f in report["faults"]["faults"])
    _retire(grid, faulty)


def test_a_volunteer_out_of_memory_beside_an_honest_one(grid):
    faulty = _faulty(grid, "memory")
    report = _product(grid, seed=2)
    assert report["volunteers"][faulty]["failed"] >= 1
    assert "MemoryError" in _scheduler_log(grid)
    _retire(grid, faulty)


def test_a_volunteer_that_crashes_beside_an_honest_one(grid):
    crasher = _faulty(grid, "crash")
    report = _product(grid, seed=3)
    wait_for(lambda: grid.processes[crasher].poll() is not None, f"{crasher} to die")
    assert grid.processes[crasher].returncode == 13
    volunteers = grid.report()["volunteers"]
    report = grid.report()
    if volunteers[crasher]["failed"] == 0:  # it died before it was given anything: nothing to count
        pytest.skip("the crashing volunteer was given no task before the product ended")
    crashes = [f for f in report["faults"]["faults"] if f["volunteer"] == crasher and f["kind"] == "crash"]
    assert crashes and "disconnected while processing" in crashes[0]["reason"], report["faults"]
    assert f"volunteer {crasher} disconnected while processing" in _scheduler_log(grid)


def test_a_genuinely_bad_task_still_errs_for_the_researcher(grid):
    """Operands whose shapes do not match: it fails on the volunteer, then on the lab worker too."""
    honest = grid.volunteer_names()
    before = grid.report()["volunteers"]
    key = ("matmul-" + "ab" * 16, 0, 0)
    dsk = insert_checks({
        ("source-" + "cd" * 16, 0): DataNode(("source-" + "cd" * 16, 0), np.ones((3, 4))),
        ("source-" + "ef" * 16, 0): DataNode(("source-" + "ef" * 16, 0), np.ones((5, 6))),
        key: CatalogTask(key, get("matmul"), TaskRef(("source-" + "cd" * 16, 0)), TaskRef(("source-" + "ef" * 16, 0))),
    })
    with pytest.raises(Exception) as info:
        grid.client.get(dsk, key)
    assert "mismatch" in str(info.value) or "shape" in str(info.value) or "align" in str(info.value), info.value
    report = grid.report()
    for name in honest:  # the task was bad, not the volunteer
        assert report["volunteers"][name]["failed"] == before.get(name, {}).get("failed", 0), report
    assert any(f["kind"] == "excused" for f in report["faults"]["faults"]), report["faults"]


def test_with_only_a_faulty_volunteer_the_lab_worker_computes(lonely):
    faulty = _faulty(lonely, "raise")
    report = _product(lonely, seed=4)
    assert report["volunteers"][faulty]["failed"] >= 1 and report["volunteers"][faulty]["accepted"] == 0
    assert report["faults"]["to_lab"] >= 1
    assert "goes to the lab worker" in _scheduler_log(lonely)


def test_a_volunteer_that_hands_back_every_task_rests_and_bounces_each_task_at_most_once(grid):
    """A volunteer answering every ``compute-task`` with ``reschedule`` (issue 29: about 4,080 bounces in one
    64-task product, counted nowhere): each bounce counts as a failure, the task goes elsewhere, and the
    bouncer rests after a few; the product is numpy's."""
    honest = grid.volunteer_names()
    before = grid.report()["volunteers"]
    bouncer = grid.add_volunteer(module="tests.hostile", extra_args=("--attack", "bounce"))
    report = _product(grid, seed=5)  # 64 block products
    bounces = report["faults"]["bounces"].get(bouncer, 0)
    assert 1 <= bounces <= 64, report["faults"]  # each task at most once (it is not given it again)
    volunteers = report["volunteers"]
    assert volunteers[bouncer]["accepted"] == 0 and volunteers[bouncer]["failed"] == bounces
    assert volunteers[bouncer]["cooldowns"] >= 1 and bouncer in report["faults"]["cooling"], report["faults"]
    assert any(f["kind"] == "bounce" and f["volunteer"] == bouncer for f in report["faults"]["faults"])
    for name in honest:  # the honest volunteer computed, and was not blamed
        assert volunteers[name]["accepted"] > before.get(name, {}).get("accepted", 0)
        assert volunteers[name]["failed"] == before.get(name, {}).get("failed", 0)
    assert f"volunteer {bouncer} handed back task" in _scheduler_log(grid)
    _retire(grid, bouncer)


def _product_when_done(node, seed: int, what: str):
    """The block product, numpy's numbers asserted; waited for as an event (a test that fails, not one
    that hangs, when the lab keeps it waiting)."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((N, N)), rng.standard_normal((N, N))
    dsk, keys, blocks = blocked_product_graph(a, b, BLOCK)
    futures = node.client.get(dsk, keys, sync=False)
    wait_for(lambda: all(f.done() for f in futures), what, timeout=300)
    results = node.client.gather(futures)
    c = assemble({k[1:]: r for k, r in zip(keys, results)}, (N, N), blocks)
    np.testing.assert_allclose(c, a @ b, rtol=1e-10, atol=1e-10)
    return node.report()


def test_tasks_held_past_their_deadline_are_reissued_though_their_holder_finishes_others(tmp_path):
    """Issue 29: the deadline was per volunteer, so finishing one task now and then kept the others held
    forever (the product unfinished after 8 deadlines, no late mark).  Now each task has its deadline."""
    import dask

    deadline, every = 4.0, 1.2
    with dask.config.set({"goblin.verification.deadline": deadline}), \
            LabNode.local(volunteers=1, state_dir=tmp_path / "lab") as lab:
        honest = lab.volunteer_names()
        holder = lab.add_volunteer(module="tests.hostile", nthreads=32,
                                   extra_args=("--attack", "hold", "--keep", "4", "--every", str(every)))
        report = _product_when_done(lab, seed=6, what="the product, with 4 of its tasks held by one volunteer")
        record = report["volunteers"][holder]
        # lateness resets its trust: what it holds now counts only the results accepted after its last
        # deadline (one it was finishing may land after it; its whole record would count every result)
        assert record["late"] >= 1 and record["trust"] < record["accepted"], record
        # its held tasks were reissued at their deadline, while it was still finishing others (one every
        # 1.2 s): not once it ran out of tasks to finish (a per-volunteer deadline waits for that)
        assert record["accepted"] <= deadline / every + 2, record
        assert report["reissued"] >= 4, report["reissued"]
        assert record["cooldowns"] >= 1, report["faults"]
        for name in honest:
            assert report["volunteers"][name]["late"] == 0 and report["volunteers"][name]["failed"] == 0
        assert f"volunteer {holder} missed its deadline" in _scheduler_log(lab)


def test_a_volunteer_task_with_no_volunteer_to_run_it_goes_to_the_lab_after_a_bounded_wait(tmp_path):
    """Before, a volunteer task on a lab with no volunteer waited in no-worker forever, silently."""
    import dask

    with dask.config.set({"goblin.faults.no-volunteer-wait": 1.0}), \
            LabNode.local(volunteers=0, state_dir=tmp_path / "lab") as lab:
        report = _product_when_done(lab, seed=7, what="the product, on a lab with no volunteer")
        assert report["faults"]["to_lab"] >= 64, report["faults"]  # every block product
        assert "goblin.faults.no-volunteer-wait" in _scheduler_log(lab)


# -- the plugin's bookkeeping, without processes ----------------------------------------


class _FakeWorker:
    def __init__(self, address):
        self.address, self.processing = address, set()


class _FakeTask:
    def __init__(self, key, resources):
        self.key, self.resource_restrictions = key, dict(resources)
        self.worker_restrictions = self.host_restrictions = None
        self.loose_restrictions, self.state, self.processing_on, self.priority = False, "waiting", None, ()


class _FakeScheduler:
    def __init__(self, workers):
        self.workers = {w.address: w for w in workers}
        self.stream_handlers = {"task-erred": lambda **msg: self.erred.append(msg), "reschedule": lambda **msg: None}
        self.erred, self.tasks, self.unrunnable, self.plugins = [], {}, {}, {}

    def valid_workers(self, ts):
        from goblin_dask.roles import VOLUNTEER_RESOURCE

        want = "vol" if VOLUNTEER_RESOURCE in ts.resource_restrictions else "lab"
        return {w for a, w in self.workers.items() if a.startswith(want)}

    async def remove_worker(self, address, **kwargs):
        return "OK"


class _FakeAdmission:
    def __init__(self, names):
        self.names = names

    def is_volunteer(self, address):
        return address.startswith("vol")

    def volunteers(self):
        return [a for a in self.names if a.startswith("vol")]


def _plugin(**kwargs):
    from scheduler_plugins.faults import FaultPlugin

    workers = [_FakeWorker(a) for a in ("vol-a", "vol-b", "lab")]
    sched = _FakeScheduler(workers)
    plugin = FaultPlugin(sched, _FakeAdmission({"vol-a": "alice", "vol-b": "bob", "lab": "lab-worker"}), **kwargs)
    return plugin, sched, {w.address: w for w in workers}


def test_short_text_makes_untrusted_text_one_printable_line():
    from scheduler_plugins.faults import short_text

    assert short_text("RuntimeError('x')\n\x1b[31m  boom\x00") == "RuntimeError('x') [31m boom"
    assert len(short_text("x" * 10_000)) == 200
    assert short_text(b"bytes \xff") == "bytes \ufffd" and short_text(None) == ""


def test_placement_skips_the_volunteers_a_task_failed_on_then_uses_the_lab():
    from goblin_dask.roles import LAB_RESOURCE, VOLUNTEER_RESOURCE

    plugin, sched, ws = _plugin(max_attempts=2, max_consecutive=10)
    ts = _FakeTask("unverified-matmul-00", {VOLUNTEER_RESOURCE: 1})
    assert plugin.valid_workers(ts) == {ws["vol-a"], ws["vol-b"]}
    plugin.failed_on[ts.key] = {"alice"}
    assert plugin.valid_workers(ts) == {ws["vol-b"]}
    plugin.failed_on[ts.key] = {"alice", "bob"}
    assert plugin.valid_workers(ts) == {ws["lab"]} and ts.resource_restrictions == {LAB_RESOURCE: 1}
    assert plugin.to_lab == 1
    # a running task is only asked about (work stealing): never moved
    running = _FakeTask("unverified-matmul-01", {VOLUNTEER_RESOURCE: 1})
    running.state, plugin.failed_on[running.key] = "processing", {"alice", "bob"}
    assert plugin.valid_workers(running) == set() and running.resource_restrictions == {VOLUNTEER_RESOURCE: 1}


def test_failures_in_a_row_cool_a_volunteer_down_and_a_success_resets_the_count():
    from goblin_dask.roles import VOLUNTEER_RESOURCE

    plugin, sched, ws = _plugin(max_consecutive=3, cooldown=60)
    plugin._blame("alice", "error", "k1", "boom")
    plugin._blame("alice", "error", "k2", "boom")
    plugin.transition("k3", "processing", "memory", worker="vol-a")  # a success
    assert plugin.in_row["alice"] == 0 and not plugin.is_cooling("alice")
    for i in range(3):
        plugin._blame("alice", "error", f"k{i}", "boom")
    assert plugin.is_cooling("alice") and 59 < plugin.report()["cooling"]["alice"] <= 60
    ts = _FakeTask("unverified-matmul-02", {VOLUNTEER_RESOURCE: 1})
    assert plugin.valid_workers(ts) == {ws["vol-b"]}  # alice rests
    plugin.cooling["alice"] = 0  # its cooldown is over
    for i in range(3):
        plugin._blame("alice", "error", f"k{i}", "boom")
    assert 119 < plugin.report()["cooling"]["alice"] <= 120  # the second one is twice as long
    plugin.cooling["bob"] = float("inf")
    assert plugin.valid_workers(ts) == {ws["lab"]}  # every volunteer rests: the lab computes it
    kinds = [f["kind"] for f in plugin.report()["faults"]]
    assert kinds.count("cooldown") == 2 and kinds.count("error") == 8


def test_a_failure_report_from_a_volunteer_never_reaches_the_scheduler_as_an_error():
    plugin, sched, ws = _plugin()
    plugin.handle_task_erred(key="unverified-x-00", stimulus_id="s", worker="vol-a", run_id=1,
                             exception=b"pickled", exception_text="boom")
    plugin.handle_task_erred(key=["unhashable"], stimulus_id="s", worker="vol-a", run_id=1)
    assert sched.erred == []  # not a task it runs: dropped, never forwarded
    plugin.handle_task_erred(key="lab-task", stimulus_id="s", worker="lab", run_id=1, exception_text="bad")
    assert [m["key"] for m in sched.erred] == ["lab-task"]  # the lab worker's errors go on as usual


def test_an_honest_volunteer_reporting_a_task_after_it_was_taken_back_is_neither_banned_nor_failed(tmp_path):
    """Issue 29, seen once: an honest volunteer possibly banned for a late ``task-finished`` of a task the lab had
    taken back.  Here one volunteer's every report arrives after its task's deadline (a slow link: it computes
    honestly, reports 3 s late, deadline 2 s), so the lab reissues the task and the report comes for a task
    computing elsewhere, done, or forgotten; meanwhile another volunteer is banned mid-product.  The late
    reporter is marked late (it missed its deadlines) but is never banned, refused, or counted as failing."""
    import dask

    deadline, delay = 2.0, 3.0
    trigger = tmp_path / "ban-now"
    with dask.config.set({"goblin.verification.deadline": deadline, "goblin.faults.cooldown": 1.0}), \
            LabNode.local(volunteers=1, state_dir=tmp_path / "lab") as lab:
        [honest] = lab.volunteer_names()
        slow = lab.add_volunteer(module="tests.hostile", extra_args=("--attack", "late-report", "--every", str(delay)))
        pauser = lab.add_volunteer(module="tests.hostile", extra_args=(
            "--attack", "pause-lab-worker", "--lab", lab.lab_worker_address(), "--trigger", str(trigger)))
        rng = np.random.default_rng(9)
        a, b = rng.standard_normal((N, N)), rng.standard_normal((N, N))
        dsk, keys, blocks = blocked_product_graph(a, b, BLOCK)
        futures = lab.client.get(dsk, keys, sync=False)
        wait_for(lambda: lab.report()["reissued"] >= 1 or all(f.done() for f in futures),
                 "a task of the late reporter to be reissued", timeout=300)
        trigger.touch()  # the pauser is banned now, mid-product
        wait_for(lambda: all(f.done() for f in futures), "the product", timeout=300)
        c = assemble({k[1:]: r for k, r in zip(keys, lab.client.gather(futures))}, (N, N), blocks)
        np.testing.assert_allclose(c, a @ b, rtol=1e-10, atol=1e-10)
        wait_for(lambda: any(b["name"] == pauser for b in lab.report()["bans"]), "the pauser to be banned")
        slow_log = lambda: read_log(lab._log_path(slow))  # noqa: E731
        wait_for(lambda: slow_log().count("late-report: task-finished of") >= 2,
                 "the late reporter to send its late reports")
        report = lab.report()
        record = report["volunteers"][slow]
        assert report["reissued"] >= 1 and record["late"] >= 1, (report["reissued"], record)
        assert not record["banned"] and record["failed"] == 0 and record["rejected"] == 0, record
        assert [b for b in report["bans"] if b["name"] != pauser] == [], report["bans"]
        assert not [r for r in report["refusals"] if r.get("name") in (slow, honest)], report["refusals"]
        assert slow in lab.volunteer_names() and lab.processes[slow].poll() is None
        assert not [f for f in report["faults"]["faults"] if f["volunteer"] == slow and f["kind"] != "late"
                    and f["kind"] != "cooldown"], report["faults"]
        assert report["volunteers"][honest]["failed"] == 0 and not report["volunteers"][honest]["banned"]
