"""What a volunteer claims (threads, memory) never moves other volunteers' work to the lab (issue 29, item 3).

The lab sizes every product's tiles from the volunteers' claims.  Before, one volunteer claiming 256 threads in
64 MiB cut a 1600^2 product into tiles so small that the lab computed all of them itself: the honest volunteer
that had 14 of its tasks got none.  Real lab node, real volunteer processes, TLS, 127.0.0.1.
"""

from __future__ import annotations

import numpy as np

import goblin_dask.array as ga
from goblin_dask.node.local import LabNode
from tests.conftest import read_log, wait_for

N = 1600
MIB = 2**20


def _honest_tasks(lab, honest: str, seed: int) -> int:
    """Tasks of one 1600^2 product of lab arrays that ``honest`` computed and the lab accepted (numpy's numbers)."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((N, N)), rng.standard_normal((N, N))
    before = lab.report()["volunteers"].get(honest, {}).get("accepted", 0)
    np.testing.assert_allclose((ga.from_array(a) @ ga.from_array(b)).compute(), a @ b, rtol=1e-10, atol=1e-9)
    return lab.report()["volunteers"][honest]["accepted"] - before


def _claimant(lab, threads: int, memory: int, wait: bool) -> str:
    return lab.add_volunteer(module="tests.hostile", nthreads=threads, wait=wait,
                             extra_args=("--attack", "claim", "--claim-memory", str(memory)))


def test_a_volunteers_claims_never_take_the_honest_volunteers_tasks(tmp_path):
    """The issue's reproduction: the honest volunteer's share of a 1600^2 product, alone and beside a claimant.
    A claim of less than ``goblin.admission.min-memory-per-thread`` per thread is refused at joining, naming
    the setting; the largest claim admitted (256 threads at the floor) leaves the honest volunteer tasks."""
    from scheduler_plugins.admission import VOLUNTEER_MAX_THREADS, min_memory_per_thread

    with LabNode.local(volunteers=1, state_dir=tmp_path / "lab") as lab, lab.client.as_current():
        [honest] = lab.volunteer_names()
        assert _honest_tasks(lab, honest, seed=1) > 0

        # 256 threads in 64 MiB (admitted before): refused, and told why
        tiny = _claimant(lab, VOLUNTEER_MAX_THREADS, 64 * MIB, wait=False)
        proc = lab.processes[tiny]
        wait_for(lambda: proc.poll() is not None or tiny in lab.volunteer_names(), "the 64 MiB claimant to be answered",
                 timeout=120)
        assert tiny not in lab.volunteer_names()
        assert "min-memory-per-thread" in read_log(lab._log_path(tiny)), read_log(lab._log_path(tiny))[-2000:]
        assert any("min-memory-per-thread" in r["reason"] for r in lab.report()["refusals"]), lab.report()["refusals"]

        # the most a claim may say: 256 threads at the floor each
        claimant = _claimant(lab, VOLUNTEER_MAX_THREADS, VOLUNTEER_MAX_THREADS * min_memory_per_thread(), wait=True)
        assert claimant in lab.volunteer_names()
        assert _honest_tasks(lab, honest, seed=2) > 0


def test_a_volunteer_claiming_many_threads_holds_at_most_its_cap_and_the_honest_volunteer_keeps_its_share(tmp_path):
    """Issue 29: a claimant of 256 threads was handed 252 of a product's 256 tasks at once, each held until its
    deadline.  Now it holds at most ``goblin.placement.max-held-per-volunteer`` (counted by the claimant itself,
    from its own worker's state), the rest wait for a free slot, the honest volunteer gets tasks, and the product is
    numpy's."""
    import re

    from scheduler_plugins.admission import VOLUNTEER_MAX_THREADS, min_memory_per_thread
    from scheduler_plugins.held_tasks import cap_for, max_held_per_volunteer

    most = max_held_per_volunteer()
    assert most < VOLUNTEER_MAX_THREADS  # the default bites on the largest claim admitted
    with LabNode.local(volunteers=1, state_dir=tmp_path / "lab") as lab, lab.client.as_current():
        [honest] = lab.volunteer_names()
        claimant = _claimant(lab, VOLUNTEER_MAX_THREADS, VOLUNTEER_MAX_THREADS * min_memory_per_thread(), wait=True)
        honest_tasks = _honest_tasks(lab, honest, seed=3)
        report = lab.report()
        claimant_tasks = report["volunteers"][claimant]["accepted"]
        holding = report["holding"]
        assert holding["cap"] == {honest: cap_for(1, most), claimant: most}, holding
        held = [int(n) for n in re.findall(r"hostile: held (\d+) tasks at once", read_log(lab._log_path(claimant)))]
        assert held, read_log(lab._log_path(claimant))[-2000:]
        # the cap bit (it held as many as it may) and was never passed, by the claimant's own count
        assert max(held) == most and holding["most_held"][claimant] == most, (held, holding)
        assert holding["most_held"][honest] <= cap_for(1, most), holding
        assert honest_tasks > 0 and claimant_tasks > 0, (honest_tasks, claimant_tasks)
        assert holding["held_back"] == 0, holding  # none left waiting once the product is done
        print(f"honest {honest_tasks}, claimant {claimant_tasks}, most held {holding['most_held']}")
