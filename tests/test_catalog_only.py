"""Catalog-only execution: every path to run code on a volunteer is refused, and leaves no trace.

Two sides: the lab node keeps non-catalog work off volunteers, and a volunteer holds the
line by itself against a compromised node (a plain dask scheduler sending it anything).
"""

from __future__ import annotations

import os
import pickle

import dask.array as da
import numpy as np
import pytest
from dask._task_spec import Task
from distributed import WorkerPlugin

from goblin_dask.ops import CatalogTask, get, task_violation
from goblin_dask.safe_pickle import RefusedPickle, safe_loads
from tests.conftest import read_log, wait_for


class Evil:
    """An argument whose unpickling runs a shell command (it marks only a volunteer process)."""

    def __init__(self, marker, only_in_volunteer=False):
        self.marker = str(marker)
        self.only_in_volunteer = only_in_volunteer

    def __reduce__(self):
        cmd = f"touch {self.marker}"
        if self.only_in_volunteer:
            cmd = f"grep -q goblin_dask.volunteer /proc/$PPID/cmdline && {cmd}"
        return (os.system, (cmd,))


def send_compute_task(dask_scheduler, worker, marker):
    """Run on a compromised scheduler: send a volunteer a task whose pickle runs code."""
    from distributed.protocol.serialize import ToPickle

    key = "rogue-task"
    task = CatalogTask(key, get("matmul"), Evil(marker, only_in_volunteer=True), np.ones((2, 2)))
    dask_scheduler.stream_comms[worker].send({
        "op": "compute-task", "key": key, "run_id": 1, "priority": (0,), "stimulus_id": "rogue",
        "who_has": {}, "nbytes": {}, "run_spec": ToPickle(task), "resource_restrictions": {},
        "actor": False, "annotations": {}, "span_id": None,
    })


class EvilPlugin(WorkerPlugin):
    def __init__(self, marker):
        self.marker = str(marker)

    def setup(self, worker):
        os.system(f"touch {self.marker}")


def touch(marker):
    os.system(f"touch {marker}")
    return os.getpid()


# -- the allow-list itself -----------------------------------------------------------


def test_safe_unpickler_refuses_code_and_accepts_plain_data(tmp_path):
    marker = tmp_path / "pwned"
    for obj in [Evil(marker), os.system, Task("k", os.system, "true"), np.array([Evil(marker)], dtype=object)]:
        with pytest.raises(RefusedPickle):
            safe_loads(pickle.dumps(obj, protocol=5))
    assert not marker.exists()
    task = CatalogTask(("k", 0), get("matmul"), np.ones((2, 3)), np.ones((3, 2)))
    loaded = safe_loads(pickle.dumps(task, protocol=5))
    assert loaded.func is get("matmul") and task_violation(loaded) is None
    np.testing.assert_array_equal(loaded(), np.full((2, 2), 3.0))
    for value in [np.arange(5.0), np.float32(2), np.dtype("int16"), (1, slice(0, 3), None, 2.5), 3 + 1j]:
        assert repr(safe_loads(pickle.dumps(value, protocol=5))) == repr(value)


def test_volunteer_unpickler_does_not_load_lab_only_ops():
    """Ops checked by recomputation run on the lab worker; a volunteer's catalog leaves them out."""
    from goblin_dask.ops import CatalogError

    for name in ("transpose", "equal", "argmax", "zeros"):
        with pytest.raises(CatalogError, match="lab worker only"):
            safe_loads(pickle.dumps(CatalogTask(("k", 0), get(name), np.ones((2, 2))), protocol=5))
    assert safe_loads(pickle.dumps(get("exp"), protocol=5)) is get("exp")


def test_task_violation_names_the_callable_and_the_operand():
    assert "posix.system" in task_violation(Task("k", os.system, "true"))
    why = task_violation(CatalogTask("k", get("matmul"), np.array(["a"], dtype=object), np.ones(1)))
    assert "operand 0" in why and "object" in why
    why = task_violation(CatalogTask("k", get("matmul"), np.zeros(2, dtype=[("name", "f8")]), np.ones(1)))
    assert "operand 0" in why


# -- through the lab node ------------------------------------------------------------


def test_pinned_non_catalog_task_is_refused_to_the_researcher(lab, tmp_path):
    marker = tmp_path / "pwned"
    volunteer = next(iter(lab.volunteer_addresses().values()))
    fut = lab.client.submit(touch, marker, workers=[volunteer], pure=False)
    with pytest.raises(PermissionError, match="posix.system|touch|not a catalog operation"):
        fut.result()
    assert not marker.exists()


