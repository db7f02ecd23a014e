"""Issue 19, volunteers keep what they already hold (:mod:`goblin_dask.volunteer.panel_cache`), on real grids.

A volunteer keeps the lab data blocks it received in a bounded cache in its memory; later tasks
(of the same computation or a later one) read them from there, and placement prefers it for them
(:mod:`scheduler_plugins.volunteer_cache`).  Its copy is not trusted: a tampered cached panel
gives a rejected result.  What each volunteer's cache did is read from its own status page
(``/api/status``, ``cache``), as the volunteer sees it.
"""

from __future__ import annotations

import functools
import json
import uuid

import dask
import numpy as np
import pytest

import goblin_dask.array as ga
from goblin_dask.node.local import LabNode
from goblin_dask.volunteer.panel_cache import HINT_OP, PanelCache, cacheable_key
from goblin_dask.validation.checks import unverified_key
from scheduler_plugins.volunteer_cache import VolunteerCachePlugin
from tests.conftest import volunteer_cache_stats as _cache
from tests.conftest import wait_for
from tests.inprocess import assemble, matrices, product_graph, run_lab

RNG = np.random.default_rng(1919)
N, CHUNK = 768, 256  # the product is cut in steps of 768 x 192 panels (1.2 MB), each on a volunteer


def _inputs():
    a, b = RNG.standard_normal((N, N)), RNG.standard_normal((N, N))
    return a, b, ga.from_array(a, chunks=CHUNK) @ ga.from_array(b, chunks=CHUNK)


def _ban_of(node, name: str) -> dict | None:
    return next((b for b in node.report()["bans"] if b["name"] == name), None)


