"""A volunteer's tasks share their inputs, and it fetches them nearest task first (issue 30).

Over a home link every input block is seconds of download.  Before, distributed's placement spread a
product's tiles so that each of two volunteers read every row and column panel (each home downloaded all
of A and B), and a volunteer fetched inputs in the priority each got from the first task naming it, so the
task that arrived first waited for its last input behind every input of later, higher-priority tasks.
"""

from __future__ import annotations

import numpy as np

import goblin_dask.array as ga
from goblin_dask.node.local import LabNode
from goblin_dask.volunteer.worker import volunteer_worker_class

PEER = "tls://127.0.0.1:1"


def test_a_volunteer_fetches_the_rest_of_a_started_task_before_another_tasks_inputs():
    """Task t1 (lower priority) arrives first and one of its inputs goes in flight; t2 (higher priority)
    arrives with two inputs.  Once that one is in, the next fetch is t1's other input (one fetch from
    runnable), not t2's c or d (distributed's own order fetched t2's first)."""
    from distributed.worker_state_machine import ComputeTaskEvent, GatherDep, GatherDepSuccessEvent

    state = volunteer_worker_class().goblin_state_class(address="tls://127.0.0.1:2", transfer_message_bytes_limit=1,
                                                        validate=True)
    sizes = {"a": 8, "b": 8, "c": 8, "d": 8}

    def arrive(key, deps, priority):
        return state.handle_stimulus(ComputeTaskEvent.dummy(key, who_has={d: [PEER] for d in deps},
                                                            nbytes={d: sizes[d] for d in deps}, priority=priority,
                                                            stimulus_id=f"arrive-{key}"))

    first = [set(i.to_gather) for i in arrive("t1", ["a", "b"], (5,)) if isinstance(i, GatherDep)]
    assert first in ([{"a"}], [{"b"}]), first
    assert not [i for i in arrive("t2", ["c", "d"], (1,)) if isinstance(i, GatherDep)]  # one fetch at a time
    (started,) = first[0]
    done = state.handle_stimulus(GatherDepSuccessEvent(worker=PEER, data={started: 1}, total_nbytes=8,
                                                       stimulus_id="in"))
    assert [set(i.to_gather) for i in done if isinstance(i, GatherDep)] == [{"a", "b"} - {started}], done


def test_each_volunteer_receives_about_three_quarters_of_the_panels(tmp_path):
    """A product cut into 4 x 4 output tiles (each a row panel of A and a column panel of B) on two volunteers:
    each receives half the row panels of one operand and all of the other's (3/4 of the panels), where before
    each received all of both (the exposure account: the share of each lab array a volunteer was sent)."""
    rng = np.random.default_rng(30)
    n = 1024
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    with LabNode.local(volunteers=2, state_dir=tmp_path / "lab", dashboard=False) as node, node.client.as_current():
        product = ga.from_array(a) @ ga.from_array(b)
        got = product.compute()
        report = node.report()
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)
    assert (len(product.chunks[0]), len(product.chunks[1])) == (4, 4), product.chunks
    exposure = report["exposure"]
    assert len(exposure) == 2 and all(len(shares) == 2 for shares in exposure.values()), exposure
    for name, shares in exposure.items():
        assert report["volunteers"][name]["accepted"] >= 4, report["volunteers"]  # both did the work
        # half of one operand's panels (a quarter more if it took one task of the other's run at the end)
        assert min(shares.values()) <= 0.75 and sum(shares.values()) / 2 <= 0.875, exposure