def test_researcher_functions_run_on_the_lab_worker_only(lab):
    lab_pid = lab.client.run(os.getpid)[lab.lab_worker_address()]
    pids = lab.client.gather(lab.client.map(lambda i: os.getpid(), range(8), pure=False))
    assert set(pids) == {lab_pid}
    x = da.ones(8, chunks=2).map_blocks(lambda b: b * 0 + os.getpid())
    assert set(x.compute().tolist()) == {lab_pid}


def test_client_run_and_plugins_cannot_reach_volunteers(lab, tmp_path):
    marker = tmp_path / "pwned"
    volunteer = next(iter(lab.volunteer_addresses().values()))
    assert set(lab.client.run(os.getpid)) == {lab.lab_worker_address()}
    with pytest.raises(PermissionError, match="volunteer"):
        lab.client.run(touch, marker, workers=[volunteer])
    with pytest.raises(PermissionError, match="plugin"):
        lab.client.register_plugin(EvilPlugin(marker))
    with pytest.raises(PermissionError):
        lab.client.run_on_scheduler(touch, marker)
    assert not marker.exists()


def test_scatter_lands_on_the_lab_worker(lab):
    fut = lab.client.scatter(np.arange(10.0))
    assert set(lab.client.who_has([fut])[fut.key]) == {lab.lab_worker_address()}


# -- a volunteer alone against a compromised node ----------------------------------


def _refusals(log):
    return read_log(log).count("refuse")


def test_volunteer_refuses_a_task_calling_os_system(rogue_node):
    client, volunteer, log, marker, proc = rogue_node
    before = _refusals(log)
    client.submit(touch, marker, workers=[volunteer], pure=False)
    wait_for(lambda: _refusals(log) > before, "the volunteer to refuse the task")
    assert not marker.exists()


def test_volunteer_refuses_client_run(rogue_node):
    client, volunteer, log, marker, proc = rogue_node
    with pytest.raises(Exception, match="run"):
        client.run(touch, marker, workers=[volunteer])
    assert not marker.exists()
    assert proc.poll() is None


def test_volunteer_refuses_worker_plugins(rogue_node):
    client, volunteer, log, marker, proc = rogue_node
    try:
        client.register_plugin(EvilPlugin(marker))
    except Exception:
        pass  # the rogue node reports the volunteer's refusal, or not: either way nothing ran
    wait_for(lambda: "plugin" in read_log(log) or proc.poll() is not None, "the volunteer to answer the plugin")
    assert not marker.exists()


def test_volunteer_refuses_an_argument_whose_reduce_runs_code(rogue_node):
    client, volunteer, log, marker, proc = rogue_node
    before = _refusals(log)
    client.run_on_scheduler(send_compute_task, worker=volunteer, marker=str(marker))
    wait_for(lambda: _refusals(log) > before, "the volunteer to refuse the pickle")
    assert "posix.system" in read_log(log)
    assert not marker.exists()


def test_volunteer_refuses_map_blocks_with_a_lambda(rogue_node):
    client, volunteer, log, marker, proc = rogue_node
    before = _refusals(log)
    cmd = f"grep -q goblin_dask.volunteer /proc/$PPID/cmdline && touch {marker}"
    # (map_blocks also calls the lambda once in the client, to infer meta: hence the grep)
    x = da.ones(4, chunks=2).map_blocks(lambda b: b + os.system(cmd), dtype=float, meta=np.ones(0))
    fut = client.compute(x, workers=[volunteer])
    wait_for(lambda: _refusals(log) > before, "the volunteer to refuse map_blocks")
    assert not marker.exists()
    del fut


def test_volunteer_refuses_a_lab_only_op_from_any_node(rogue_node):
    client, volunteer, log, marker, proc = rogue_node
    before = _refusals(log) + read_log(log).count("lab worker only")
    fut = client.get({"k": CatalogTask("k", get("transpose"), np.ones((2, 3)))}, "k", workers=[volunteer], sync=False)
    wait_for(lambda: _refusals(log) + read_log(log).count("lab worker only") > before or fut.status == "error",
             "the volunteer to refuse the lab-only op")
    assert fut.status != "finished"
    del fut


def test_volunteer_computes_catalog_tasks_for_any_node(rogue_node):
    """The refusals are not a blanket no: a catalog op with plain data runs and is right."""
    client, volunteer, log, marker, proc = rogue_node
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    result = client.get({"k": CatalogTask("k", get("matmul"), a, b)}, "k", workers=[volunteer])
    np.testing.assert_allclose(result, a @ b)
