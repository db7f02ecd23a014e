"""Issue 19, data moves once: an in-memory array goes to the lab worker once, by content.

With a client, ``ga.from_array`` scatters the array whole to the lab worker under a key
named by its content and the graph's blocks slice that copy there; computes send a
reference, not the numbers.  These run on real grids (lab node, TLS, volunteer processes).
"""

from __future__ import annotations

import gc
import pickle
import warnings

import dask
import numpy as np
from dask._task_spec import DataNode, Task

import goblin_dask.array as ga
from goblin_dask.array import sources
from tests.conftest import wait_for

RNG = np.random.default_rng(19)


def _lab_address(node) -> str:
    return node.lab_worker_address()


def _spy_scatter(client, monkeypatch) -> list:
    """Record every scatter the client makes (the key names of what it sent)."""
    sent: list = []
    original = client.scatter

    def spy(data, *args, **kwargs):
        sent.append(list(data) if isinstance(data, dict) else type(data).__name__)
        return original(data, *args, **kwargs)

    monkeypatch.setattr(client, "scatter", spy)
    return sent


def _graph_bytes(x) -> int:
    return len(pickle.dumps(dict(x.__dask_graph__()), protocol=5))


def test_a_large_array_is_sent_once_and_reused(lab, monkeypatch):
    a = RNG.standard_normal((2048, 4096))  # 64 MiB: embedded, it would be "Sending large graph of size 64 MiB"
    sent = _spy_scatter(lab.client, monkeypatch)
    before = lab.report()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = ga.from_array(a, chunks=1024)
        expr = x @ x[:512].T  # volunteers compute the product blocks, the lab checks them
        first = expr.compute()
        second = expr.compute()
        # another from_array of equal content (another object, other chunks) reuses the lab's copy
        y = ga.from_array(a.copy(), chunks=(512, 2048))
        third = (y[:512] @ y.T).compute()
    assert not [w for w in caught if "large graph" in str(w.message)], [str(w.message) for w in caught]
    assert len(sent) == 1, sent
    assert y._source.copy is x._source.copy
    assert _graph_bytes(expr) < 2**20  # references and slices, not the numbers
    ref = a @ a[:512].T
    np.testing.assert_allclose(first, ref, rtol=1e-12, atol=1e-9)
    np.testing.assert_array_equal(second, first)
    np.testing.assert_allclose(third, ref.T, rtol=1e-12, atol=1e-9)
    after = lab.report()
    assert after["accepted"] > before["accepted"] and after["rejected"] == before["rejected"]
    assert after["by_method"].get("freivalds", 0) > before["by_method"].get("freivalds", 0)
    # the copy is on the lab worker and nowhere else
    key = x._source.copy.key
    assert set(lab.client.who_has(x._source.copy)[key]) == {_lab_address(lab)}


def test_the_copy_is_released_with_the_last_graph_that_reads_it(lab):
    a = RNG.standard_normal((512, 512))
    x = ga.from_array(a, chunks=256)
    z = x @ x.T
    del x  # the derived graph alone keeps the copy
    gc.collect()
    np.testing.assert_allclose(z.compute(), a @ a.T, rtol=1e-12, atol=1e-10)
    task = next(v for v in dict(z.__dask_graph__()).values() if isinstance(v, Task) and v.func is sources.lab_block)
    key = task.args[0].key
    lab_worker = _lab_address(lab)
    assert key in lab.client.has_what()[lab_worker]
    del z, task
    gc.collect()
    wait_for(lambda: key not in lab.client.has_what()[lab_worker], "the lab worker to drop the released copy")