def test_a_second_compute_reads_the_volunteers_cache(tmp_path):
    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, node.client.as_current():
        name = node.add_volunteer()
        a, b, product = _inputs()
        first = product.compute()
        once = _cache(node, name)
        second = product.compute()
        twice = _cache(node, name)
        # smaller product steps (4 x 4 output blocks): a panel comes back to later tasks of the same computation
        with dask.config.set({"goblin.product.volunteer-memory": "8MB"}):
            c, d, blocked = _inputs()
            assert len(blocked.chunks[0]) > 1 and len(blocked.chunks[1]) > 1, blocked.chunks
        third = blocked.compute()
        fresh = _cache(node, name)
        report = node.report()
    np.testing.assert_allclose(third, c @ d, rtol=1e-12, atol=1e-10)
    assert fresh["hits"] > twice["hits"], (twice, fresh)  # new arrays: these hits are reuse within the computation
    ref = a @ b
    np.testing.assert_allclose(first, ref, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(second, ref, rtol=1e-12, atol=1e-10)
    assert once["fetched_bytes"] > 0 and once["keys"] > 0, once
    assert twice["hits"] - once["hits"] >= once["keys"], (once, twice)  # every panel it kept, read again
    fetched_again = twice["fetched_bytes"] - once["fetched_bytes"]
    # the panels it keeps do not travel again (the product chain's partial sums do)
    assert fetched_again <= once["fetched_bytes"] - once["bytes"], (once, twice)
    assert twice["bytes"] <= twice["limit"] and twice["evicted"] == 0, twice
    assert report["rejected"] == 0 and report["accepted"] > 0, report


def test_placement_prefers_the_volunteer_holding_the_inputs(tmp_path):
    """In-process node (real scheduler, plugins and volunteer workers): once alice says she holds a product's
    blocks, her estimated transfer for each step is only what she lacks, and distributed's choice is her."""
    from distributed.scheduler import decide_worker

    async def body(lab):
        s = lab.scheduler
        plugin = s.plugins[VolunteerCachePlugin.name]
        a, b = matrices(19, n=128)
        dsk, keys, blocks = product_graph(a, b, 64, lab_arrays=True)
        steps = [unverified_key(k) for k in keys]
        sources = {k for k in dsk if cacheable_key(k)}
        assert len(sources) == 8
        async with lab.client() as client:
            first = await client.gather(client.get(dsk, keys, sync=False))  # alice alone: she gets every block
            alice = lab.address_of("alice")
            await lab.wait_for(lambda: sources <= plugin.held.get(alice, set()))
            bob = (await lab.add_volunteer("bob")).address
            for name in ("alice", "bob"):  # no task starts: their placement can be looked at
                lab.workers[name].goblin_pause()
            await lab.wait_for(lambda: all(s.workers[w].status.name == "paused" for w in (alice, bob)))
            futures = client.get(dsk, keys, sync=False)
            await lab.wait_for(lambda: all(k in s.tasks and s.tasks[k].state == "no-worker" for k in steps))
            ws_a, ws_b = s.workers[alice], s.workers[bob]
            for key in steps:
                ts = s.tasks[key]
                held = sum(d.get_nbytes() for d in ts.dependencies if d.key in sources)
                assert held > 0
                assert s.get_comm_cost(ts, ws_a) == pytest.approx(s.get_comm_cost(ts, ws_b) - held / s.bandwidth)
                assert decide_worker(ts, {ws_a, ws_b}, {ws_a, ws_b}, functools.partial(s.worker_objective, ts)) is ws_a
            for name in ("alice", "bob"):
                lab.workers[name].goblin_resume()
            second = await client.gather(futures)
        np.testing.assert_allclose(assemble(first, keys, blocks), a @ b, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(assemble(second, keys, blocks), a @ b, rtol=1e-12, atol=1e-12)
        assert lab.workers["alice"].goblin_cache.hits > 0
        # a volunteer that goes away is forgotten
        await lab.workers["bob"].close()
        await lab.wait_for(lambda: bob not in s.workers)
        assert bob not in plugin.held

    run_lab(tmp_path, body, volunteers=("alice",))


def test_a_result_the_lab_holds_is_read_again_where_it_was_sent_and_let_go_with_the_labs(tmp_path):
    """Issue 28, in-process node with three volunteers: a task reading ``k`` (a checked product the lab holds,
    no lab data) goes to a volunteer, which keeps ``k`` while the lab does.  The next task reading ``k`` costs
    that volunteer only what it lacks, so distributed's choice is it (not the two others), and it reads ``k``
    from its memory.  When the lab lets ``k`` go, the lab node tells it to (``free-keys``): a value of ``k``
    computed again may differ in rounding, so an earlier one is never read."""
    from dask._task_spec import DataNode, TaskRef
    from distributed.scheduler import decide_worker

    from goblin_dask.ops import CatalogTask, get
    from goblin_dask.validation.checks import insert_checks

    async def body(lab):
        s = lab.scheduler
        plugin = s.plugins[VolunteerCachePlugin.name]
        a, b = matrices(28, n=96)
        c, d = matrices(29, n=96)
        first, keys, _ = product_graph(a, b, 96)  # one block: k = a @ b, checked by the lab
        k = keys[0]
        names = ("alice", "bob", "carol")

        def reading_k(other: np.ndarray):
            key = (f"matmul-{uuid.uuid4().hex}", 0)
            return key, insert_checks({key: CatalogTask(key, get("matmul"), TaskRef(k), DataNode(None, other))})

        async with lab.client() as client:
            (held,) = client.get(first, [k], sync=False)
            await held
            t1, graph = reading_k(c)
            (f1,) = client.get(graph, [t1], sync=False)
            one = await f1
            (holder,) = [n for n in names if lab.address_of(n) in plugin.lent.get(k, ())]
            caches = {n: lab.workers[n].goblin_cache for n in names}
            before = {n: (caches[n].held_hits, caches[n].fetched_bytes) for n in names}
            for name in names:  # no task starts: its placement can be looked at
                lab.workers[name].goblin_pause()
            addresses = [lab.address_of(n) for n in names]
            await lab.wait_for(lambda: all(s.workers[w].status.name == "paused" for w in addresses))
            t2, graph = reading_k(d)
            (f2,) = client.get(graph, [t2], sync=False)
            step = unverified_key(t2)
            await lab.wait_for(lambda: step in s.tasks and s.tasks[step].state == "no-worker")
            ts, here = s.tasks[step], s.workers[lab.address_of(holder)]
            saved = s.tasks[k].get_nbytes() / s.bandwidth
            for other in (s.workers[w] for w in addresses if w != here.address):
                assert s.get_comm_cost(ts, here) == pytest.approx(s.get_comm_cost(ts, other) - saved)
            everyone = {s.workers[w] for w in addresses}
            assert decide_worker(ts, everyone, everyone, functools.partial(s.worker_objective, ts)) is here
            # (the first to resume takes it, as the only running volunteer: the holder, as decided above)
            for name in sorted(names, key=lambda n: n != holder):
                lab.workers[name].goblin_resume()
            two = await f2
            # the holder ran it from its copy; the others received nothing
            assert caches[holder].held_hits == before[holder][0] + 1
            assert all(caches[n].fetched_bytes == before[n][1] for n in names)
            assert k in caches[holder]
            del held, f1, f2
            await lab.wait_for(lambda: k not in s.tasks)
            await lab.wait_for(lambda: k not in caches[holder])  # the lab node said so
            assert k not in plugin.lent
            assert caches[holder].stats()["released"] == 1
        np.testing.assert_allclose(one, (a @ b) @ c, rtol=1e-10)
        np.testing.assert_allclose(two, (a @ b) @ d, rtol=1e-10)
        assert lab.ledger.report()["rejected"] == 0

    run_lab(tmp_path, body, volunteers=("alice", "bob", "carol"))


def test_the_cache_stays_under_its_limit_and_evicts_the_oldest(tmp_path, monkeypatch):
    limit = 2_500_000  # two panels fit, a third evicts the oldest
    monkeypatch.setenv("DASK_GOBLIN__VOLUNTEER__CACHE_LIMIT", str(limit))
    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, node.client.as_current():
        name = node.add_volunteer()
        a, b, product = _inputs()
        got = product.compute()
        got_again = product.compute()
        stats = _cache(node, name)
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(got_again, a @ b, rtol=1e-12, atol=1e-10)
    assert stats["limit"] == limit, stats
    assert stats["peak_bytes"] <= limit and stats["bytes"] <= limit, stats
    assert stats["keys"] <= 2 and stats["evicted"] > 0, stats


def test_the_cache_is_least_recently_used_and_bounded_in_bytes():
    """The cache itself (no grid): the oldest panel goes first, a read makes a panel the newest."""
    keys = [(f"source-{'0' * 31}{i}", 0, 0) for i in range(4)]
    panel = np.zeros((64, 64))
    cache = PanelCache(int(2.5 * panel.nbytes))
    assert cache.put(keys[0], panel, panel.nbytes) and cache.put(keys[1], panel + 1, panel.nbytes)
    assert cache.get(keys[0], panel.nbytes) is not None  # keys[0] is now the newest
    assert cache.put(keys[2], panel + 2, panel.nbytes)
    assert list(cache.entries) == [keys[0], keys[2]] and cache.evicted == 1 and cache.bytes == 2 * panel.nbytes
    assert cache.get(keys[1], panel.nbytes) is None  # evicted
    assert cache.get(keys[2], panel.nbytes + 8) is None  # the scheduler's size disagrees: not served
    hint = cache.take_hint()
    assert hint["op"] == HINT_OP and set(hint["add"]) == {keys[0], keys[2]} and hint["remove"] == []
    cache.put(keys[3], panel + 3, panel.nbytes)  # evicts keys[0], which the lab was told of
    assert cache.take_hint() == {"op": HINT_OP, "add": [keys[3]], "remove": [keys[0]]}
    assert cache.take_hint() is None
    # only blocks of the lab's data: their names are their content
    assert not cache.put(("matmul-" + "0" * 32, 0, 0), panel, panel.nbytes)
    assert not cache.put("source-" + "0" * 32, panel, panel.nbytes)
    assert not PanelCache(panel.nbytes - 1).put(keys[0], panel, panel.nbytes)  # larger than the whole cache
    assert cacheable_key(keys[0]) and not cacheable_key((keys[0][0], -1)) and not cacheable_key((keys[0][0], True))
    # a panel received in one message with other keys is a view into that message: kept as a copy of its own
    message = bytearray(4 * panel.nbytes)
    view = np.frombuffer(memoryview(message)[panel.nbytes:2 * panel.nbytes], dtype=panel.dtype).reshape(panel.shape)
    assert cache.put(keys[1], view, panel.nbytes)
    kept = cache.entries[keys[1]][0]
    assert kept.base is None and not np.shares_memory(kept, view) and cache.bytes <= cache.limit


def test_a_result_the_lab_holds_is_kept_until_the_lab_lets_it_go_and_named_in_no_hint():
    """The cache itself: an input that is no lab data block (a result the lab accepted) is kept only when the
    volunteer is told it is held, is never named in a hint (the lab node knows what it sent), and goes at the
    lab's release, which leaves the lab's data blocks (their name is their content)."""
    block, result = ("source-" + "0" * 32, 0, 0), ("program-" + "1" * 32, 0)
    panel = np.ones((32, 32))
    cache = PanelCache(int(2.5 * panel.nbytes))
    assert not cache.put(result, panel, panel.nbytes)
    assert cache.put(result, panel, panel.nbytes, held=True) and cache.put(block, panel + 1, panel.nbytes)
    assert cache.take_hint() == {"op": HINT_OP, "add": [block], "remove": []}
    np.testing.assert_array_equal(cache.get(result, panel.nbytes), panel)
    assert cache.stats()["held"] == 1 and cache.held_hits == 1
    assert cache.release([result, block, ("program-" + "2" * 32, 0)]) == 1
    assert result not in cache and block in cache and cache.bytes == panel.nbytes
    assert cache.get(result, panel.nbytes) is None and cache.stats()["released"] == 1
    cache.put(result, panel, panel.nbytes, held=True)
    cache.put(("source-" + "2" * 32, 0, 0), panel, panel.nbytes)  # evicts the block, then the held result
    cache.put(("source-" + "3" * 32, 0, 0), panel, panel.nbytes)
    assert result not in cache and all(k[0].startswith("source-") for k in cache.entries)
    hint = cache.take_hint()
    assert hint["remove"] == [block] and result not in hint["add"]  # a held result's eviction is no news


def test_a_tampered_cached_panel_is_a_rejected_result(tmp_path):
    trigger = tmp_path / f"tamper-{uuid.uuid4().hex}"
    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, node.client.as_current():
        tamperer = node.add_volunteer(module="tests.cache_volunteers",
                                      extra_args=("--attack", "tamper", "--trigger", str(trigger)))
        a, b, product = _inputs()
        first = product.compute()  # honest: its cache fills
        assert node.report()["rejected"] == 0
        honest = node.add_volunteer()
        trigger.touch()  # from now on, what it serves itself from its cache is tampered
        second = product.compute()
        wait_for(lambda: _ban_of(node, tamperer) is not None, f"{tamperer} to be banned")
        report = node.report()
    ref = a @ b
    np.testing.assert_allclose(first, ref, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(second, ref, rtol=1e-12, atol=1e-10)  # the lab's own results replaced the wrong ones
    mine = report["volunteers"][tamperer]
    assert mine["rejected"] >= 1 and mine["banned"], mine
    assert any(r["volunteer"] == tamperer and r["method"] == "freivalds" for r in report["rejections"]), report
    assert not report["volunteers"][honest]["banned"] and report["volunteers"][honest]["rejected"] == 0, report


def test_a_volunteer_announcing_blocks_it_was_never_sent_attracts_nothing_and_stalls_into_its_deadlines(tmp_path):
    """Issue 29: a volunteer named as cached every block of each lab array it saw one block of (1024 keys, the
    names follow from one), so that it looked cheapest for every task reading them, and sat on what it got.
    Now only blocks the lab sent it count (at most MAX_HINT_KEYS); what it holds is reissued at the per-task
    deadline, and the researcher's product is numpy's beside an honest volunteer."""
    from tests.cache_volunteers import LURE_SPAN

    with dask.config.set({"goblin.verification.deadline": 5.0}), \
            LabNode.local(volunteers=1, state_dir=tmp_path / "lab", dashboard=False) as node, node.client.as_current():
        [honest] = node.volunteer_names()
        lure = node.add_volunteer(module="tests.cache_volunteers", extra_args=("--attack", "lure"))
        a, b, product = _inputs()
        got = product.compute()
        report = node.report()
        record = node.state_dir / f"lure-{node.processes[lure].pid}.json"
        sent = {tuple(k) for k in json.loads(record.read_text())} if record.exists() else set()
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)
    hints = report["cache_hints"].get(lure, {"believed": 0, "unsent": 0})
    assert sent and hints["believed"] <= len(sent), (hints, sent)  # only what the lab sent it counts ...
    assert hints["unsent"] >= LURE_SPAN**2 - len(sent), (hints, sent)  # ... of all it named
    assert report["volunteers"][lure]["late"] >= 1 and report["reissued"] >= 1, report["volunteers"]
    mine = report["volunteers"][honest]
    assert mine["accepted"] > 0 and mine["rejected"] == 0 and not mine["banned"], mine


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """A lab node with one honest volunteer; each malformed-hint test adds its hostile one."""
    with LabNode.local(volunteers=1, state_dir=tmp_path_factory.mktemp("cache-hints") / "lab", dashboard=False) as node:
        yield node


@pytest.mark.parametrize("attack", ["bad-hint-key", "bad-hint-many", "bad-hint-field", "bad-hint-type"])
def test_a_malformed_cache_hint_is_refused(grid, tmp_path, attack):
    node, trigger = grid, tmp_path / f"go-{uuid.uuid4().hex}"
    with node.client.as_current():
        hostile = node.add_volunteer(module="tests.cache_volunteers",
                                     extra_args=("--attack", attack, "--trigger", str(trigger)))
        trigger.touch()
        wait_for(lambda: _ban_of(node, hostile) is not None, f"{hostile} to be banned")
        wait_for(lambda: hostile not in node.volunteer_names(), f"{hostile} to be disconnected")
        ban = _ban_of(node, hostile)
        a, b, product = _inputs()
        got = product.compute()  # the scheduler goes on, with the honest volunteer
        report = node.report()
        honest = node.volunteer_names()
    assert HINT_OP in ban["reason"], ban
    assert any(r.get("name") == hostile and r["op"] == HINT_OP for r in report["refusals"]), report["refusals"]
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)
    assert report["rejected"] == 0 and honest and not any(report["volunteers"][n]["banned"] for n in honest), report
    assert [b["name"] for b in report["bans"]].count(hostile) == 1
