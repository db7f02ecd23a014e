"""A stage program travels as its pickle, made once and decoded once per content, under the volunteer's unpickler.

A round's stage tasks carry the same program (thousands of steps for a GPT's forward and backward) to the
scheduler, to each volunteer and, in its check, to the lab worker; each of those pickled it again and again
(issue 28: 13 % of the scheduler's time in one training round).
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from dask._task_spec import TaskRef

import distributed.protocol.pickle as dpickle
from goblin_dask.ops import program as P
from goblin_dask.ops.registry import op_by_name
from goblin_dask.ops.spec import CatalogTask
from goblin_dask.safe_pickle import RefusedPickle, safe_loads
from goblin_dask.validation.checks import CheckTask, insert_checks


def _program(n: int = 64):
    return P._example_program(n, np.dtype(np.float32))


def _task(program, key="stage"):
    return CatalogTask(key, op_by_name("program"), TaskRef("a"), TaskRef("b"), placement="volunteer", program=program)


def test_a_stage_task_and_its_check_carry_the_program_as_one_pickle_made_once():
    program = _program()
    graph = insert_checks({"stage": _task(program)})
    check, raw = graph["stage"], next(v for k, v in graph.items() if k != "stage")
    assert isinstance(check, CheckTask) and isinstance(raw, CatalogTask)
    blob = P.program_pickle(program)
    assert blob == pickle.dumps(program, protocol=5)
    assert P.program_pickle(program) is blob  # made once per program object
    both = dpickle.dumps([raw, check])
    assert both.count(blob) == 1  # the same bytes object: pickled once for the task and its check
    raw2, check2 = dpickle.loads(both)
    assert raw2.kwargs["program"] == program and check2.kwargs["params"]["program"] == program
    assert raw2.kwargs["program"] is check2.kwargs["params"]["program"]  # decoded once, shared
    assert check2._token == check._token and raw2._get_token() == raw._get_token()
    again = dpickle.loads(dpickle.dumps(raw2))
    assert again.kwargs["program"] is raw2.kwargs["program"]
    assert P.program_token(again.kwargs["program"]) == P.program_token(program)


def test_a_decoded_program_runs_as_the_original():
    program = _program(48)
    task = safe_loads(dpickle.dumps(_task(program)))
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((48, 48)).astype(np.float32) for _ in range(2))
    got = task.func(a, b, **task.kwargs)
    np.testing.assert_array_equal(got, P.run(a, b, program=program))
    np.testing.assert_allclose(got[:48 * 48].reshape(48, 48), (a.astype(np.float64) @ b) + a, rtol=1e-4, atol=1e-4)


def test_a_program_pickle_naming_code_is_refused_wherever_it_is_decoded(tmp_path):
    """The bytes a task carries for its program decode under the volunteer's unpickler, at the lab too."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    task = _task(_program())
    state = list(task.__getstate__())
    at = task.get_all_slots().index("kwargs")
    kind = state[at]["program"][0]
    state[at] = {**state[at], "program": (kind, pickle.dumps(("goblin-program/1", Evil())))}
    forged = CatalogTask.__new__(CatalogTask)
    with pytest.raises(RefusedPickle, match="os.system|posix.system"):
        forged.__setstate__(tuple(state))
    assert not marker.exists()