def test_local_schedulers_and_small_arrays_keep_working_beside_a_client(lab, monkeypatch):
    sent = _spy_scatter(lab.client, monkeypatch)
    a = RNG.standard_normal((512, 512))
    x = ga.from_array(a, chunks=256)  # uploaded: a client is the default
    assert x._source.copy is not None
    np.testing.assert_allclose((x @ x.T).compute(scheduler="sync"), a @ a.T, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose((x + 1).compute(scheduler="threads"), a + 1)
    small = RNG.standard_normal((64, 64))  # under UPLOAD_MIN_BYTES: rides in the graph
    s = ga.from_array(small, chunks=32)
    assert s._source.copy is None
    np.testing.assert_allclose((s @ s).compute(), small @ small, rtol=1e-12, atol=1e-12)
    with dask.config.set(scheduler="sync"):  # no distributed scheduler: nothing is uploaded
        local = ga.from_array(a, chunks=256)
        assert local._source.copy is None
        assert all(isinstance(v.args[0], DataNode) for v in dict(local.__dask_graph__()).values())
        np.testing.assert_array_equal(local.compute(), a)
    assert len(sent) == 1, sent


def test_content_hash_tells_content_dtype_shape_and_order_apart():
    a = np.arange(24, dtype="f8").reshape(4, 6)
    h = sources.content_hash(a)
    assert len(h) == 32 and h == sources.content_hash(a.copy())
    others = [a.reshape(6, 4), a.astype("f4"), a.view("i8"), np.asfortranarray(a), a[:, ::2], a + 0.5]
    assert len({h, *(sources.content_hash(o) for o in others)}) == 1 + len(others)
    assert sources.content_hash(a[:, ::2]) == sources.content_hash(np.ascontiguousarray(a[:, ::2]))


def test_a_curious_volunteer_gets_blocks_of_an_in_memory_array_never_the_copy(tmp_path, monkeypatch):
    """The whole array goes to the lab worker; a volunteer receives only its tasks' blocks."""
    from goblin_dask.node.local import LabNode
    from tests.test_minimization import BLOCK_PATIENTS, BLOCK_VISITS, N_PATIENTS, N_VISITS, VOLUNTEER_MEMORY, _pieces

    monkeypatch.setattr(sources, "UPLOAD_MIN_BYTES", 0)  # the table is small; upload it anyway
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING", "False")  # blocks sent = blocks computed
    rng = np.random.default_rng(20261204)
    heart = 60 + 12 * rng.standard_normal((N_PATIENTS, N_VISITS))
    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, \
            node.client.as_current(), dask.config.set({"goblin.product.volunteer-memory": VOLUNTEER_MEMORY}):
        curious = node.add_volunteer(module="tests.curious")
        node.add_volunteer()
        record_path = node.state_dir / f"received-{node.processes[curious].pid}.bin"
        x = ga.from_array(heart, chunks=(BLOCK_PATIENTS, BLOCK_VISITS))
        assert x._source.copy is not None
        key = x._source.copy.key
        gram = x.T @ x
        assert gram.chunks == ((BLOCK_VISITS,) * 2,) * 2
        got = gram.compute()
        again = gram.compute()
        assert set(node.client.who_has(x._source.copy)[key]) == {node.lab_worker_address()}
        report = node.report()

    np.testing.assert_allclose(got, heart.T @ heart, rtol=1e-12)
    np.testing.assert_array_equal(again, got)
    mine = report["volunteers"][curious]
    assert mine["accepted"] >= 1 and mine["rejected"] == 0, report
    assert report["rejected"] == 0 and report["by_method"].get("freivalds", 0) == report["accepted"]
    record = record_path.read_bytes()
    assert b"compute-task" in record and b"matmul-" in record
    assert key[0].encode() not in record  # not even the copy's name
    block = BLOCK_PATIENTS * BLOCK_VISITS
    seen = _pieces(record, heart)
    assert seen["distinct"] > 0
    assert seen["piece"] <= block, seen
    assert seen["run_c"] <= BLOCK_VISITS and seen["run_f"] <= BLOCK_VISITS, seen
    assert seen["total"] <= mine["accepted"] * 2 * block, (seen, mine)
    assert heart.tobytes() not in record and heart.T.tobytes() not in record
